"""Every duplicate window of the runtime contract (W1-W7), provoked and checked.

Each test names its window, makes it happen for real (a killed process, a
store that fails or times out, a competitor that takes the lease over), and
asserts what the contract promises: what is redelivered, where the
checkpoint stands, and which error surfaced. Crashes are real: a subprocess
running a tick is killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import (
    CommitError,
    FileCheckpointStore,
    InMemoryCheckpointStore,
    LostLeaseError,
    RowChange,
)
from dbtrigger.faults import Fault, FaultPlan, FaultyStore
from dbtrigger.runtime.context import BatchContext
from tests.databases import TestDatabase
from tests.reliability_support import (
    Clock,
    Recorder,
    add_items,
    bump,
    checkpoint_id,
    commit_writes,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def five(sqlite_db: TestDatabase) -> TestDatabase:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 6))
    return sqlite_db


# --- W1: handler succeeded, commit failed -----------------------------------------------


def test_w1_commit_failure_redelivers_the_entire_identical_batch(five: TestDatabase) -> None:
    inner = InMemoryCheckpointStore()
    plan = FaultPlan()
    plan.add("write", Fault.UNAVAILABLE, times=None, match=commit_writes(inner))
    store = FaultyStore(inner, plan)
    trigger = make_trigger(items_source(five), store)
    handler = Recorder()
    with pytest.raises(CommitError):
        trigger.tick(handler)
    doc = read_doc(store)
    assert doc.checkpoint is None
    assert doc.failure is None, "a commit failure is not a handler failure"
    assert doc.lease is not None
    assert doc.lease.released, "the lease is released even though the commit failed"
    plan.clear()  # storage is back
    assert trigger.tick(handler) == 5
    assert [ids for _, _, ids in handler.deliveries] == [[1, 2, 3, 4, 5]] * 2
    assert handler.event_ids[0] == handler.event_ids[1], "redelivered events are identical"
    assert checkpoint_id(store) == 5


def test_w1_a_commit_refused_on_every_round_raises_commit_error(five: TestDatabase) -> None:
    inner = InMemoryCheckpointStore()
    plan = FaultPlan()
    plan.add("write", Fault.CONFLICT, times=None, match=commit_writes(inner))
    store = FaultyStore(inner, plan)
    trigger = make_trigger(items_source(five), store)
    handler = Recorder()
    with pytest.raises(CommitError, match="kept changing") as info:
        trigger.tick(handler)
    assert not isinstance(info.value, LostLeaseError)
    plan.clear()
    assert trigger.tick(handler) == 5
    assert handler.ids == [1, 2, 3, 4, 5] * 2


# --- W2, W3, W6: crashes ---------------------------------------------------------------


def _crash_tick(db: TestDatabase, state: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "tests.chaos.crash_tick",
        "--db-url",
        db.url,
        "--state",
        str(state),
        "--log",
        str(log),
        *(["--schema", db.schema] if db.schema else []),
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _take_over(trigger: object, handler: Recorder) -> None:
    """Tick until the dead owner's lease has expired and ours is taken."""
    outcomes: list[str] = []

    def attempt() -> bool:
        outcomes.append(trigger.tick_result(handler).outcome)  # type: ignore[attr-defined]
        return outcomes[-1] != "lease_busy"

    wait_for(attempt, timeout=20)
    assert outcomes[-1] == "committed", outcomes


def test_w2_crash_before_the_handler_returns_redelivers_the_batch(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 6))
    state, log = tmp_path / "state", tmp_path / "handled.log"
    proc = _crash_tick(sqlite_db, state, log, "--ttl", "1")
    try:
        wait_for(lambda: "handler-work-done" in _lines(log), timeout=30)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = FileCheckpointStore(state)
    assert read_doc(store).checkpoint is None
    successor = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=1, owner_id="successor"
    )
    handler = Recorder()
    _take_over(successor, handler)
    assert _lines(log)[:5] == ["1:10", "2:20", "3:30", "4:40", "5:50"]
    assert handler.ids == [1, 2, 3, 4, 5], "the whole batch comes again"
    doc = read_doc(store)
    assert doc.lease is not None
    assert (doc.lease.owner_id, doc.lease.fencing_token) == ("successor", 2)
    assert checkpoint_id(store) == 5


def test_w3_crash_with_partial_side_effects_redoes_every_write(
    pg: TestDatabase, tmp_path: Path
) -> None:
    add_items(pg, items_table(pg), range(1, 6))
    effects = sa.Table(
        "effects",
        sa.MetaData(),
        sa.Column("n", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("item_id", sa.Integer, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("writer", sa.String(40), nullable=False),
        schema=pg.schema,
    )
    effects.create(pg.engine)
    state, log = tmp_path / "state", tmp_path / "handled.log"
    proc = _crash_tick(pg, state, log, "--sink-table", "effects", "--die-after", "2", "--ttl", "1")
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _lines(log) == ["1:10", "2:20"]

    store = FileCheckpointStore(state)
    successor = make_trigger(items_source(pg), store, lease_ttl_seconds=1, owner_id="successor")
    engine = pg.engine

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        with engine.begin() as conn:
            conn.execute(
                effects.insert(),
                [
                    {"item_id": e.pk["id"], "version": e.cursor, "writer": "successor"}
                    for e in events
                ],
            )
        recorder(events, ctx)

    recorder = Recorder()
    _take_over(successor, handler)  # type: ignore[arg-type]
    assert recorder.ids == [1, 2, 3, 4, 5]
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(effects.c.item_id, effects.c.version, effects.c.writer).order_by(effects.c.n)
        ).all()
    assert [(r.item_id, r.writer) for r in rows] == [
        (1, "doomed"),
        (2, "doomed"),
        *[(i, "successor") for i in range(1, 6)],
    ]
    # Keyed on (pk, cursor) the duplicates collapse: the idempotent-handler pattern.
    assert len({(r.item_id, r.version) for r in rows}) == 5


def test_w6_restart_redelivers_only_the_in_flight_batch(sqlite_db: TestDatabase) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 16))
    store = InMemoryCheckpointStore()
    old = make_trigger(
        items_source(sqlite_db), store, batch_size=5, max_batches_per_tick=3, owner_id="old"
    )
    seen: list[list[int]] = []

    def deploy_midway(events: list[RowChange]) -> None:
        seen.append([int(e.pk["id"]) for e in events])
        if len(seen) == 2:
            raise KeyboardInterrupt  # the host stops the worker mid-batch

    with pytest.raises(KeyboardInterrupt):
        old.tick(deploy_midway)
    assert checkpoint_id(store) == 5
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.released
    new = make_trigger(
        items_source(sqlite_db), store, batch_size=5, max_batches_per_tick=3, owner_id="new"
    )
    handler = Recorder()
    assert new.tick(handler) == 10
    assert [ids for _, _, ids in handler.deliveries] == [[6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    assert seen[1] == handler.deliveries[0][2], "only the in-flight batch comes again"


# --- W4: lease lost during processing ---------------------------------------------------


def test_w4_another_instance_takes_over_a_slow_batch(five: TestDatabase) -> None:
    store = InMemoryCheckpointStore()
    slow = make_trigger(
        items_source(five),
        store,
        owner_id="slow",
        lease_ttl_seconds=30,
        heartbeat_interval_seconds=0,
    )
    later = Clock()
    later.advance(3600)  # from where the other instance stands, the lease expired long ago
    other = make_trigger(items_source(five), store, owner_id="other", clock=later)
    other_handler = Recorder()
    seen: list[int] = []

    def handler(events: list[RowChange]) -> None:
        seen.extend(int(e.pk["id"]) for e in events)
        assert other.tick(other_handler) == 5  # the takeover happens while we work

    with pytest.raises(LostLeaseError) as info:
        slow.tick(handler)
    assert info.value.fencing_token == 1
    assert seen == [1, 2, 3, 4, 5]
    assert other_handler.ids == [1, 2, 3, 4, 5], "the entire batch was delivered twice"
    doc = read_doc(store)
    assert doc.lease is not None
    assert (doc.lease.owner_id, doc.lease.fencing_token) == ("other", 2)
    assert checkpoint_id(store) == 5
    assert doc.journal[-1]["fencing_token"] == 2, "the stale commit was not written"


# --- W5: ambiguous commit -----------------------------------------------------------------


@pytest.mark.parametrize("fault", [Fault.AMBIGUOUS_LANDED, Fault.AMBIGUOUS_LOST])
def test_w5_an_ambiguous_commit_is_resolved_in_the_same_tick(
    five: TestDatabase, fault: Fault
) -> None:
    inner = InMemoryCheckpointStore()
    plan = FaultPlan()
    rule = plan.add("write", fault, match=commit_writes(inner))
    store = FaultyStore(inner, plan)
    trigger = make_trigger(items_source(five), store)
    handler = Recorder()
    assert trigger.tick(handler) == 5
    assert rule.fired == 1
    assert checkpoint_id(store) == 5
    assert trigger.tick(handler) == 0
    assert handler.ids == [1, 2, 3, 4, 5], "resolved without a duplicate"


@pytest.mark.parametrize(
    ("fault", "redelivered"), [(Fault.AMBIGUOUS_LANDED, False), (Fault.AMBIGUOUS_LOST, True)]
)
def test_w5_an_unresolvable_commit_is_settled_by_the_next_tick(
    five: TestDatabase, fault: Fault, redelivered: bool
) -> None:
    """The store times out the commit and then stays away: CommitError now, and the
    next tick reads whatever really happened - a duplicate at worst, never a loss."""
    inner = InMemoryCheckpointStore()
    plan = FaultPlan()
    plan.add("write", fault, match=commit_writes(inner))
    plan.add("read", Fault.UNAVAILABLE, skip=1, times=None)  # all reads after the tick's first
    store = FaultyStore(inner, plan)
    clock = Clock()
    trigger = make_trigger(items_source(five), store, clock=clock, lease_ttl_seconds=30)
    handler = Recorder()
    with pytest.raises(CommitError):
        trigger.tick(handler)
    plan.clear()
    clock.advance(31)  # a release could not be written either: wait out our own lease
    handler_again = Recorder()
    assert trigger.tick(handler_again) == (5 if redelivered else 0)
    assert handler_again.ids == ([1, 2, 3, 4, 5] if redelivered else [])
    assert checkpoint_id(store) == 5


# --- W7: cursor precision collapse ---------------------------------------------------------


def test_w7_several_updates_between_ticks_arrive_as_the_latest_state(
    sqlite_db: TestDatabase,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store)
    assert trigger.tick(Recorder()) == 3
    bump(sqlite_db, table, 2, 100)
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.update().where(table.c.id == 2).values(version=101, payload="last"))
    events: list[RowChange] = []
    assert trigger.tick(events.extend) == 1
    (only,) = events
    assert (only.pk["id"], only.cursor) == (2, 101)
    assert only.after is not None
    assert only.after["payload"] == "last", "the intermediate state (version 100) is gone"


# --- windows that must not produce duplicates ---------------------------------------------


def test_no_duplicate_after_a_commit_and_a_clean_restart(sqlite_db: TestDatabase) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    store = InMemoryCheckpointStore()
    first = make_trigger(items_source(sqlite_db), store, owner_id="first")
    assert first.tick(Recorder()) == 5
    add_items(sqlite_db, table, [6, 7])
    second = make_trigger(items_source(sqlite_db), store, owner_id="second")
    handler = Recorder()
    assert second.tick(handler) == 2
    assert handler.ids == [6, 7]


def test_no_duplicate_from_two_ticks_racing_on_one_instance(five: TestDatabase) -> None:
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(five), store)
    inner = Recorder()
    overlapping: list[int] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        overlapping.append(trigger.tick(inner))  # the timer fires again meanwhile
        inner(events, ctx)

    assert trigger.tick(handler) == 5
    assert overlapping == [0]
    assert inner.ids == [1, 2, 3, 4, 5]
