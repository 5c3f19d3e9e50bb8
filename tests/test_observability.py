"""Structured logs and metrics of the tick: the event sequence of a normal tick and
of each failure class, a metrics collector that raises, and the Prometheus and
OpenTelemetry adapters exercised for real (a CollectorRegistry scraped with
``generate_latest``; an SDK MeterProvider read with InMemoryMetricReader).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from dbtrigger import (
    CommitError,
    FetchError,
    FileCheckpointStore,
    HandlerError,
    LostLeaseError,
    PollTrigger,
    RowChange,
    SerializationError,
    SqlAlchemySource,
)
from dbtrigger.errors import CorruptStateError
from dbtrigger.faults import Fault, FaultPlan, FaultySource, FaultyStore
from dbtrigger.metrics import METRICS, InMemoryMetrics, report_lag
from dbtrigger.metrics_otel import OpenTelemetryMetrics
from dbtrigger.metrics_prometheus import PrometheusMetrics
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state import operations as ops
from dbtrigger.state.stores.base import CheckpointStore
from tests.databases import TestDatabase


def events_table(db: TestDatabase, rows: int, *, nullable_id: bool = False) -> None:
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("rid", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("id", sa.Integer, nullable=nullable_id, unique=True),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [
                {"rid": i, "id": None if nullable_id and i == 3 else i, "seq": 10 * i}
                for i in range(1, rows + 1)
            ],
        )


@dataclass
class Rig:
    db: TestDatabase
    store: CheckpointStore
    source: Any
    metrics: InMemoryMetrics
    trigger: PollTrigger

    def events(self, caplog: pytest.LogCaptureFixture) -> list[str]:
        return [
            r.event  # type: ignore[attr-defined]
            for r in caplog.records
            if getattr(r, "poller", None) == self.trigger.name and hasattr(r, "event")
        ]


def make_rig(
    db: TestDatabase,
    tmp_path: Path,
    *,
    rows: int = 5,
    store_plan: FaultPlan | None = None,
    source_plan: FaultPlan | None = None,
    query: str | None = None,
    metrics: Any = None,
    **kwargs: Any,
) -> Rig:
    if query is None:
        events_table(db, rows)
    base_store: CheckpointStore = FileCheckpointStore(tmp_path / "state")
    store = FaultyStore(base_store, store_plan) if store_plan else base_store
    source: Any = SqlAlchemySource(
        url=db.url,
        **({"query": query} if query else {"table": "events"}),
        cursor_column="seq",
        pk_columns=["id"],
    )
    if source_plan is not None:
        source = FaultySource(source, source_plan)
    collector = InMemoryMetrics()
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        batch_size=10,
        retry=RetryPolicy.none(),
        metrics=metrics or collector,
        **kwargs,
    )
    return Rig(db, store, source, collector, trigger)


@pytest.fixture
def caplog_debug(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        yield caplog


def ok_handler(events: list[RowChange]) -> None:
    del events


# --- normal ticks ---------------------------------------------------------------------------


def test_event_sequence_of_a_normal_tick(
    sqlite_db: TestDatabase, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(sqlite_db, tmp_path, rows=5)
    assert rig.trigger.tick(ok_handler) == 5
    assert rig.events(caplog_debug) == [
        "tick_start",
        "lease_acquired",
        "batch_start",
        "batch_committed",
    ]
    [committed] = [r for r in caplog_debug.records if getattr(r, "event", "") == "batch_committed"]
    assert committed.rows == 5  # type: ignore[attr-defined]
    assert committed.released is True  # type: ignore[attr-defined]
    assert committed.cursor["value"] == 50  # type: ignore[attr-defined]
    assert committed.fencing_token == 1  # type: ignore[attr-defined]
    assert committed.batch_id.startswith("batch_")  # type: ignore[attr-defined]

    caplog_debug.clear()
    assert rig.trigger.tick(ok_handler) == 0
    assert rig.events(caplog_debug) == ["tick_start", "tick_idle"]
    assert rig.metrics.gauge("lag_rows") == 0
    assert rig.metrics.total("batches_total", result="committed") == 1
    assert rig.metrics.total("events_total") == 5
    assert rig.metrics.total("ticks_total", result="idle") == 1
    assert rig.metrics.gauge("last_success_timestamp") is not None


def test_event_sequence_of_a_two_batch_tick(
    sqlite_db: TestDatabase, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(sqlite_db, tmp_path, rows=15, max_batches_per_tick=3)
    assert rig.trigger.tick(ok_handler) == 15
    assert rig.events(caplog_debug) == [
        "tick_start",
        "lease_acquired",
        "batch_start",
        "batch_committed",
        "batch_start",
        "batch_committed",
    ]
    released = [
        r.released  # type: ignore[attr-defined]
        for r in caplog_debug.records
        if getattr(r, "event", "") == "batch_committed"
    ]
    assert released == [False, True]
    assert rig.metrics.observations[("batch_size", (("poller", "orders"),))] == [10, 5]


def test_event_sequence_when_the_lease_is_busy(
    sqlite_db: TestDatabase, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(sqlite_db, tmp_path)
    now = dt.datetime.now(dt.timezone.utc)
    decision = leasemod.decide_acquire(
        None,
        poller="orders",
        fingerprint=rig.source.fingerprint(),
        owner="other/1/x",
        now=now,
        ttl=dt.timedelta(minutes=5),
    )
    assert isinstance(decision, leasemod.Acquired)
    rig.store.write("orders", docmod.dumps(decision.document), if_match=None)
    assert rig.trigger.tick(ok_handler) == 0
    assert rig.events(caplog_debug) == ["tick_start", "lease_busy"]
    busy = caplog_debug.records[-1]
    assert busy.holder == "other/1/x"  # type: ignore[attr-defined]
    assert rig.metrics.total("lease_acquire_skipped_total") == 1


# --- one test per failure class ---------------------------------------------------------------


@dataclass(frozen=True)
class FailureCase:
    name: str
    error: type[BaseException]
    event: str
    expected: list[str]
    setup: Callable[[TestDatabase, Path], tuple[Rig, Callable[..., Any]]]
    error_type: str | None


def _store_read_unavailable(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    plan = FaultPlan()
    plan.add("read", Fault.UNAVAILABLE)
    return make_rig(db, tmp, store_plan=plan), ok_handler


def _corrupt_state(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    rig = make_rig(db, tmp)
    rig.store.write("orders", b'{"version": 1, "poller_name": 7}', if_match=None)
    return rig, ok_handler


def _lease_write_unavailable(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    plan = FaultPlan()
    plan.add("write", Fault.UNAVAILABLE)
    return make_rig(db, tmp, store_plan=plan), ok_handler


def _lost_race(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    plan = FaultPlan()
    plan.add("write", Fault.CONFLICT)
    return make_rig(db, tmp, store_plan=plan), ok_handler


def _fetch_fails(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    plan = FaultPlan()
    plan.add("fetch", Fault.QUERY_ERROR)
    return make_rig(db, tmp, source_plan=plan), ok_handler


def _null_key(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    events_table(db, 5, nullable_id=True)
    return make_rig(db, tmp, query="SELECT id, seq FROM events"), ok_handler


def _handler_raises(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    def handler(events: list[RowChange]) -> None:
        raise RuntimeError("sink said no")

    return make_rig(db, tmp), handler


def _operator_fences_the_owner(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    rig = make_rig(db, tmp)

    def handler(events: list[RowChange]) -> None:
        stored = rig.store.read("orders")
        assert stored is not None
        now = dt.datetime.now(dt.timezone.utc)
        fenced = ops.reset(
            docmod.loads(stored.data),
            position=None,
            now=now,
            actor="ops@host",
            reason="test",
            force=True,
        )
        rig.store.write("orders", docmod.dumps(fenced), if_match=stored.etag)

    return rig, handler


def _commit_unavailable(db: TestDatabase, tmp: Path) -> tuple[Rig, Callable[..., Any]]:
    plan = FaultPlan()
    plan.add("write", Fault.UNAVAILABLE, skip=1, times=None)  # the lease write passes
    return make_rig(db, tmp, store_plan=plan), ok_handler


FAILURES = [
    FailureCase(
        "state read", FetchError, "state_read_failed", ["tick_start", "state_read_failed"],
        _store_read_unavailable, "FetchError",
    ),
    FailureCase(
        "corrupt state", CorruptStateError, "state_read_failed",
        ["tick_start", "state_read_failed"], _corrupt_state, None,
    ),
    FailureCase(
        "lease write", FetchError, "lease_acquire_failed",
        ["tick_start", "lease_acquire_failed"], _lease_write_unavailable, "FetchError",
    ),
    FailureCase(
        "fetch", FetchError, "fetch_failed", ["tick_start", "fetch_failed"], _fetch_fails,
        "FetchError",
    ),
    FailureCase(
        "serialization", SerializationError, "serialization_failed",
        ["tick_start", "lease_acquired", "serialization_failed", "lease_released"], _null_key,
        "SerializationError",
    ),
    FailureCase(
        "handler", HandlerError, "handler_failed",
        ["tick_start", "lease_acquired", "batch_start", "handler_failed"], _handler_raises,
        "HandlerError",
    ),
    FailureCase(
        "lease lost", LostLeaseError, "lease_lost",
        ["tick_start", "lease_acquired", "batch_start", "lease_lost"],
        _operator_fences_the_owner, "LostLeaseError",
    ),
    FailureCase(
        "commit", CommitError, "commit_failed",
        ["tick_start", "lease_acquired", "batch_start", "commit_failed", "lease_release_failed"],
        _commit_unavailable, "CommitError",
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", FAILURES, ids=[c.name for c in FAILURES])
def test_event_sequence_of_each_failure_class(
    case: FailureCase,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog_debug: pytest.LogCaptureFixture,
) -> None:
    rig, handler = case.setup(sqlite_db, tmp_path)
    with pytest.raises(case.error):
        rig.trigger.tick(handler)
    assert rig.events(caplog_debug) == case.expected
    [record] = [r for r in caplog_debug.records if getattr(r, "event", "") == case.event]
    assert record.levelno >= logging.WARNING
    assert record.poller == "orders"  # type: ignore[attr-defined]
    if case.error_type is not None:
        assert rig.metrics.total("failures_total", error_type=case.error_type) == 1


def test_failure_classes_have_distinct_event_names() -> None:
    """Outages and corruption both surface when the state is read; every other class
    of failure has its own event name."""
    by_event: dict[str, list[str]] = {}
    for case in FAILURES:
        by_event.setdefault(case.event, []).append(case.name)
    assert by_event.pop("state_read_failed") == ["state read", "corrupt state"]
    assert all(len(names) == 1 for names in by_event.values())


def test_a_lost_race_is_a_quiet_lease_busy(
    sqlite_db: TestDatabase, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    rig, handler = _lost_race(sqlite_db, tmp_path)
    assert rig.trigger.tick_result(handler).outcome == "lost_race"
    assert rig.events(caplog_debug) == ["tick_start", "lease_busy"]
    assert caplog_debug.records[-1].reason == "lost_race"  # type: ignore[attr-defined]
    assert caplog_debug.records[-1].levelno == logging.DEBUG


def test_handler_failed_names_the_checkpoint_before_and_after(
    sqlite_db: TestDatabase, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    rig, handler = _handler_raises(sqlite_db, tmp_path)
    for _ in range(2):
        with pytest.raises(HandlerError):
            rig.trigger.tick(handler)
    failed = [r for r in caplog_debug.records if getattr(r, "event", "") == "handler_failed"]
    assert len(failed) == 2
    for attempt, record in enumerate(failed, start=1):
        assert record.checkpoint_before == docmod.position_to_json(docmod.Position())  # type: ignore[attr-defined]
        assert record.checkpoint_after["value"] == 50  # type: ignore[attr-defined]
        assert record.checkpoint_after["tiebreaker"] == {"id": 5}  # type: ignore[attr-defined]
        assert record.attempt == attempt  # type: ignore[attr-defined]
        assert record.error == "RuntimeError"  # type: ignore[attr-defined]
    assert rig.metrics.total("redelivered_batches_total") == 1


def test_every_emitted_metric_is_declared(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    rig = make_rig(sqlite_db, tmp_path, rows=25, max_batches_per_tick=2)
    assert rig.trigger.tick(ok_handler) == 20
    with pytest.raises(HandlerError):
        rig.trigger.tick(lambda events: 1 / 0)
    assert rig.trigger.tick(ok_handler) == 5
    assert rig.trigger.tick(ok_handler) == 0
    names = {
        name
        for store in (rig.metrics.counters, rig.metrics.gauges, rig.metrics.observations)
        for name, _ in store
    }
    assert names >= {"batches_total", "events_total", "failures_total", "batch_size"}
    assert names <= set(METRICS)


# --- a broken collector --------------------------------------------------------------------


class ExplodingMetrics:
    def __init__(self) -> None:
        self.calls = 0

    def _boom(self) -> None:
        self.calls += 1
        raise RuntimeError("metrics backend down")

    def increment(self, name: str, value: float = 1, *, labels: Any = None) -> None:
        self._boom()

    def observe(self, name: str, value: float, *, labels: Any = None) -> None:
        self._boom()

    def set_gauge(self, name: str, value: float, *, labels: Any = None) -> None:
        self._boom()


def test_a_collector_that_raises_never_breaks_a_tick(
    sqlite_db: TestDatabase, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    exploding = ExplodingMetrics()
    rig = make_rig(sqlite_db, tmp_path, rows=25, metrics=exploding, max_batches_per_tick=2)
    seen: list[int] = []
    assert rig.trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 20
    assert seen == list(range(1, 21))
    doc = rig.trigger.read_state()
    assert doc is not None
    assert doc.position.pk == {"id": 20}
    assert exploding.calls > 5
    warnings = [r for r in caplog_debug.records if getattr(r, "event", "") == "metrics_failed"]
    assert len(warnings) == exploding.calls
    assert {r.metric for r in warnings} >= {"batches_total", "events_total"}  # type: ignore[attr-defined]
    assert rig.events(caplog_debug)[-1] == "metrics_failed"  # the tick carried on to the end
    with pytest.raises(HandlerError):  # and failures still surface as themselves
        rig.trigger.tick(lambda events: 1 / 0)


# --- Prometheus -----------------------------------------------------------------------------


def test_prometheus_adapter_exposes_the_tick(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    prom = PrometheusMetrics(registry)
    rig = make_rig(sqlite_db, tmp_path, rows=15, metrics=prom, max_batches_per_tick=2)
    rig.trigger.tick(ok_handler)
    rig.trigger.tick(ok_handler)
    text = generate_latest(registry).decode()
    assert 'dbtrigger_batches_total{poller="orders",result="committed"} 2.0' in text
    assert 'dbtrigger_events_total{poller="orders"} 15.0' in text
    assert 'dbtrigger_ticks_total{poller="orders",result="idle"} 1.0' in text
    assert 'dbtrigger_batch_size_count{poller="orders"} 2.0' in text
    assert 'dbtrigger_batch_size_sum{poller="orders"} 15.0' in text
    assert 'dbtrigger_batch_size_bucket{le="10.0",poller="orders"} 2.0' in text
    assert 'dbtrigger_lag_rows{poller="orders"} 0.0' in text
    assert "# TYPE dbtrigger_last_success_timestamp gauge" in text
    assert "# TYPE dbtrigger_commit_duration_seconds histogram" in text
    assert "# HELP dbtrigger_failures_total Failures, by error_type" in text


def test_prometheus_adapter_labels_failures_and_tolerates_label_drift() -> None:
    registry = CollectorRegistry()
    prom = PrometheusMetrics(registry, namespace="app")
    prom.increment("failures_total", labels={"poller": "p", "error_type": "HandlerError"})
    prom.increment("failures_total", labels={"poller": "p"})  # missing label -> ""
    prom.increment("failures_total", labels={"poller": "p", "error_type": "X", "extra": "y"})
    prom.set_gauge("custom_depth", 7, labels={"poller": "p", "queue": "q1"})
    prom.observe("custom_wait_seconds", 0.3, labels={"poller": "p"})
    text = generate_latest(registry).decode()
    assert 'app_failures_total{error_type="HandlerError",poller="p"} 1.0' in text
    assert 'app_failures_total{error_type="",poller="p"} 1.0' in text
    assert 'app_failures_total{error_type="X",poller="p"} 1.0' in text
    assert 'app_custom_depth{poller="p",queue="q1"} 7.0' in text
    assert 'app_custom_wait_seconds_bucket{le="0.5",poller="p"} 1.0' in text


# --- OpenTelemetry ----------------------------------------------------------------------------


def _otel_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "dbtrigger"
            for metric in scope.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_otel_adapter_records_the_tick(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        otel = OpenTelemetryMetrics(provider)
        rig = make_rig(sqlite_db, tmp_path, rows=15, metrics=otel, max_batches_per_tick=2)
        rig.trigger.tick(ok_handler)
        points = _otel_points(reader)
    finally:
        provider.shutdown()
    [committed] = [
        p for p in points["dbtrigger.batches_total"] if p.attributes.get("result") == "committed"
    ]
    assert committed.value == 2
    assert dict(committed.attributes) == {"poller": "orders", "result": "committed"}
    [events] = points["dbtrigger.events_total"]
    assert events.value == 15
    [sizes] = points["dbtrigger.batch_size"]
    assert (sizes.count, sizes.sum, sizes.min, sizes.max) == (2, 15, 5, 10)
    [last] = points["dbtrigger.last_success_timestamp"]
    assert abs(last.value - dt.datetime.now(dt.timezone.utc).timestamp()) < 300
    assert "dbtrigger.commit_duration_seconds" in points


def test_otel_units_and_failures() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        otel = OpenTelemetryMetrics(provider)
        otel.increment("failures_total", labels={"poller": "p", "error_type": "FetchError"})
        otel.observe("fetch_duration_seconds", 0.25, labels={"poller": "p"})
        report_lag(otel, rows=12, seconds=3.5, labels={"poller": "p"})
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    assert data is not None
    metrics = {m.name: m for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics}
    assert metrics["dbtrigger.fetch_duration_seconds"].unit == "s"
    assert metrics["dbtrigger.lag_rows"].unit == "{row}"
    assert metrics["dbtrigger.lag_rows"].data.data_points[0].value == 12
    assert metrics["dbtrigger.lag_seconds"].data.data_points[0].value == 3.5
    [failure] = metrics["dbtrigger.failures_total"].data.data_points
    assert dict(failure.attributes) == {"poller": "p", "error_type": "FetchError"}
