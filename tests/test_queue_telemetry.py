"""A queue tick's logs and metrics come from the declared event table.

Every record a queue writes names an event declared in
:data:`dbtrigger.runtime.telemetry.EVENTS` (``queue_*``), is logged to the
``dbtrigger.queue`` logger with ``poller`` set to the queue's name, and every
metric it moves is declared in :data:`dbtrigger.metrics.METRICS`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from dbtrigger import ClaimContext, ClaimSource, RowChange
from dbtrigger.metrics import METRIC_LABELS, METRICS, InMemoryMetrics
from dbtrigger.runtime.telemetry import EVENTS
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, trigger


@pytest.fixture
def source(sqlite_db: TestDatabase) -> Iterator[ClaimSource]:
    make_jobs(sqlite_db, 6)
    src = ClaimSource(url=sqlite_db.url, table="jobs", schema=sqlite_db.schema, pk_columns=["id"])
    yield src
    src.close()


def queue_events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [str(getattr(r, "event", "")) for r in caplog.records if r.name == "dbtrigger.queue"]


def test_queue_events_are_declared_and_their_metrics_too() -> None:
    queue = {name: spec for name, spec in EVENTS.items() if name.startswith("queue_")}
    assert {"queue_claimed", "queue_rows_settled", "queue_claim_lost", "queue_row_dead"} <= set(
        queue
    )
    for spec in queue.values():
        for update in spec.updates:
            assert update.metric in METRICS
    assert METRIC_LABELS["queue_rows_total"] == ("result",)


def test_a_tick_logs_declared_events_and_counts_each_outcome(
    source: ClaimSource, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = InMemoryMetrics()
    q = trigger(source, batch_size=6, max_attempts=1, metrics=metrics)

    def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        for e in events:
            if e.pk["id"] == 2:
                ctx.reject(e, "malformed")

    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        result = q.tick_result(handle)
        idle = q.tick_result(handle)
    assert (result.rows, result.dead, idle.outcome) == (5, 1, "idle")
    events = queue_events(caplog)
    assert events == ["queue_claimed", "queue_row_dead", "queue_settled"]
    assert all(e in EVENTS for e in events)
    for record in caplog.records:
        if record.name == "dbtrigger.queue":
            assert record.poller == "jobs"  # type: ignore[attr-defined]
            assert record.batch_id == result.token  # type: ignore[attr-defined]
    assert metrics.total("queue_claimed_total") == 6
    assert metrics.total("queue_rows_total", result="done") == 5
    assert metrics.total("queue_rows_total", result="dead") == 1
    assert metrics.total("events_total") == 5
    assert metrics.total("ticks_total", result="settled") == 1
    assert metrics.total("ticks_total", result="idle") == 1
    assert len(metrics.observations[("queue_claim_duration_seconds", (("poller", "jobs"),))]) == 2
    assert len(metrics.observations[("handler_duration_seconds", (("poller", "jobs"),))]) == 1


def test_a_failing_handler_is_a_handler_error_failure(
    source: ClaimSource, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = InMemoryMetrics()
    q = trigger(source, batch_size=6, metrics=metrics)

    def fail(events: list[RowChange]) -> None:
        raise ValueError("downstream said no")

    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        result = q.tick_result(fail)
    assert result.retried == 6
    [record] = [r for r in caplog.records if r.name == "dbtrigger.queue"]
    assert record.event == "queue_handler_failed"  # type: ignore[attr-defined]
    assert record.error == "ValueError"  # type: ignore[attr-defined]
    assert metrics.total("failures_total", error_type="HandlerError") == 1
    assert metrics.total("queue_rows_total", result="retry") == 6


def test_queue_events_and_metrics_are_documented() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    logged = [name for name, spec in EVENTS.items() if spec.level is not None]
    undocumented = [
        name
        for name in [*logged, *METRICS]
        if name.startswith("queue_") and f"`{name}`" not in text
    ]
    assert undocumented == []
