"""Parallel lanes (``max_concurrency``): concurrent calls, one key per lane,
a failing lane, and the storage cost (SQLite and PostgreSQL, file store)."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import azure.functions as func
import pytest
import sqlalchemy as sa

from dbtrigger import (
    DbBindings,
    DbOut,
    FetchError,
    FileCheckpointStore,
    HandlerError,
    LostLeaseError,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.kernel import Lanes, split
from dbtrigger.sources.rows import Rows
from dbtrigger.testing import CountingStore, StoreCounts
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    bump,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    steal_lease,
)
from tests.test_azure_functions import assert_host_accepts, timer


def event(i: int, key: int) -> RowChange:
    return RowChange(
        event_id=f"e{i}",
        op="upsert",
        source="s",
        cursor=i,
        pk={"id": key},
        before=None,
        after=None,
    )


def test_lanes_keep_a_key_together_in_batch_order() -> None:
    events = [event(i, i % 7) for i in range(40)]
    parts = split(events, 4)
    assert sorted(e.event_id for part in parts for e in part) == sorted(e.event_id for e in events)
    for part in parts:
        assert [e.cursor for e in part] == sorted(e.cursor for e in part)
    # One key, one lane: all events of a key are in the same part.
    lanes_of_key: dict[int, set[int]] = {}
    for index, part in enumerate(parts):
        for e in part:
            lanes_of_key.setdefault(int(e.pk["id"]), set()).add(index)
    assert all(len(v) == 1 for v in lanes_of_key.values())
    assert split(events, 4) == parts  # deterministic: a redelivery splits the same way
    assert split(events, 1) == [events]
    assert split([], 4) == []
    # A key value that cannot be a dict key (bytearray) is grouped by its JSON form.
    odd = [
        RowChange(
            event_id=f"o{i}",
            op="upsert",
            source="s",
            cursor=i,
            pk={"id": bytearray([i % 2])},
            before=None,
            after=None,
        )
        for i in range(6)
    ]
    assert sorted(len(p) for p in split(odd, 4)) == [3, 3]


def test_an_update_that_moved_a_row_to_another_key_keeps_both_keys_in_one_lane() -> None:
    # A log source's `UPDATE t SET id = 40 WHERE id = 4` is one update event keyed 40 with
    # the old key in `before`; a new row 4 inserted after it was keyed 4. In two lanes the
    # insert could be handled before the update, whose handler removes row 4.
    def change(i: int, op: str, key: int, before: dict[str, int] | None) -> RowChange:
        after = {"id": key, "v": i}
        return RowChange(
            event_id=f"k{i}",
            op=op,
            source="s",
            cursor=i,
            pk={"id": key},
            before=before,
            after=after,
        )

    events = [
        change(0, "insert", 4, None),
        change(1, "update", 40, {"id": 4}),  # PostgreSQL's default replica identity: the key
        change(2, "insert", 4, None),
        change(3, "update", 400, {"id": 40, "v": 1}),  # a whole before image (MariaDB)
        change(4, "update", 7, {"id": 7, "v": 0}),  # the key unchanged
        *(change(5 + i, "insert", 100 + i, None) for i in range(6)),
    ]
    parts = split(events, 4)
    lane = {e.event_id: n for n, part in enumerate(parts) for e in part}
    assert lane["k0"] == lane["k1"] == lane["k2"] == lane["k3"]
    together = next(part for part in parts if events[0] in part)
    assert [e.event_id for e in together] == ["k0", "k1", "k2", "k3"]  # batch order
    assert len(parts) == 4  # the other keys still spread


def test_lanes_are_near_equal() -> None:
    """The batch waits for its slowest lane: distinct keys split evenly, and a
    key with many events is balanced against the others."""
    events = [event(i, i) for i in range(500)]
    assert sorted(len(p) for p in split(events, 16)) == [31] * 12 + [32] * 4
    events = [event(i, 0 if i % 2 else i) for i in range(40)]  # key 0: 21 events
    sizes = sorted(len(p) for p in split(events, 4))
    assert sizes == [6, 6, 7, 21]
    assert len(split(events[:3], 16)) == 2  # never more lanes than keys (0, 0, 2)


@pytest.mark.parametrize("bad", [0, -1])
def test_max_concurrency_below_one_is_refused(
    sqlite_db: TestDatabase, tmp_path: Path, bad: int
) -> None:
    items_table(sqlite_db)
    with pytest.raises(ConfigurationError, match="max_concurrency"):
        make_trigger(items_source(sqlite_db), FileCheckpointStore(tmp_path), max_concurrency=bad)


def test_lanes_run_at_the_same_time(db: TestDatabase, tmp_path: Path) -> None:
    """Four lanes meet at a barrier: this only returns if the calls overlap."""
    table = items_table(db)
    add_items(db, table, range(1, 41))
    store = CountingStore(FileCheckpointStore(tmp_path / "state"))
    trigger = make_trigger(items_source(db), store, batch_size=40, max_concurrency=4)
    barrier = threading.Barrier(4, timeout=20)
    calls: list[list[int]] = []
    lock = threading.Lock()

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        with lock:
            calls.append([int(e.pk["id"]) for e in events])
        barrier.wait()

    assert trigger.tick(handler) == 40
    assert len(calls) == 4
    assert sorted(i for call in calls for i in call) == list(range(1, 41))
    for call in calls:
        assert call == sorted(call)  # each lane in cursor order (version = id * 10)
    # Storage cost does not depend on the lanes: 1 read, acquire + 1 commit.
    assert store.counts == StoreCounts(reads=1, writes=2)
    assert checkpoint_id(store) == 40


def test_a_failing_lane_fails_only_its_rows(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 21))
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(items_source(sqlite_db), store, batch_size=20, max_concurrency=4)
    broken = {7}
    seen: list[int] = []
    lock = threading.Lock()

    def handler(events: list[RowChange]) -> None:
        ids = [int(e.pk["id"]) for e in events]
        with lock:
            seen.extend(ids)
        if broken.intersection(ids):
            raise ValueError("downstream refused 7")

    with pytest.raises(HandlerError):
        trigger.tick(handler)
    first = list(seen)
    assert sorted(first) == list(range(1, 21))
    broken.clear()
    seen.clear()
    assert trigger.drain(handler) > 0
    # Only the failing lane's rows came again: the other lanes' rows were settled.
    lane = next(p for p in split_ids(range(1, 21), 4) if 7 in p)
    assert sorted(seen) == sorted(lane)
    assert checkpoint_id(store) == 20


def split_ids(ids: range, lanes: int) -> list[list[int]]:
    return [[int(e.pk["id"]) for e in part] for part in split([event(i, i) for i in ids], lanes)]


def test_per_event_marks_work_across_lanes(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 13))
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(items_source(sqlite_db), store, batch_size=12, max_concurrency=3)

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            if int(e.pk["id"]) == 5:
                ctx.retry(e, "busy")

    assert trigger.tick(handler) == 12
    assert checkpoint_id(store) == 4  # 5 pins the checkpoint, whatever lane it ran in
    bump(sqlite_db, table, 5, 500)  # updated since: a new tuple, delivered again
    assert trigger.drain(lambda events: None) == 1
    assert checkpoint_id(store) == 5


def test_async_lanes_overlap_on_the_callers_loop(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 21))
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(items_source(sqlite_db), store, batch_size=20, max_concurrency=4)
    in_flight = 0
    most = 0
    loops: set[int] = set()

    async def handler(events: list[RowChange]) -> None:
        nonlocal in_flight, most
        loops.add(id(asyncio.get_running_loop()))
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.2)
        in_flight -= 1

    async def main() -> int:
        return await trigger.tick_async(handler)

    assert asyncio.run(main()) == 20
    assert len(loops) == 1  # every lane's task ran on the caller's loop
    assert most >= 2  # and they overlapped


def test_functions_trigger_runs_lanes_from_a_timer(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """``@db.trigger(..., max_concurrency=4)`` in a real ``FunctionApp``: the host
    indexes the function, and one timer invocation hands the batch to four
    concurrent calls (they meet at a barrier), each with its own output rows."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 41))
    sqlite_db.execute("CREATE TABLE seen (id INTEGER PRIMARY KEY, lane TEXT NOT NULL)")
    store = FileCheckpointStore(tmp_path / "state")
    app = func.FunctionApp()
    db = DbBindings()
    barrier = threading.Barrier(4, timeout=20)
    timers: list[object] = []

    @app.function_name(name="items_lanes")
    @app.schedule(schedule="0 */1 * * * *", arg_name="timer")
    @db.trigger(
        arg_name="events",
        source=items_source(sqlite_db),
        checkpoint_store=store,
        name="items",
        batch_size=40,
        max_concurrency=4,
    )
    @db.output("out", url=sqlite_db.url, table="seen")
    def items_lanes(timer: func.TimerRequest, events: list[RowChange], out: DbOut) -> None:
        timers.append(timer)
        barrier.wait()
        lane = threading.current_thread().name
        out.set([{"id": int(e.pk["id"]), "lane": lane} for e in events])

    (function,) = app.get_functions()
    assert function.get_function_name() == "items_lanes"
    assert_host_accepts(function)
    assert db.triggers["items"].max_concurrency == 4
    request = timer()
    assert function.get_user_function()(timer=request) is None
    assert len(timers) == 4
    assert all(t is request for t in timers)
    with sqlite_db.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, lane FROM seen ORDER BY id")).all()
    assert [r[0] for r in rows] == list(range(1, 41))
    assert len({r[1] for r in rows}) == 4  # four lanes, four threads
    assert checkpoint_id(store) == 40


# --- the next batch is read while the lanes run ---------------------------------------


class CountingSource(SqlAlchemySource):
    """The items source, counting its reads; from read ``fail_from`` on, they fail.
    One read a batch (no bulk reads: dbtrigger.runtime.bulk), as the cases count."""

    bulk_reads = False  # type: ignore[assignment]

    def __init__(self, db: TestDatabase, fail_from: int | None = None) -> None:
        super().__init__(
            url=db.url,
            table="items",
            schema=db.schema,
            cursor_column="version",
            pk_columns=["id"],
            visibility="none",
        )
        self.reads = 0
        self.fail_from = fail_from
        self.read_happened = threading.Condition()

    def fetch(self, after: Position, limit: int) -> Rows:
        with self.read_happened:
            self.reads += 1
            self.read_happened.notify_all()
            if self.fail_from is not None and self.reads >= self.fail_from:
                raise FetchError("source went away", poller="items")
        return super().fetch(after, limit)

    def wait_for(self, reads: int) -> bool:
        with self.read_happened:
            return self.read_happened.wait_for(lambda: self.reads >= reads, timeout=20)


def test_the_next_batch_is_read_while_the_lanes_run(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Batch 1's lanes wait (bounded) until the source was read a second time:
    they return in time only because that read happens while they run."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    source = CountingSource(sqlite_db)
    store = CountingStore(FileCheckpointStore(tmp_path / "state"))
    trigger = make_trigger(source, store, batch_size=10, max_batches_per_tick=3, max_concurrency=2)
    overlapped: list[bool] = []
    batches: list[int] = []
    lock = threading.Lock()

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if ctx.batch_index == 0:
            with lock:
                overlapped.append(source.wait_for(2))
        with lock:
            batches.append(ctx.batch_index)

    try:
        assert trigger.tick(handler) == 30
    finally:
        source.close()
    assert overlapped == [True, True]  # both lanes of batch 1 saw the second read
    assert source.reads == 3  # peek, then one read per following batch: none repeated
    assert sorted(set(batches)) == [0, 1, 2]
    assert store.counts == StoreCounts(reads=1, writes=4)
    assert checkpoint_id(store) == 30


def script_run(db: TestDatabase, tmp_path: Path, lanes: int) -> list[list[list[int]]]:
    """Drain with every fourth row retried on its first delivery (due at once):
    the batches, as sorted ids, tick by tick."""
    store = FileCheckpointStore(tmp_path / f"state{lanes}")
    trigger = make_trigger(
        items_source(db),
        store,
        batch_size=5,
        max_batches_per_tick=10,
        max_concurrency=lanes,
        retry_delay_seconds=0,
        retry_delay_max_seconds=0,
    )
    retried: set[int] = set()
    ticks: list[list[list[int]]] = []
    current: dict[int, list[int]] = {}
    lock = threading.Lock()

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            key = int(e.pk["id"])
            with lock:
                current.setdefault(ctx.batch_index, []).append(key)
                first = key % 4 == 0 and key not in retried
                retried.add(key)
            if first:
                ctx.retry(e, "busy")

    while True:
        current.clear()
        rows = trigger.tick(handler)
        ticks.append([sorted(current[i]) for i in sorted(current)])
        if not rows:
            break
    assert checkpoint_id(store) == 23
    assert read_doc(store).window is None
    return ticks


def test_a_retry_drops_the_prefetched_batch(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """A retried event moves the window: the batch read while the lanes ran
    was chosen against the old one, so it is dropped and read again - the
    batches are exactly those of a single lane (retries due at once included)."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 24))
    assert script_run(sqlite_db, tmp_path, 4) == script_run(sqlite_db, tmp_path, 1)


def test_a_failed_batch_drops_the_prefetched_one(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(
        items_source(sqlite_db), store, batch_size=10, max_batches_per_tick=5, max_concurrency=4
    )
    seen: list[int] = []
    lock = threading.Lock()

    def failing(events: list[RowChange]) -> None:
        with lock:
            seen.extend(int(e.pk["id"]) for e in events)
        if any(int(e.pk["id"]) == 7 for e in events):
            raise ValueError("downstream refused 7")

    with pytest.raises(HandlerError):
        trigger.tick(failing)
    assert sorted(seen) == list(range(1, 11))  # the prefetched batch 2 was never handed out
    seen.clear()
    assert trigger.drain(lambda events: seen.extend(int(e.pk["id"]) for e in events)) > 0
    lane = next(p for p in split_ids(range(1, 11), 4) if 7 in p)
    assert sorted(seen) == sorted(lane + list(range(11, 31)))
    assert checkpoint_id(store) == 30


def test_a_lost_lease_drops_the_prefetched_batch(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(
        items_source(sqlite_db),
        store,
        batch_size=10,
        max_batches_per_tick=5,
        max_concurrency=2,
        heartbeat_interval_seconds=0,
    )
    stolen = threading.Event()
    handed: list[int] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        handed.append(ctx.batch_index)
        if not stolen.is_set():
            stolen.set()
            steal_lease(store)

    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert set(handed) == {0}  # nothing of the prefetched batch was handed out
    doc = read_doc(store)
    assert doc.checkpoint is None
    assert doc.lease is not None
    assert doc.lease.owner_id == "thief"


def test_a_failed_prefetch_is_raised_after_the_batch_commits(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    source = CountingSource(sqlite_db, fail_from=2)
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(source, store, batch_size=10, max_batches_per_tick=5, max_concurrency=2)
    try:
        with pytest.raises(FetchError, match="source went away"):
            trigger.tick(lambda events: None)
    finally:
        source.close()
    assert checkpoint_id(store) == 10  # batch 1 committed (and released) first
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.released


def test_a_stopping_worker_drops_the_prefetched_batch(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    source = CountingSource(sqlite_db)
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(source, store, batch_size=10, max_batches_per_tick=5, max_concurrency=2)
    seen: list[int] = []
    lock = threading.Lock()

    def handler(events: list[RowChange]) -> None:
        with lock:
            seen.extend(int(e.pk["id"]) for e in events)

    try:
        result = trigger.tick_result(handler, should_stop=lambda: True)
        assert (result.rows, result.batches, result.more) == (10, 1, True)
        assert source.reads == 2  # the peek, and the read made while the lanes ran
        assert checkpoint_id(store) == 10
        assert trigger.drain(handler) == 20
    finally:
        source.close()
    assert sorted(seen) == list(range(1, 31))  # each row once: nothing lost, nothing twice


def test_subscribers_overlap_the_next_read_too(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """Fan-out runs each subscriber on a thread of its own, so the tick reads
    the next batch while they run, lanes or not."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    source = CountingSource(sqlite_db)
    store = FileCheckpointStore(tmp_path / "state")
    overlapped: list[bool] = []
    got: dict[str, list[int]] = {"billing": [], "search": []}

    def billing(events: list[RowChange], ctx: BatchContext) -> None:
        if ctx.batch_index == 0:
            overlapped.append(source.wait_for(2))
        got["billing"].extend(int(e.pk["id"]) for e in events)

    def search(events: list[RowChange]) -> None:
        got["search"].extend(int(e.pk["id"]) for e in events)

    trigger = make_trigger(
        source,
        store,
        batch_size=10,
        max_batches_per_tick=3,
        subscribers={"billing": billing, "search": search},
    )
    try:
        assert trigger.tick() == 30
    finally:
        source.close()
    assert overlapped == [True]
    assert source.reads == 3
    assert sorted(got["billing"]) == sorted(got["search"]) == list(range(1, 31))
    assert checkpoint_id(store) == 30


def test_a_signal_a_lane_thread_receives_is_handled_while_the_lanes_hang() -> None:
    """The kernel hands a process's signal to any thread; one that lands on a lane's
    thread wakes no wait without a timeout, and Python runs handlers on the main
    thread only. The lanes' caller waited so: SIGTERM went unheard while a handler
    hung (the first of `dbtrigger run`'s two signals, now and then under load)."""
    heard = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: heard.set())
    lanes = Lanes(2, name="signal-test")
    in_time: list[bool] = []

    def part(index: int) -> None:
        if index == 0:
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        in_time.append(heard.wait(10))  # a hung handler, until the signal was handled

    try:
        errors = lanes.each([0, 1], part, None)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        lanes.close()
    assert errors == [None, None]
    assert in_time == [True, True]
