"""Failure scenarios 5.1-5.10 of the runtime contract, and the core tick promises.

For every scenario: the error that surfaces (or the quiet 0), whether the
handler ran, where the checkpoint stands, whether a lease is left behind, and
what the next tick delivers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import (
    CommitError,
    FetchError,
    HandlerError,
    InMemoryCheckpointStore,
    LostLeaseError,
    RowChange,
    SerializationError,
    SqlAlchemySource,
)
from dbtrigger.errors import (
    CorruptStateError,
    FingerprintMismatchError,
    OperatorError,
    SourceDefinitionError,
    StoreAuthError,
)
from dbtrigger.faults import Fault, FaultPlan, FaultySource, FaultyStore
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.reliability_support import (
    Clock,
    Recorder,
    add_items,
    checkpoint_id,
    commit_writes,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    steal_lease,
)


@pytest.fixture
def five(sqlite_db: TestDatabase) -> TestDatabase:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 6))
    return sqlite_db


def _lease_left_behind(store: InMemoryCheckpointStore | FaultyStore) -> bool:
    doc = read_doc(store)
    return doc.lease is not None and not doc.lease.released


# --- 5.1 lease cannot be acquired ---------------------------------------------------------


def test_5_1_a_live_lease_elsewhere_makes_the_tick_a_quiet_zero(
    five: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    inner = InMemoryCheckpointStore()
    holder = make_trigger(items_source(five), inner, owner_id="holder")
    watcher = FaultyStore(inner)
    other = make_trigger(items_source(five), watcher, owner_id="other")
    other_handler = Recorder()
    observed: list[object] = []

    def handler(events: list[RowChange]) -> None:
        before = inner.read("items")
        with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
            observed.append(other.tick_result(other_handler))
        assert inner.read("items") == before, "the refused tick changed the state"

    assert holder.tick(handler) == 5
    (result,) = observed
    assert (result.rows, result.outcome) == (0, "lease_busy")  # type: ignore[attr-defined]
    assert other_handler.calls == 0
    assert (watcher.plan.count("read"), watcher.plan.count("write")) == (1, 0)
    busy = [r for r in caplog.records if getattr(r, "event", None) == "lease_busy"]
    assert busy
    assert all(r.levelno == logging.DEBUG for r in busy)


def test_5_1_losing_the_acquisition_race_is_also_a_quiet_zero(five: TestDatabase) -> None:
    inner = InMemoryCheckpointStore()
    winner = make_trigger(items_source(five), inner, owner_id="winner")
    winner_handler = Recorder()
    plan = FaultPlan()
    # Between the loser's read and its acquisition write, the winner runs a whole tick.
    plan.add("write", Fault.NONE, before=lambda call: winner.tick(winner_handler))
    loser = make_trigger(items_source(five), FaultyStore(inner, plan), owner_id="loser")
    loser_handler = Recorder()
    result = loser.tick_result(loser_handler)
    assert (result.rows, result.outcome) == (0, "lost_race")
    assert loser_handler.calls == 0
    assert winner_handler.ids == [1, 2, 3, 4, 5]
    assert checkpoint_id(inner) == 5


# --- 5.2 state load fails -----------------------------------------------------------------


def test_5_2_state_unreachable_raises_fetch_error_and_changes_nothing(five: TestDatabase) -> None:
    plan = FaultPlan()
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(five), store)
    assert trigger.tick(Recorder()) == 5
    add_items(five, sa.Table("items", sa.MetaData(), autoload_with=five.engine), [6])
    plan.add("read", Fault.UNAVAILABLE, times=None)
    handler = Recorder()
    with pytest.raises(FetchError):
        trigger.tick(handler)
    assert handler.calls == 0
    plan.clear()
    assert checkpoint_id(store) == 5
    assert not _lease_left_behind(store)
    assert trigger.tick(handler) == 1
    assert handler.ids == [6]


@pytest.mark.parametrize("problem", ["corrupt", "fingerprint", "auth"])
def test_5_2_operator_errors_raise_and_are_never_reported_as_zero_rows(
    five: TestDatabase, problem: str
) -> None:
    inner = InMemoryCheckpointStore()
    plan = FaultPlan()
    store = FaultyStore(inner, plan)
    trigger = make_trigger(items_source(five), store)
    assert trigger.tick(Recorder()) == 5
    stored = inner.read("items")
    assert stored is not None
    expected: type[OperatorError]
    if problem == "corrupt":
        inner.write("items", b'{"version": 1, "poller_name": 7}', if_match=stored.etag)
        expected = CorruptStateError
    elif problem == "fingerprint":
        doc = docmod.loads(stored.data)
        changed = docmod.StateDocument(
            poller_name=doc.poller_name,
            source_fingerprint="sha256:someone-else",
            checkpoint=doc.checkpoint,
            lease=doc.lease,
        )
        inner.write("items", docmod.dumps(changed), if_match=stored.etag)
        expected = FingerprintMismatchError
    else:
        plan.add("read", Fault.AUTH, times=None)
        expected = StoreAuthError
    handler = Recorder()
    with pytest.raises(expected):
        trigger.tick(handler)
    assert handler.calls == 0


# --- 5.3 source fetch fails ---------------------------------------------------------------


def test_5_3_a_missing_table_is_an_operator_error_before_any_handler_or_lease(
    pg: TestDatabase,
) -> None:
    """A table that is gone fails the same way every tick: not retried, but stopped and named.

    Connection-level failures stay retryable ``FetchError`` (the FaultySource
    tests below); a definition error says what to fix. Either way nothing is
    delivered, no lease is taken and the checkpoint stays where it was.
    """
    table = items_table(pg)
    add_items(pg, table, range(1, 6))
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(items_source(pg), store)
    assert trigger.tick(Recorder()) == 5
    add_items(pg, table, [6, 7])
    pg.execute(f'ALTER TABLE "{pg.schema}".items RENAME TO items_away')
    store.plan.reset_counts()
    handler = Recorder()
    with pytest.raises(SourceDefinitionError, match=r"fetch from .*retrying cannot help"):
        trigger.tick(handler)
    assert handler.calls == 0
    assert store.plan.count("write") == 0, "no lease taken for a failed fetch"
    assert checkpoint_id(store) == 5
    assert not _lease_left_behind(store)
    pg.execute(f'ALTER TABLE "{pg.schema}".items_away RENAME TO items')
    assert trigger.tick(handler) == 2
    assert handler.ids == [6, 7]


def test_5_3_a_fetch_failing_while_the_lease_is_held_releases_it(five: TestDatabase) -> None:
    plan = FaultPlan()
    plan.add("fetch", Fault.QUERY_ERROR, skip=1, times=None)  # the prefetch of batch 2
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        FaultySource(items_source(five), plan), store, batch_size=3, max_batches_per_tick=2
    )
    handler = Recorder()
    with pytest.raises(FetchError):
        trigger.tick(handler)
    assert handler.ids == [1, 2, 3]
    assert checkpoint_id(store) == 3, "the batch that was handled is committed"
    assert not _lease_left_behind(store)
    plan.clear()
    assert trigger.tick(handler) == 2
    assert handler.ids == [1, 2, 3, 4, 5]


# --- 5.4 normalization fails --------------------------------------------------------------


def test_5_4_an_unserializable_cursor_stops_the_poller_without_moving(
    pg: TestDatabase,
) -> None:
    pg.execute(f'CREATE TABLE "{pg.schema}".spans (id int PRIMARY KEY, version interval NOT NULL)')
    pg.execute(
        f"INSERT INTO \"{pg.schema}\".spans VALUES (1, interval '1 hour'), (2, interval '2 hours')"
    )
    source = SqlAlchemySource(
        url=pg.url,
        table="spans",
        schema=pg.schema,
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",
    )
    store = InMemoryCheckpointStore()
    trigger = make_trigger(source, store)
    handler = Recorder()
    for _ in range(2):  # a poison configuration: the same failure every tick
        with pytest.raises(SerializationError, match="timedelta"):
            trigger.tick(handler)
        assert handler.calls == 0
        doc = read_doc(store)
        assert doc.checkpoint is None
        assert doc.failure is None
        assert not _lease_left_behind(store)
    source.close()


def test_5_4_a_query_without_the_key_column_is_a_serialization_error(five: TestDatabase) -> None:
    source = SqlAlchemySource(
        url=five.url,
        query="SELECT version, payload FROM items",
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",
    )
    store = FaultyStore(InMemoryCheckpointStore())
    handler = Recorder()
    with pytest.raises(SerializationError, match="id"):
        make_trigger(source, store).tick(handler)
    assert handler.calls == 0
    assert store.plan.count("write") == 0


# --- 5.5 handler raises -------------------------------------------------------------------


def test_5_5_a_handler_error_leaves_the_checkpoint_and_redelivers_the_batch(
    five: TestDatabase,
) -> None:
    store = InMemoryCheckpointStore()
    metrics = InMemoryMetrics()
    trigger = make_trigger(items_source(five), store, metrics=metrics)
    handler = Recorder(fail_on={4})
    with pytest.raises(HandlerError) as info:
        trigger.tick(handler)
    assert isinstance(info.value.__cause__, ValueError)
    doc = read_doc(store)
    assert doc.checkpoint is None
    assert not _lease_left_behind(store)
    assert doc.failure is not None
    assert doc.failure.attempts == 1
    assert doc.failure.last_error == "ValueError: cannot process item(s) [4]"
    handler.fail_on.clear()
    assert trigger.tick(handler) == 5  # immediately: our own released lease does not block
    assert handler.event_ids[0] == handler.event_ids[1]
    assert read_doc(store).failure is None
    assert metrics.total("failures_total", error_type="HandlerError") == 1
    assert metrics.total("redelivered_batches_total") == 1


# --- 5.6 / 5.7 commit fails -----------------------------------------------------------------


def test_5_6_commit_rejected_because_the_lease_was_taken(five: TestDatabase) -> None:
    inner = InMemoryCheckpointStore()
    later = Clock()
    later.advance(3600)
    rival = make_trigger(items_source(five), inner, owner_id="rival", clock=later)
    rival_handler = Recorder()
    plan = FaultPlan()
    # Right before our commit lands, the rival takes the lease (it sees ours expired).
    plan.add(
        "write",
        Fault.NONE,
        match=commit_writes(inner),
        before=lambda call: steal_lease(inner, owner="rival", after=later.now - Clock().now),
    )
    trigger = make_trigger(items_source(five), FaultyStore(inner, plan), owner_id="me")
    handler = Recorder()
    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert checkpoint_id(inner) is None, "handler results discarded"
    lease_now = read_doc(inner).lease
    assert lease_now is not None
    assert lease_now.owner_id == "rival"
    # The rival's lease expires; the next owner fetches the same batch again.
    later.advance(3600)
    assert rival.tick(rival_handler) == 5
    assert rival_handler.ids == handler.ids == [1, 2, 3, 4, 5]


def test_5_7_commit_fails_for_another_reason(five: TestDatabase) -> None:
    inner = InMemoryCheckpointStore()
    plan = FaultPlan()
    plan.add("write", Fault.UNAVAILABLE, times=None, match=commit_writes(inner))
    metrics = InMemoryMetrics()
    trigger = make_trigger(items_source(five), FaultyStore(inner, plan), metrics=metrics)
    handler = Recorder()
    with pytest.raises(CommitError) as info:
        trigger.tick(handler)
    assert not isinstance(info.value, LostLeaseError)
    assert metrics.total("failures_total", error_type="CommitError") == 1
    plan.clear()
    assert trigger.tick(handler) == 5
    assert handler.ids == [1, 2, 3, 4, 5] * 2


# --- 5.8 lease lost mid-handler -------------------------------------------------------------


def test_5_8_lease_lost_mid_handler_stops_before_the_commit(five: TestDatabase) -> None:
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(five), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.1
    )
    flags: list[bool] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        steal_lease(store)
        ctx.lease_lost.wait(10)
        flags.append(ctx.cancelled)

    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert flags == [True]
    assert checkpoint_id(store) is None


# --- 5.9 poison batch ---------------------------------------------------------------------


def test_5_9_a_poison_row_is_set_aside_and_the_poller_moves_on(
    five: TestDatabase, tmp_path: Path
) -> None:
    sink = JsonLinesQuarantineSink(tmp_path / "poison.jsonl")
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(five), store, quarantine=sink, max_attempts=2)
    handler = Recorder(fail_on={3})
    with pytest.raises(HandlerError):
        trigger.tick(handler)
    assert checkpoint_id(store) is None
    assert trigger.tick(handler) == 5
    assert checkpoint_id(store) == 5
    assert [r.pk for r in sink.records()] == [{"id": 3}]


# --- 5.10 storage unavailable -------------------------------------------------------------


def test_5_10_storage_outage_blocks_ticks_and_polling_resumes_from_the_checkpoint(
    five: TestDatabase,
) -> None:
    plan = FaultPlan()
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(five), store)
    assert trigger.tick(Recorder()) == 5
    outage = plan.add("*", Fault.UNAVAILABLE, times=None)
    add_items(five, sa.Table("items", sa.MetaData(), autoload_with=five.engine), [6, 7])
    handler = Recorder()
    for _ in range(3):
        with pytest.raises(FetchError):
            trigger.tick(handler)
    assert handler.calls == 0
    assert outage.fired == 9  # three tries per tick, all refused
    plan.clear()
    assert trigger.tick(handler) == 2
    assert handler.ids == [6, 7]


def test_5_10_expired_credentials_are_an_operator_error(five: TestDatabase) -> None:
    plan = FaultPlan()
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(five), store)
    plan.add("*", Fault.AUTH, times=None)
    with pytest.raises(StoreAuthError) as info:
        trigger.tick(Recorder())
    assert isinstance(info.value, OperatorError)


# --- the tick's own promises ----------------------------------------------------------------


def test_back_to_back_ticks_on_one_instance_are_not_refused(five: TestDatabase) -> None:
    table = sa.Table("items", sa.MetaData(), autoload_with=five.engine)
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(five), store, batch_size=2)
    outcomes = []
    for new_id in (6, 7, 8):
        outcomes.append(trigger.tick_result(Recorder()).outcome)
        add_items(five, table, [new_id])
    assert outcomes == ["committed"] * 3
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.fencing_token == 3


def test_a_drain_empties_a_backlog_at_the_promised_storage_cost(pg: TestDatabase) -> None:
    table = items_table(pg)
    add_items(pg, table, range(1, 96))
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(items_source(pg), store, batch_size=10, max_batches_per_tick=3)
    handler = Recorder()
    costs: list[tuple[int, int, int]] = []
    while True:
        store.plan.reset_counts()
        result = trigger.tick_result(handler)
        costs.append((result.batches, store.plan.count("read"), store.plan.count("write")))
        if result.rows == 0:
            break
    assert sorted(handler.ids) == list(range(1, 96))
    assert len(handler.ids) == 95, "a row was delivered twice"
    # Each tick with k batches: 1 read + k + 1 writes; the idle tick: 1 read, no write.
    assert costs == [(3, 1, 4), (3, 1, 4), (3, 1, 4), (1, 1, 2), (0, 1, 0)]
    assert checkpoint_id(store) == 95
