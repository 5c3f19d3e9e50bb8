"""Durable history: every commit and manual operation, kept beside the state document.

The state document's journal is a short recent view (``journal_limit``
entries); the history keeps every entry for as long as its retention says,
in the same store family as the state: JSON-lines files, append blobs, a SQL
table, Table Storage entities. Commit records carry digests of the delivered
event ids and images and one line per event, which is what a replay compares
against (``dbtrigger replay``; see docs/history.md).

``PollTrigger`` keeps one by default (``history=False`` turns it off, a
:class:`HistoryStore` chooses another); :func:`history_for` is the one a
checkpoint store gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dbtrigger.history.derive import history_for
from dbtrigger.history.file import FileHistory
from dbtrigger.history.memory import MemoryHistory
from dbtrigger.history.recorder import HistoryRecorder
from dbtrigger.history.sql import SqlHistory
from dbtrigger.history.store import DEFAULT_RETENTION, HistoryStore, Retention
from dbtrigger.history.view import find_batch, load
from dbtrigger.history.wiring import NO_HISTORY

if TYPE_CHECKING:
    from dbtrigger.history.blob import BlobHistory
    from dbtrigger.history.table import TableHistory


def __getattr__(name: str) -> Any:
    """The Azure adapters load on use: the azure extra is optional."""
    if name == "BlobHistory":
        from dbtrigger.history.blob import BlobHistory  # noqa: PLC0415

        return BlobHistory
    if name == "TableHistory":
        from dbtrigger.history.table import TableHistory  # noqa: PLC0415

        return TableHistory
    raise AttributeError(name)


__all__ = [
    "DEFAULT_RETENTION",
    "NO_HISTORY",
    "BlobHistory",
    "FileHistory",
    "HistoryRecorder",
    "HistoryStore",
    "MemoryHistory",
    "Retention",
    "SqlHistory",
    "TableHistory",
    "find_batch",
    "history_for",
    "load",
]
