"""Checkpoint store adapters: where a poller keeps its state document (public).

The port is :class:`CheckpointStore`; ``docs/stores.md`` compares the stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbtrigger import _lazy
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument
from dbtrigger.state.stores.file import FileCheckpointStore
from dbtrigger.state.stores.memory import InMemoryCheckpointStore

if TYPE_CHECKING:
    from dbtrigger.state.stores.blob import BlobCheckpointStore
    from dbtrigger.state.stores.sql import SqlCheckpointStore
    from dbtrigger.state.stores.table import TableCheckpointStore

# Stores whose module pulls in an optional SDK are imported on first access, so
# ``import dbtrigger`` works without them: name -> module.
_LAZY = {
    "BlobCheckpointStore": "dbtrigger.state.stores.blob",
    "SqlCheckpointStore": "dbtrigger.state.stores.sql",
    "TableCheckpointStore": "dbtrigger.state.stores.table",
}


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)

__all__ = [
    "BlobCheckpointStore",
    "CheckpointStore",
    "FileCheckpointStore",
    "InMemoryCheckpointStore",
    "SqlCheckpointStore",
    "StoredDocument",
    "TableCheckpointStore",
]
