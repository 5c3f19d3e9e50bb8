"""The runtime's event table: every event's metrics are declared, and one emit
logs once and moves its metrics once (no fakes: InMemoryMetrics and caplog)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from dbtrigger.cursor import Position
from dbtrigger.metrics import METRIC_LABELS, METRICS, InMemoryMetrics, SafeMetrics
from dbtrigger.runtime.telemetry import EVENTS, Count, Gauge, Observe, Telemetry
from dbtrigger.sources.base import CountsAfter, FindsNullCursors, ReportsVisibility


def rig() -> tuple[Telemetry, InMemoryMetrics]:
    metrics = InMemoryMetrics()
    return Telemetry("orders", SafeMetrics(metrics, "orders")), metrics


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_every_metric_an_event_moves_is_declared_with_its_labels(event: str) -> None:
    for update in EVENTS[event].updates:
        assert update.metric in METRICS, (event, update.metric)
        kind = METRICS[update.metric][0]
        want = {Count: "counter", Observe: "histogram", Gauge: "gauge"}[type(update)]
        assert kind == want, (event, update.metric)
        if isinstance(update, Count):
            labels = set(update.labels) | set(update.label_keys)
            assert labels <= set(METRIC_LABELS.get(update.metric, ())), (event, labels)


def test_emit_logs_at_the_declared_level_and_counts_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry, metrics = rig()
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        telemetry.emit(
            "batch_committed",
            "committed %d rows",
            3,
            batch_id="b1",
            rows=3,
            values={"seconds": 0.5, "timestamp": 1000.0, "lag_seconds": None},
        )
    [record] = caplog.records
    # Per batch: DEBUG (the tick's one INFO line is its driver's: dbtrigger run, run()).
    assert (record.levelno, record.getMessage()) == (logging.DEBUG, "committed 3 rows")
    assert (record.event, record.poller, record.batch_id) == ("batch_committed", "orders", "b1")  # type: ignore[attr-defined]
    assert not hasattr(record, "seconds")  # values feed metrics, not the log line
    assert metrics.total("events_total") == 3
    assert metrics.total("batches_total", result="committed") == 1
    assert metrics.gauge("last_success_timestamp") == 1000.0
    assert metrics.gauge("lag_seconds") is None  # None means "not measured": left alone
    assert metrics.observations[("batch_size", (("poller", "orders"),))] == [3]


def test_label_values_come_from_the_emitted_values(caplog: pytest.LogCaptureFixture) -> None:
    telemetry, metrics = rig()
    telemetry.emit("lease_busy", "busy", values={"result": "lost_race"})
    telemetry.on_retry("fetch", 1, TimeoutError("slow"), 0.1)
    assert metrics.total("ticks_total", result="lost_race") == 1
    assert metrics.total("lease_acquire_skipped_total") == 1
    assert metrics.total("retries_total", operation="fetch", error_type="TimeoutError") == 1


def test_metrics_only_events_do_not_log(caplog: pytest.LogCaptureFixture) -> None:
    telemetry, metrics = rig()
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        telemetry.emit("fetched", values={"seconds": 0.01})
    assert caplog.records == []
    assert metrics.observations[("fetch_duration_seconds", (("poller", "orders"),))] == [0.01]


def test_heartbeat_events_keep_their_log_names_and_count_a_loss_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The heartbeat reports through the table too. Its ``lease_lost`` records
    (``during=heartbeat``) explain a loss that the stopped batch then counts:
    they move no loss metric themselves."""
    telemetry, metrics = rig()
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        telemetry.emit("lease_renewed", "lease renewed (token %s)", 3, fencing_token=3)
        telemetry.emit("heartbeat_failed", "failed: %s", "down", fencing_token=3)
        telemetry.emit("heartbeat_rejected", "rejected", fencing_token=3, during="heartbeat")
        telemetry.emit("heartbeat_expired", "expired", fencing_token=3, during="heartbeat")
    got = [(r.event, r.levelno, getattr(r, "during", None)) for r in caplog.records]  # type: ignore[attr-defined]
    assert got == [
        ("lease_renewed", logging.DEBUG, None),
        ("heartbeat_failed", logging.WARNING, None),
        ("lease_lost", logging.WARNING, "heartbeat"),
        ("lease_lost", logging.ERROR, "heartbeat"),
    ]
    assert metrics.total("heartbeats_total") == 1
    assert metrics.total("batches_total") == 0
    assert metrics.total("failures_total") == 0


def test_an_undeclared_event_is_a_programming_error() -> None:
    telemetry, _ = rig()
    with pytest.raises(KeyError):
        telemetry.emit("batch_comitted", "typo")


class Counting:
    def count_after(self, after: Position) -> int:
        del after
        return 7


class Forwarding:
    """Like dbtrigger.faults.FaultySource: unknown attributes come from the inner source."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class NullFinder:
    cursor_column = "seq"

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        return [{"id": 1}][:limit]


class Reporting:
    last_fetch_info: Mapping[str, Any] | None = None


@pytest.mark.parametrize(
    ("source", "capabilities"),
    [
        (object(), set()),
        (Counting(), {CountsAfter}),
        (Forwarding(Counting()), {CountsAfter}),
        (NullFinder(), {FindsNullCursors}),
        (Reporting(), {ReportsVisibility}),
    ],
    ids=["plain", "counts", "wrapped", "null-finder", "reports"],
)
def test_source_capabilities_are_protocols(source: object, capabilities: set[type]) -> None:
    for kind in (CountsAfter, FindsNullCursors, ReportsVisibility):
        assert isinstance(source, kind) is (kind in capabilities), kind


def _documented_metrics() -> dict[str, tuple[str, str]]:
    """name -> (kind, labels column) from the metrics table of docs/operations.md."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(\w+)` \| (\w+) \|([^|]*)\| .+ \|", line)
        if match is not None:
            rows[match[1]] = (match[2], match[3])
    return rows


def test_every_declared_metric_is_documented_with_its_kind_and_labels() -> None:
    documented = _documented_metrics()
    assert sorted(set(METRICS) - set(documented)) == [], "declared but not in docs/operations.md"
    assert sorted(set(documented) - set(METRICS)) == [], "documented but not declared"
    for name, (kind, labels) in documented.items():
        assert kind == METRICS[name][0], name
        named = set(re.findall(r"`(\w+)`", labels))
        assert named == set(METRIC_LABELS.get(name, ())), name
