"""Parallel lanes (``max_concurrency``): concurrent calls, one key per lane,
a failing lane, and the storage cost (SQLite and PostgreSQL, file store)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import azure.functions as func
import pytest
import sqlalchemy as sa

from dbtrigger import (
    ConfigurationError,
    DbBindings,
    DbOut,
    FileCheckpointStore,
    HandlerError,
    RowChange,
)
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.lanes import lane_of, split
from dbtrigger.testing import CountingStore, StoreCounts
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    bump,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
)
from tests.test_azure_functions import assert_host_accepts, timer


def test_lanes_are_a_stable_split_by_key_in_batch_order() -> None:
    events = [
        RowChange(
            event_id=f"e{i}",
            op="upsert",
            source="s",
            cursor=i,
            pk={"id": i % 7},
            before=None,
            after=None,
        )
        for i in range(40)
    ]
    parts = split(events, 4)
    assert sorted(e.event_id for part in parts for e in part) == sorted(e.event_id for e in events)
    for part in parts:
        assert [e.cursor for e in part] == sorted(e.cursor for e in part)
        assert len({lane_of(e, 4) for e in part}) == 1
    # One key, one lane: all events of a key are in the same part.
    lanes_of_key: dict[int, set[int]] = {}
    for index, part in enumerate(parts):
        for e in part:
            lanes_of_key.setdefault(int(e.pk["id"]), set()).add(index)
    assert all(len(v) == 1 for v in lanes_of_key.values())
    assert split(events, 1) == [events]


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
    events = [
        RowChange(
            event_id=f"e{i}",
            op="upsert",
            source="s",
            cursor=i,
            pk={"id": i},
            before=None,
            after=None,
        )
        for i in ids
    ]
    return [[int(e.pk["id"]) for e in part] for part in split(events, lanes)]


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
