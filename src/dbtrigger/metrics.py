"""The ``MetricsCollector`` port and the guard that keeps it from breaking ticks.

Three verbs, labels as a plain mapping, nothing else: enough for Prometheus,
OpenTelemetry or a StatsD client to sit behind, and trivial to fake. Metric
names are listed in :data:`METRICS` so adapters can pre-register them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Metric:
    """One metric: its kind (``counter``, ``gauge`` or ``histogram``), its help
    text, and the labels it carries besides ``poller`` (which :class:`SafeMetrics`
    always adds)."""

    kind: str
    help: str
    labels: tuple[str, ...] = ()


#: Every metric the library reports, by name. Durations are seconds; timestamps
#: are Unix seconds. Adapters whose backend fixes label names up front
#: (Prometheus) declare the labels; a label not listed is still accepted on a
#: metric's first use.
DECLARED: dict[str, Metric] = {
    "ticks_total": Metric("counter", "Ticks run, by result", ("result",)),
    "batches_total": Metric(
        "counter", "Batches handled, by result (committed/failed/lost)", ("result",)
    ),
    "events_total": Metric("counter", "Events delivered to the handler and committed"),
    "failures_total": Metric("counter", "Failures, by error_type", ("error_type",)),
    "lease_acquire_skipped_total": Metric(
        "counter", "Ticks skipped because another instance held the lease"
    ),
    "redelivered_batches_total": Metric(
        "counter", "Batches delivered again after a failed attempt"
    ),
    "quarantined_total": Metric("counter", "Rows set aside into a quarantine sink"),
    "visibility_held_back": Metric("gauge", "1 while the visibility guard withholds rows"),
    "visibility_held_back_seconds": Metric("gauge", "How long the guard has held progress back"),
    "visibility_blocking_pid": Metric(
        "gauge", "Backend pid whose open transaction holds the guard back"
    ),
    "null_cursor_rows": Metric("gauge", "Rows whose NULL cursor keeps them from delivery"),
    "fetch_duration_seconds": Metric("histogram", "Source fetch time"),
    "handler_duration_seconds": Metric("histogram", "Handler time per batch"),
    "commit_duration_seconds": Metric("histogram", "Checkpoint commit time"),
    "batch_size": Metric("histogram", "Events per batch"),
    "lag_seconds": Metric(
        "gauge",
        "Seconds behind: the committed cursor's age (timestamp cursors), the lag column's age on "
        "the oldest undelivered row, or seconds since that row was first seen (lag_basis)",
    ),
    "lag_basis": Metric(
        "gauge", "1, labelled with how lag_seconds is measured (basis)", ("lag_basis",)
    ),
    "lag_rows": Metric("gauge", "Rows pending after the checkpoint"),
    "lag_measurement_failures_total": Metric(
        "counter",
        "lag_seconds measurements that failed after a commit, by error_type (the commit stands, "
        "the gauge keeps its last value)",
        ("error_type",),
    ),
    "last_success_timestamp": Metric("gauge", "When the last batch committed"),
    "heartbeats_total": Metric(
        "counter", "Lease renewals (pollers) or claim extensions (queues) while a handler ran"
    ),
    "retries_total": Metric(
        "counter",
        "In-tick retries of store and source calls, by operation",
        ("operation", "error_type"),
    ),
    "partitions_owned": Metric("gauge", "Partitions this member owns (partitioned pollers)"),
    "partition_members": Metric(
        "gauge", "Members in the partitioned poller's group, as last written"
    ),
    "partition_rebalances_total": Metric(
        "counter", "Partitions claimed, stolen or released by this member, by action", ("action",)
    ),
    "backlog_rows": Metric(
        "gauge",
        "Scale signal: rows after the checkpoints of all of a partitioned poller's partitions",
    ),
    "backlog_oldest_seconds": Metric("gauge", "Scale signal: age of the oldest row behind"),
    "backlog_desired_replicas": Metric(
        "gauge", "Scale signal: min(partitions, ceil(backlog_rows / target rows per replica))"
    ),
    "partition_backlog_rows": Metric(
        "gauge", "Scale signal: rows after one partition's checkpoint", ("partition",)
    ),
    "partition_backlog_oldest_seconds": Metric(
        "gauge",
        "Scale signal: age of the oldest row behind one partition's checkpoint",
        ("partition",),
    ),
    "event_outcomes_total": Metric(
        "counter",
        "Per-event outcomes of delivered batches, by outcome (accepted/rejected/failed)",
        ("outcome",),
    ),
    "subscriber_outcomes_total": Metric(
        "counter",
        "Fan-out: per-event outcomes of each subscriber, by subscriber and outcome",
        ("subscriber", "outcome"),
    ),
    "ack_timeouts_total": Metric(
        "counter",
        "Fan-out: subscriber calls that outlived ack_timeout_seconds, by subscriber",
        ("subscriber",),
    ),
    "window_events": Metric("gauge", "Events in the settled window above the checkpoint"),
    "window_bytes": Metric("gauge", "Encoded size of the settled window in the state document"),
    "window_withheld_rows": Metric(
        "gauge",
        "Rows after the checkpoint the settled window's bound kept back on the last read (above "
        "0: the window blocks progress until its pinned events settle)",
    ),
    "window_overflow_total": Metric(
        "counter",
        "Events the full window could not remember, settled or waiting for a retry (delivered "
        "again)",
    ),
    "history_appends_total": Metric("counter", "Records appended to the durable history"),
    "history_append_failures_total": Metric(
        "counter",
        "History appends that failed, by error_type (the commit stands; the history catches up "
        "from the journal)",
        ("error_type",),
    ),
    "history_queue_overflow_total": Metric(
        "counter",
        "History records, or their per-event detail, the appender's queue let go of (the store "
        "fell far behind the commits)",
    ),
    "history_pruned_total": Metric("counter", "History records removed by retention"),
    "replays_total": Metric(
        "counter", "Replays of recorded batches, by mode (exact/reread/verify)", ("mode",)
    ),
    "replayed_events_total": Metric("counter", "Events handed to a handler by replays"),
    "replay_drift_rows_total": Metric(
        "counter",
        "Rows a replay found changed or gone since they were recorded, by kind",
        ("kind",),
    ),
    "dead_letter_replays_total": Metric(
        "counter",
        "Dead-lettered events replayed to a handler, by result (settled/rejected/failed)",
        ("result",),
    ),
    "queue_claim_duration_seconds": Metric("histogram", "Time to claim a batch from a queue table"),
    "queue_claimed_total": Metric("counter", "Rows claimed from a queue table"),
    "queue_rows_total": Metric(
        "counter",
        "Claimed rows settled, by result (done/retry/dead, or lost: the claim had expired)",
        ("result",),
    ),
    "queue_notifications_total": Metric(
        "counter", "LISTEN/NOTIFY wake-up hints received by an idle queue worker"
    ),
    "wake_notifications_total": Metric(
        "counter",
        "LISTEN/NOTIFY wake-up hints received by an idle poller worker (dbtrigger.wakeup)",
    ),
    "cdc_retained_bytes": Metric("gauge", "WAL the replication slot keeps for this poller (bytes)"),
    "cdc_safe_wal_bytes": Metric(
        "gauge",
        "WAL the server may still write before it invalidates the slot (max_slot_wal_keep_size)",
    ),
    "cdc_slot_lost": Metric("gauge", "1 when the replication slot is gone or invalidated"),
    "cdc_decode_backlog_total": Metric(
        "counter",
        "Reads of the log that ran out of time (DecodeBacklogError) and stepped in windows",
    ),
}

#: name -> (kind, help), from :data:`DECLARED`.
METRICS: dict[str, tuple[str, str]] = {name: (m.kind, m.help) for name, m in DECLARED.items()}

#: name -> the labels a metric carries besides ``poller``, from :data:`DECLARED`
#: (metrics with none are not listed).
METRIC_LABELS: dict[str, tuple[str, ...]] = {
    name: m.labels for name, m in DECLARED.items() if m.labels
}

#: Histogram bucket bounds for metrics that are not durations in seconds.
SIZE_BUCKETS: tuple[float, ...] = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)

#: Bucket bounds for ``*_seconds`` histograms: 1 ms to 10 minutes.
DURATION_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


def metric_kind(name: str, verb: str) -> str:
    """The declared kind of ``name``, or the kind its first use implies."""
    declared = METRICS.get(name)
    if declared is not None:
        return declared[0]
    return {"increment": "counter", "observe": "histogram", "set_gauge": "gauge"}[verb]


def metric_help(name: str) -> str:
    declared = METRICS.get(name)
    return declared[1] if declared is not None else name.replace("_", " ")


def metric_unit(name: str) -> str:
    """UCUM-style unit for OpenTelemetry: seconds for durations and timestamps."""
    if name.endswith("_seconds") or name.endswith("_timestamp"):
        return "s"
    if name in (
        "batch_size",
        "lag_rows",
        "null_cursor_rows",
        "window_events",
        "window_withheld_rows",
    ):
        return "{row}"
    return "1"


def report_lag(
    metrics: MetricsCollector,
    *,
    rows: int | None,
    seconds: float | None,
    labels: Labels | None = None,
) -> None:
    """Set ``lag_rows`` / ``lag_seconds`` from a measurement (e.g. a health check)."""
    if rows is not None:
        metrics.set_gauge("lag_rows", rows, labels=labels)
    if seconds is not None:
        metrics.set_gauge("lag_seconds", seconds, labels=labels)


@runtime_checkable
class MetricsCollector(Protocol):
    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None: ...

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None: ...

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None: ...


class NullMetrics:
    """Collects nothing."""

    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None:
        return None

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        return None

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        return None


class SafeMetrics:
    """Wraps a user collector so that its exceptions are logged, never raised.

    A broken metrics backend must not turn a good batch into a redelivery.
    """

    def __init__(self, inner: MetricsCollector | None, poller: str) -> None:
        self._inner = inner or NullMetrics()
        self._poller = poller
        #: Something collects: without a collector, callers may skip building
        #: what they would report (a tick reports a dozen values a batch).
        self.enabled = type(self._inner) is not NullMetrics  # (a subclass may collect)

    def _labels(self, labels: Labels | None) -> dict[str, str]:
        return {"poller": self._poller, **(labels or {})}

    def _guard(self, verb: str, name: str) -> None:
        log.warning(
            "metrics collector failed on %s(%s)",
            verb,
            name,
            exc_info=True,
            extra={"event": "metrics_failed", "poller": self._poller, "metric": name},
        )

    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None:
        try:
            self._inner.increment(name, value, labels=self._labels(labels))
        except Exception:  # noqa: BLE001 - metrics must never break a tick
            self._guard("increment", name)

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        try:
            self._inner.observe(name, value, labels=self._labels(labels))
        except Exception:  # noqa: BLE001
            self._guard("observe", name)

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        try:
            self._inner.set_gauge(name, value, labels=self._labels(labels))
        except Exception:  # noqa: BLE001
            self._guard("set_gauge", name)


class InMemoryMetrics:
    """A collector that remembers everything; for tests and the demo.

    Lanes and subscribers report from their own threads, so every update and
    read holds one lock: an unlocked ``+=`` loses counts under contention and
    a sum over the dict fails if another thread adds a label set meanwhile.
    """

    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.observations: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(name: str, labels: Labels | None) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted((labels or {}).items()))

    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None:
        key = self._key(name, labels)
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + value

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        key = self._key(name, labels)
        with self._lock:
            self.observations.setdefault(key, []).append(value)

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        key = self._key(name, labels)
        with self._lock:
            self.gauges[key] = value

    def total(self, name: str, **labels: str) -> float:
        """Sum of a counter over every label set that includes ``labels``."""
        want = set(labels.items())
        with self._lock:
            items = list(self.counters.items())
        return sum(v for (n, lab), v in items if n == name and want <= set(lab))

    def gauge(self, name: str, **labels: str) -> float | None:
        want = set(labels.items())
        with self._lock:
            items = list(self.gauges.items())
        for (n, lab), v in items:
            if n == name and want <= set(lab):
                return v
        return None
