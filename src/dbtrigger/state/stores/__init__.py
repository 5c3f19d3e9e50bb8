"""Checkpoint store adapters."""

from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415 - deferred on purpose, see _LAZY

    return getattr(importlib.import_module(module), name)


__all__ = [
    "BlobCheckpointStore",
    "CheckpointStore",
    "FileCheckpointStore",
    "InMemoryCheckpointStore",
    "SqlCheckpointStore",
    "StoredDocument",
    "TableCheckpointStore",
]
