"""Counting storage calls.

:class:`CountingStore` wraps any :class:`~dbtrigger.state.stores.base.CheckpointStore`
and records every call made through it. Storage is billed (and throttled) per
operation, so "how many reads and writes does one tick cost" is a property
worth asserting in tests, for this library and for applications that wrap it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from dbtrigger.state.stores.base import CheckpointStore, StoredDocument


@dataclass(frozen=True)
class StoreCall:
    """One call through a :class:`CountingStore`.

    ``op`` is ``read``, ``write``, ``delete`` or ``list``; ``error`` names the
    exception class the call raised, or is None when it returned.
    """

    op: str
    key: str | None
    error: str | None = None


@dataclass(frozen=True)
class StoreCounts:
    """Calls per operation, failed calls included (a failed write is still paid for)."""

    reads: int = 0
    writes: int = 0
    deletes: int = 0
    lists: int = 0


class CountingStore:
    """A pass-through ``CheckpointStore`` that counts and logs each call.

    Thread-safe. ``describe()`` is not counted: it performs no storage
    operation in any store.

    Example::

        store = CountingStore(BlobCheckpointStore(...))
        trigger = PollTrigger(..., checkpoint_store=store)
        store.reset()
        trigger.tick(handler)
        assert store.counts == StoreCounts(reads=1, writes=0)  # an idle tick
    """

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._calls: list[StoreCall] = []

    @property
    def calls(self) -> list[StoreCall]:
        """Every call since the last :meth:`reset`, in order."""
        with self._lock:
            return list(self._calls)

    @property
    def counts(self) -> StoreCounts:
        with self._lock:
            ops = [c.op for c in self._calls]
        return StoreCounts(
            reads=ops.count("read"),
            writes=ops.count("write"),
            deletes=ops.count("delete"),
            lists=ops.count("list"),
        )

    def reset(self) -> StoreCounts:
        """Forget the calls so far; returns their counts."""
        counts = self.counts
        with self._lock:
            self._calls.clear()
        return counts

    @contextlib.contextmanager
    def _counted(self, op: str, key: str | None) -> Iterator[None]:
        """Record one ``op`` call of the block inside, whether it returns or raises."""
        try:
            yield
        except BaseException as exc:
            self._record(op, key, exc)
            raise
        self._record(op, key, None)

    def _record(self, op: str, key: str | None, error: BaseException | None) -> None:
        with self._lock:
            self._calls.append(StoreCall(op, key, type(error).__name__ if error else None))

    def read(self, key: str) -> StoredDocument | None:
        with self._counted("read", key):
            return self.inner.read(key)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        with self._counted("write", key):
            return self.inner.write(key, data, if_match=if_match)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        with self._counted("delete", key):
            self.inner.delete(key, if_match=if_match)

    def list_keys(self) -> list[str]:
        with self._counted("list", None):
            return self.inner.list_keys()

    def describe(self) -> str:
        return self.inner.describe()


__all__ = ["CountingStore", "StoreCall", "StoreCounts"]
