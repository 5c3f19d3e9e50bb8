"""A member's drain during a handover: a partition it now owns is still leased by
its previous owner, a live member finishing a batch. The drain waits for that
batch (boundedly) instead of returning "drained" with the partition's rows
waiting, and a round is not "caught up" while it lasts.

The previous owner is held mid-batch by a gate, never by timing; waits are for
outcomes, with bounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.errors import LeaseAcquireError
from dbtrigger.partitions import PartitionedPoller, bucket_of
from dbtrigger.state.stores.base import CheckpointStore
from tests.databases import TestDatabase

ROWS = 400
BOUND = 60.0  # seconds any awaited outcome may take on a loaded machine


class Clock:
    """A monotonic clock the test moves by hand (balancing only)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def handover_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    from tests.databases import make_database  # noqa: PLC0415 - the conftest's factory

    yield from make_database(request.param, tmp_path)


def make_table(db: TestDatabase) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (:id, :id)"),
            [{"id": i} for i in range(1, ROWS + 1)],
        )


def member(db: TestDatabase, store: CheckpointStore, name: str, clock: Clock) -> PartitionedPoller:
    return PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=db.url,
            table="orders",
            schema=db.schema,
            cursor_column="seq",
            pk_columns=["id"],
            visibility="none",
        ),
        checkpoint_store=store,
        partitions=4,
        balance_interval_seconds=1,
        member_ttl_seconds=3,
        join_window_seconds=0,
        member_id=name,
        monotonic=clock,
        background=False,  # the test balances by hand
        batch_size=10,
        max_batches_per_tick=1,  # the previous owner's tick leaves rows behind it
    )


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"not within {BOUND:g}s: {what}"
        time.sleep(0.01)


class Handover:
    """Members a and b share four partitions; a (the previous owner, alive) is held
    mid-batch on one of b's partitions by a gate until :meth:`finish`."""

    def __init__(self, db: TestDatabase, tmp_path: Path) -> None:
        make_table(db)
        store = FileCheckpointStore(tmp_path / "state")
        clock = Clock()
        self.a = member(db, store, "a", clock)
        self.b = member(db, store, "b", clock)
        self.a.balance()
        for _ in range(3):  # b joins; a sheds and b steals until each holds its share
            clock.now += 1
            self.b.balance()
            self.a.balance()
        assert sorted([len(self.a.owned), len(self.b.owned)]) == [2, 2]
        self.pid = self.b.owned[0]
        self.seen: list[int] = []
        self.lock = threading.Lock()
        for other in self.b.owned[1:]:  # b's other partition has nothing left: a round
            self.b.trigger(other).drain(self.handle)  # finds only the handover waiting
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.thread = threading.Thread(target=self._previous_owner, daemon=True)

    def _previous_owner(self) -> None:
        def handle(events: list[RowChange]) -> None:
            self.entered.set()
            assert self.gate.wait(BOUND), "the gate was never opened"
            self.handle(events)

        self.a.trigger(self.pid).tick(handle)

    def handle(self, events: list[RowChange]) -> None:
        with self.lock:
            self.seen.extend(e.pk["id"] for e in events)

    @contextmanager
    def held(self) -> Iterator[None]:
        """a holds the partition's lease (inside its handler) for the block."""
        self.thread.start()
        try:
            assert self.entered.wait(BOUND), "the previous owner never started its batch"
            yield
        finally:
            self.gate.set()
            self.thread.join(BOUND)
            assert not self.thread.is_alive()

    def owned_by_b(self) -> set[int]:
        spans = [self.b.trigger(p).source for p in self.b.owned]
        parts = [s.partition for s in spans]  # type: ignore[attr-defined]
        return {i for i in range(1, ROWS + 1) if any(p.lo <= bucket_of([i]) < p.hi for p in parts)}


def test_a_drain_waits_for_the_previous_owners_batch_in_flight(
    handover_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Handover(handover_db, tmp_path)
    rounds = threading.Semaphore(0)
    tick_result = h.b.tick_result

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return tick_result(*args, **kwargs)
        finally:
            rounds.release()

    monkeypatch.setattr(h.b, "tick_result", counted)
    drained: list[int] = []
    with h.held():
        drain = threading.Thread(target=lambda: drained.append(h.b.drain(h.handle)), daemon=True)
        drain.start()
        # b's first round ran while a held the partition's lease: whatever the drain
        # does next, it has seen the handover. Then a finishes its batch.
        assert rounds.acquire(timeout=BOUND), "b's drain never completed a round"
    drain.join(BOUND)
    assert not drain.is_alive()
    assert drained, "the drain raised"
    missing = h.owned_by_b() - set(h.seen)
    assert not missing, f"the drain returned with {len(missing)} row(s) of its partitions waiting"


def test_a_handover_past_the_budget_is_reported_not_called_drained(
    handover_db: TestDatabase, tmp_path: Path
) -> None:
    h = Handover(handover_db, tmp_path)
    with h.held(), pytest.raises(LeaseAcquireError) as raised:
        h.b.drain(h.handle, handover_wait_seconds=0.3)
    message = str(raised.value)
    assert h.pid in message
    assert "handover_wait_seconds=" in message


def test_a_round_is_not_caught_up_while_a_handover_lasts(
    handover_db: TestDatabase, tmp_path: Path
) -> None:
    """The worker's "caught up" line reads ``caught_up``: not while a partition's
    rows wait for its previous owner's batch."""
    h = Handover(handover_db, tmp_path)
    with h.held():
        result = h.b.tick_result(h.handle)
        assert result.rows == 0
        assert result.outcome == "idle"
        assert not result.caught_up
        assert result.handover == (h.pid,)
        text, _ = result.summary(1.0)
        assert f"partition(s) {h.pid} still leased by their previous owner" in text
        assert "lag 0 rows" not in text
