"""A write whose answer was lost and that lands only after the re-read.

Blob Storage may finish a PUT after the client gave up on its answer: the
re-read then still shows the old etag, the poller writes again, and that second
write loses the compare-and-swap to its own first one. Finding its own bytes
there, the poller must take the write as landed: it is not a conflict (the
commit is done, once), and not a lost lease.
"""

from __future__ import annotations

from pathlib import Path

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.errors import AmbiguousWriteError
from dbtrigger.state import document as docmod
from dbtrigger.state.stores import StoredDocument
from tests.databases import TestDatabase
from tests.test_runtime_state_errors import make_events


class LateLandingStore:
    """The file store, but its ``late``-th write lands only at the next write call."""

    def __init__(self, inner: FileCheckpointStore, late: int) -> None:
        self.inner, self.late, self.writes = inner, late, 0
        self.pending: tuple[str, bytes, str | None] | None = None

    def read(self, key: str) -> StoredDocument | None:
        return self.inner.read(key)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        self.writes += 1
        if self.pending is not None:  # the server finishes the first request now
            late_key, late_data, late_match = self.pending
            self.pending = None
            self.inner.write(late_key, late_data, if_match=late_match)
        if self.writes == self.late:
            self.pending = (key, data, if_match)
            raise AmbiguousWriteError("injected: no answer yet; the write lands later")
        return self.inner.write(key, data, if_match=if_match)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self.inner.delete(key, if_match=if_match)

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def describe(self) -> str:
        return self.inner.describe()


def test_a_commit_landing_after_its_reread_is_taken_as_landed_once(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    store = LateLandingStore(FileCheckpointStore(tmp_path), late=2)  # 1: acquire, 2: commit
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 3),
        checkpoint_store=store,
        max_batches_per_tick=1,
    )
    seen: list[RowChange] = []
    trigger.tick(seen.extend)  # before: LostLeaseError, "the lease was already released"
    assert len(seen) == 3
    assert store.pending is None  # the late write did land
    stored = store.read("orders")
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.position.pk == {"id": 3}
    assert doc.lease is not None
    assert doc.lease.released
    commits = [e for e in doc.journal if e["type"] == "commit"]
    assert len(commits) == 1  # committed once, not again over its own late write
    again: list[RowChange] = []
    trigger.tick(again.extend)
    assert again == []


def test_a_commit_that_keeps_the_lease_landing_late_is_journaled_once(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    store = LateLandingStore(FileCheckpointStore(tmp_path), late=2)  # the first of two commits
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 4),
        checkpoint_store=store,
        batch_size=2,
        max_batches_per_tick=2,
    )
    seen: list[RowChange] = []
    trigger.tick(seen.extend)
    assert [r.pk["id"] for r in seen] == [1, 2, 3, 4]
    stored = store.read("orders")
    assert stored is not None
    doc = docmod.loads(stored.data)
    commits = [e["batch_id"] for e in doc.journal if e["type"] == "commit"]
    assert len(commits) == len(set(commits)) == 2  # each batch once


def test_an_acquire_landing_after_its_reread_is_taken_as_acquired(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """The late write is the lease acquisition: taken as a lost race, the tick
    delivered nothing and left its own lease to block the poller for a whole TTL
    (a live lease is taken over by nobody, its owner included)."""
    store = LateLandingStore(FileCheckpointStore(tmp_path), late=1)
    trigger = PollTrigger(name="orders", source=make_events(sqlite_db, 3), checkpoint_store=store)
    seen: list[RowChange] = []
    trigger.tick(seen.extend)
    assert [r.pk["id"] for r in seen] == [1, 2, 3]
    stored = store.read("orders")
    assert stored is not None
    lease = docmod.loads(stored.data).lease
    assert lease is not None
    assert lease.released
    assert lease.fencing_token == 1
