"""Storage operations per tick, counted around the memory store and the Blob store.

Blob Storage bills (and throttles) per operation, and a timer fires whether or
not there is work, so the cost of a tick is part of the contract:

* idle tick: 1 read, 0 writes (the source is peeked before taking the lease);
* tick with k batches: 1 read, k + 1 writes (acquire, k commits; the release
  rides on the last commit; no "load checkpoint" read after acquiring);
* contended tick (another instance holds a live lease): 1 read, 0 writes;
* handler failure: 1 read, 2 writes (acquire; failure record + release in one).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dbtrigger import (
    HandlerError,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.testing import CountingStore, StoreCall, StoreCounts
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.store_kinds import blob_store

BATCH = 5


@pytest.fixture(params=["memory", pytest.param("blob", marks=pytest.mark.azurite)])
def inner_store(request: pytest.FixtureRequest) -> Iterator[CheckpointStore]:
    if request.param == "memory":
        yield InMemoryCheckpointStore()
        return
    azurite: Azurite = request.getfixturevalue("azurite")
    yield from blob_store(azurite, app_name="ops")


@pytest.fixture
def store(inner_store: CheckpointStore) -> CountingStore:
    return CountingStore(inner_store)


@pytest.fixture
def table(sqlite_db: TestDatabase) -> TestDatabase:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT NOT NULL)")
    return sqlite_db


def add_rows(db: TestDatabase, first: int, count: int) -> None:
    db.execute(
        "INSERT INTO orders VALUES (:id, :ts)",
        [
            {"id": i, "ts": f"2026-01-01 00:{i // 60:02d}:{i % 60:02d}"}
            for i in range(first, first + count)
        ],
    )


@pytest.fixture
def trigger(table: TestDatabase, store: CountingStore) -> Iterator[PollTrigger]:
    source = SqlAlchemySource(
        url=table.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    yield PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        batch_size=BATCH,
        max_batches_per_tick=10,
    )
    source.close()


def noop(events: list[RowChange]) -> None:
    return None


def test_idle_tick_is_one_read(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase
) -> None:
    # Before any state exists ...
    assert trigger.tick(noop) == 0
    assert store.reset() == StoreCounts(reads=1)
    # ... and after a commit.
    add_rows(table, 1, 3)
    assert trigger.tick(noop) == 3
    store.reset()
    assert trigger.tick(noop) == 0
    assert store.counts == StoreCounts(reads=1)
    assert store.calls == [StoreCall("read", "orders")]


@pytest.mark.parametrize(
    ("rows", "batches"), [(1, 1), (BATCH, 1), (13, 3), (2 * BATCH, 2), (50, 10)]
)
def test_tick_with_k_batches_is_one_read_and_k_plus_one_writes(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase, rows: int, batches: int
) -> None:
    add_rows(table, 1, rows)
    result = trigger.tick_result(noop)
    assert (result.rows, result.batches) == (rows, batches)
    assert store.counts == StoreCounts(reads=1, writes=batches + 1)
    assert store.calls == [StoreCall("read", "orders")] + [StoreCall("write", "orders")] * (
        batches + 1
    )
    state = trigger.read_state()
    assert state is not None
    assert state.lease is not None
    assert state.lease.released  # released in the last commit, not by an extra write


def test_tick_that_stops_at_max_batches_still_folds_the_release(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase
) -> None:
    add_rows(table, 1, 60)  # 12 batches, the tick stops after 10
    result = trigger.tick_result(noop)
    assert (result.batches, result.more) == (10, True)
    assert store.counts == StoreCounts(reads=1, writes=11)
    store.reset()
    assert trigger.tick_result(noop).batches == 2
    assert store.counts == StoreCounts(reads=1, writes=3)


def test_contended_tick_is_one_read(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase
) -> None:
    add_rows(table, 1, 3)
    held = leasemod.decide_acquire(
        None,
        poller="orders",
        fingerprint=trigger.fingerprint,
        owner="someone-else",
        now=dt.datetime.now(dt.timezone.utc),
        ttl=dt.timedelta(minutes=5),
    )
    assert isinstance(held, leasemod.Acquired)
    store.inner.write("orders", docmod.dumps(held.document), if_match=None)
    store.reset()
    result = trigger.tick_result(noop)
    assert (result.rows, result.outcome) == (0, "lease_busy")
    assert store.counts == StoreCounts(reads=1)


def test_handler_failure_tick_is_one_read_and_two_writes(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase
) -> None:
    add_rows(table, 1, 3)

    def failing(events: list[RowChange]) -> None:
        raise RuntimeError("sink down")

    with pytest.raises(HandlerError):
        trigger.tick(failing)
    assert store.counts == StoreCounts(reads=1, writes=2)
    state = trigger.read_state()
    assert state is not None
    assert state.lease is not None
    assert state.lease.released
    assert state.failure is not None
    assert state.failure.attempts == 1


@pytest.mark.parametrize("rows", [7, 23])
def test_per_event_outcomes_cost_no_extra_store_operation(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase, tmp_path: Path, rows: int
) -> None:
    """ctx.reject / ctx.retry (and the settled window they create) ride on the
    batch's one commit: still 1 read and k + 1 writes per tick."""
    trigger = PollTrigger(
        name="orders",
        source=trigger.source,
        checkpoint_store=store,
        batch_size=BATCH,
        max_batches_per_tick=10,
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
    )
    add_rows(table, 1, rows)

    def marking(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            if int(e.pk["id"]) % 3 == 0:
                ctx.retry(e, "busy")
            elif int(e.pk["id"]) % 5 == 0:
                ctx.reject(e, "bad")

    result = trigger.tick_result(marking)
    assert result.rows == rows
    assert store.counts == StoreCounts(reads=1, writes=result.batches + 1)
    state = trigger.read_state()
    assert state is not None
    assert state.window is not None
    # The next tick reads the window once more and, the retries not being due,
    # is idle: one read, no write.
    store.reset()
    assert trigger.tick_result(marking).outcome == "idle"
    assert store.counts == StoreCounts(reads=1)


@pytest.mark.parametrize("subscribers", [1, 2, 5])
def test_fan_out_costs_no_extra_store_operation_however_many_subscribers(
    trigger: PollTrigger,
    store: CountingStore,
    table: TestDatabase,
    tmp_path: Path,
    subscribers: int,
) -> None:
    """subscribers=: one fetch and one commit per batch for all of them, their
    outcomes (and who still owes a retried event) riding on that commit:
    1 read and k + 1 writes per tick, <= 1 store write per batch plus the acquire."""

    def sub(n: int) -> Callable[[list[RowChange], BatchContext], None]:
        def handle(events: list[RowChange], ctx: BatchContext) -> None:
            for e in events:
                if int(e.pk["id"]) % (3 + n) == 0:
                    ctx.retry(e, "busy")
                elif int(e.pk["id"]) % 7 == 0 and n == 0:
                    ctx.reject(e, "bad")

        return handle

    trigger = PollTrigger(
        name="orders",
        source=trigger.source,
        checkpoint_store=store,
        batch_size=BATCH,
        max_batches_per_tick=10,
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
        subscribers={f"s{n}": sub(n) for n in range(subscribers)},
    )
    add_rows(table, 1, 23)
    result = trigger.tick_result()
    assert result.rows == 23
    assert result.batches == 5
    assert store.counts == StoreCounts(reads=1, writes=result.batches + 1)
    store.reset()
    assert trigger.tick_result().outcome == "idle"  # retries not due yet
    assert store.counts == StoreCounts(reads=1)


@pytest.mark.parametrize("marks", [False, True])
def test_lanes_and_their_prefetch_cost_no_extra_store_operation(
    trigger: PollTrigger, store: CountingStore, table: TestDatabase, tmp_path: Path, marks: bool
) -> None:
    """max_concurrency=4 reads the next batch while the lanes run (used as is
    without marks, dropped and read again when a retry moves the window): the
    store still sees 1 read and k + 1 writes per tick."""
    trigger = PollTrigger(
        name="orders",
        source=trigger.source,
        checkpoint_store=store,
        batch_size=BATCH,
        max_batches_per_tick=10,
        max_concurrency=4,
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
    )
    add_rows(table, 1, 23)

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            if marks and int(e.pk["id"]) % 4 == 0:
                ctx.retry(e, "busy")

    result = trigger.tick_result(handler)
    assert (result.rows, result.batches) == (23, 5)
    assert store.counts == StoreCounts(reads=1, writes=result.batches + 1)
