"""Checkpoint store adapters."""

from dbtrigger.state.stores.base import CheckpointStore, StoredDocument
from dbtrigger.state.stores.file import FileCheckpointStore
from dbtrigger.state.stores.memory import InMemoryCheckpointStore

__all__ = ["CheckpointStore", "FileCheckpointStore", "InMemoryCheckpointStore", "StoredDocument"]
