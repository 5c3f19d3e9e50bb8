"""Retries inside a tick: transient store/source failures only, bounded and jittered."""

from __future__ import annotations

import pytest

from dbtrigger import (
    FetchError,
    HandlerError,
    InMemoryCheckpointStore,
    LeaseAcquireError,
    LostLeaseError,
    RowChange,
)
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    ConfigurationError,
    CorruptStateError,
    QuarantineError,
    StoreAuthError,
    StoreUnavailableError,
)
from dbtrigger.faults import Fault, FaultPlan, FaultySource, FaultyStore
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.retry import RetryPolicy, is_transient
from tests.databases import TestDatabase
from tests.reliability_support import (
    Recorder,
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    steal_lease,
)

# --- the policy on its own ------------------------------------------------------------


def flaky(failures: list[BaseException]) -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    return calls, fn


def test_transient_errors_are_retried_with_bounded_jittered_waits() -> None:
    waits: list[float] = []
    policy = RetryPolicy(
        attempts=5,
        initial_backoff_seconds=0.1,
        max_backoff_seconds=0.25,
        multiplier=2,
        sleep=waits.append,
    )
    calls, fn = flaky([FetchError("1"), StoreUnavailableError("2"), FetchError("3")])
    assert policy.call(fn, operation="x") == "ok"  # type: ignore[arg-type]
    assert len(calls) == 4
    assert len(waits) == 3
    for n, wait in enumerate(waits, start=1):
        assert 0 <= wait <= min(0.25, 0.1 * 2 ** (n - 1))


def test_the_last_error_is_raised_when_attempts_run_out() -> None:
    hooks: list[tuple[str, int]] = []
    policy = RetryPolicy(attempts=3, sleep=lambda _: None)
    calls, fn = flaky([FetchError(str(i)) for i in range(5)])
    with pytest.raises(FetchError, match="2"):
        policy.call(fn, operation="fetch", on_retry=lambda op, n, e, w: hooks.append((op, n)))  # type: ignore[arg-type]
    assert len(calls) == 3
    assert hooks == [("fetch", 1), ("fetch", 2)]


@pytest.mark.parametrize(
    "error",
    [
        StoreAuthError("operator"),
        CorruptStateError("operator"),
        ConfigurationError("operator"),
        CasConflictError("contention"),
        LeaseAcquireError("contention"),
        LostLeaseError("contention"),
        HandlerError("handler"),
        AmbiguousWriteError("must be resolved by reading back"),
        ValueError("not ours"),
    ],
)
def test_operator_errors_contention_handlers_and_ambiguity_are_never_retried(
    error: Exception,
) -> None:
    assert not is_transient(error)
    policy = RetryPolicy(attempts=5, sleep=lambda _: None)
    calls, fn = flaky([error])
    with pytest.raises(type(error)):
        policy.call(fn, operation="x", kinds=(Exception,))  # type: ignore[arg-type]
    assert len(calls) == 1


def test_only_the_kinds_asked_for_are_retried() -> None:
    policy = RetryPolicy(attempts=5, sleep=lambda _: None)
    calls, fn = flaky([QuarantineError("sink down")])
    with pytest.raises(QuarantineError):
        policy.call(fn, operation="x", kinds=(StoreUnavailableError,))  # type: ignore[arg-type]
    assert len(calls) == 1


def test_elapsed_time_bounds_the_retries() -> None:
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    policy = RetryPolicy(
        attempts=100,
        initial_backoff_seconds=1,
        max_backoff_seconds=1,
        max_elapsed_seconds=2.5,
        sleep=sleep,
        clock=lambda: clock[0],  # moved by the waits alone: no real time involved
    )
    calls, fn = flaky([FetchError(str(i)) for i in range(100)])
    with pytest.raises(FetchError):
        policy.call(fn, operation="x")  # type: ignore[arg-type]
    assert len(calls) < 100
    assert clock[0] >= 2.5  # jittered waits of up to 1 s each, stopped once 2.5 s were spent


def test_none_policy_and_validation() -> None:
    calls, fn = flaky([FetchError("x")])
    with pytest.raises(FetchError):
        RetryPolicy.none().call(fn, operation="x")  # type: ignore[arg-type]
    assert len(calls) == 1
    for bad in (
        {"attempts": 0},
        {"multiplier": 0.5},
        {"max_elapsed_seconds": 0},
        {"initial_backoff_seconds": -1},
    ):
        with pytest.raises(ConfigurationError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


# --- inside a tick --------------------------------------------------------------------


@pytest.fixture
def items(sqlite_db: TestDatabase) -> TestDatabase:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    return sqlite_db


def test_transient_fetch_errors_are_retried_within_the_tick(items: TestDatabase) -> None:
    plan = FaultPlan()
    plan.add("fetch", Fault.QUERY_ERROR, times=2)
    metrics = InMemoryMetrics()
    trigger = make_trigger(
        FaultySource(items_source(items), plan), InMemoryCheckpointStore(), metrics=metrics
    )
    handler = Recorder()
    assert trigger.tick(handler) == 5
    assert handler.calls == 1
    assert plan.count("fetch") == 3
    assert metrics.total("retries_total", operation="fetch") == 2


def test_a_dropped_postgresql_connection_is_retried_on_a_fresh_one(pg: TestDatabase) -> None:
    table = items_table(pg)
    add_items(pg, table, range(1, 6))
    plan = FaultPlan()
    source = FaultySource(items_source(pg), plan)
    trigger = make_trigger(source, InMemoryCheckpointStore())
    add_items(pg, table, [6])
    assert trigger.tick(Recorder()) == 6  # warms the pool
    add_items(pg, table, [7])
    plan.add("fetch", Fault.CONNECTION_DROP)  # disposes the pool, then fails
    handler = Recorder()
    assert trigger.tick(handler) == 1
    assert handler.ids == [7]
    source.close()


def test_persistent_fetch_failure_raises_without_handler_or_lease(items: TestDatabase) -> None:
    plan = FaultPlan()
    plan.add("fetch", Fault.QUERY_ERROR, times=None)
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(FaultySource(items_source(items), plan), store)
    handler = Recorder()
    with pytest.raises(FetchError):
        trigger.tick(handler)
    assert handler.calls == 0
    assert plan.count("fetch") == 3  # NO_WAIT allows three tries
    assert store.plan.count("write") == 0, "no lease was taken for a failed fetch"


@pytest.mark.parametrize("op", ["read", "write"])
def test_state_store_unavailability_is_retried(items: TestDatabase, op: str) -> None:
    plan = FaultPlan()
    # The first read, or the commit (second write), fails twice.
    plan.add(op, Fault.UNAVAILABLE, times=2, skip=0 if op == "read" else 1)
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(items), store)
    assert trigger.tick(Recorder()) == 5
    assert checkpoint_id(store) == 5
    assert plan.count(op, Fault.UNAVAILABLE) == 2


def test_store_auth_failure_is_raised_at_once_not_retried(items: TestDatabase) -> None:
    plan = FaultPlan()
    plan.add("read", Fault.AUTH, times=None)
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(items), store)
    with pytest.raises(StoreAuthError):
        trigger.tick(Recorder())
    assert plan.count("read") == 1


def test_store_auth_failure_on_commit_surfaces_as_operator_error(items: TestDatabase) -> None:
    plan = FaultPlan()
    plan.add("write", Fault.AUTH, skip=1, times=None)
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(items), store)
    with pytest.raises(StoreAuthError):
        trigger.tick(Recorder())
    assert plan.count("write", Fault.AUTH) >= 1
    assert plan.count("write", Fault.AUTH) == plan.count("write") - 1


def test_handler_errors_are_not_retried_inside_the_tick(items: TestDatabase) -> None:
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(items), store)
    handler = Recorder(fail_on={3})
    for attempt in (1, 2):
        with pytest.raises(HandlerError):
            trigger.tick(handler)
        assert handler.calls == attempt
    doc = read_doc(store)
    assert doc.failure is not None
    assert doc.failure.attempts == 2


def test_a_lost_lease_at_commit_is_not_retried(items: TestDatabase) -> None:
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(items_source(items), store)

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        steal_lease(store.inner)

    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    # acquisition + one commit attempt (refused on re-read: the lease is someone else's)
    assert store.plan.count("write") == 2
    assert checkpoint_id(store) is None


@pytest.mark.parametrize("fault", [Fault.AMBIGUOUS_LANDED, Fault.AMBIGUOUS_LOST])
def test_an_ambiguous_lease_acquisition_is_resolved_by_reading_back(
    items: TestDatabase, fault: Fault
) -> None:
    plan = FaultPlan()
    plan.add("write", fault)
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    trigger = make_trigger(items_source(items), store)
    handler = Recorder()
    assert trigger.tick(handler) == 5
    assert handler.calls == 1
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.fencing_token == 1
    assert doc.lease.released
