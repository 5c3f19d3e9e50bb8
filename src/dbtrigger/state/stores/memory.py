"""In-process checkpoint store: for unit tests and single-process experiments.

It passes the same contract suite as the durable stores, so a test written
against it exercises the same compare-and-swap semantics.
"""

from __future__ import annotations

import itertools
import threading

from dbtrigger.state.stores.base import StoredDocument, check_match


class InMemoryCheckpointStore:
    """Documents in a dict, guarded by a lock; etags from a global counter."""

    def __init__(self) -> None:
        self._docs: dict[str, StoredDocument] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count(1)

    def read(self, key: str) -> StoredDocument | None:
        with self._lock:
            return self._docs.get(key)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        with self._lock:
            current = self._docs.get(key)
            check_match(current, if_match, repr(key))
            etag = f'"m{next(self._counter)}"'
            self._docs[key] = StoredDocument(bytes(data), etag)
            return etag

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        with self._lock:
            current = self._docs.get(key)
            if current is None:
                return
            if if_match is not None:
                check_match(current, if_match, repr(key))
            del self._docs[key]

    def list_keys(self) -> list[str]:
        with self._lock:
            return sorted(self._docs)

    def describe(self) -> str:
        return "memory"
