"""The ``MetricsCollector`` port and the guard that keeps it from breaking ticks.

Three verbs, labels as a plain mapping, nothing else: enough for Prometheus,
OpenTelemetry or a StatsD client to sit behind, and trivial to fake. Metric
names are listed in :data:`METRICS` so adapters can pre-register them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)

Labels = Mapping[str, str]

#: name -> (kind, help). Durations are seconds; timestamps are Unix seconds.
METRICS: dict[str, tuple[str, str]] = {
    "ticks_total": ("counter", "Ticks run, by result"),
    "batches_total": ("counter", "Batches handled, by result (committed/failed/lost)"),
    "events_total": ("counter", "Events delivered to the handler and committed"),
    "failures_total": ("counter", "Failures, by error_type"),
    "lease_acquire_skipped_total": (
        "counter",
        "Ticks skipped because another instance held the lease",
    ),
    "redelivered_batches_total": ("counter", "Batches delivered again after a failed attempt"),
    "quarantined_total": ("counter", "Rows set aside into a quarantine sink"),
    "null_cursor_rows": ("gauge", "Rows with a NULL cursor stranded behind the checkpoint"),
    "fetch_duration_seconds": ("histogram", "Source fetch time"),
    "handler_duration_seconds": ("histogram", "Handler time per batch"),
    "commit_duration_seconds": ("histogram", "Checkpoint commit time"),
    "batch_size": ("histogram", "Events per batch"),
    "lag_seconds": ("gauge", "Age of the newest committed cursor behind now (timestamp cursors)"),
    "lag_rows": ("gauge", "Rows pending after the checkpoint"),
    "last_success_timestamp": ("gauge", "When the last batch committed"),
}


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
    """A collector that remembers everything; for tests and the demo."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.observations: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}

    @staticmethod
    def _key(name: str, labels: Labels | None) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted((labels or {}).items()))

    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None:
        key = self._key(name, labels)
        self.counters[key] = self.counters.get(key, 0) + value

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        self.observations.setdefault(self._key(name, labels), []).append(value)

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        self.gauges[self._key(name, labels)] = value

    def total(self, name: str, **labels: str) -> float:
        """Sum of a counter over every label set that includes ``labels``."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.counters.items() if n == name and want <= set(lab))

    def gauge(self, name: str, **labels: str) -> float | None:
        want = set(labels.items())
        for (n, lab), v in self.gauges.items():
            if n == name and want <= set(lab):
                return v
        return None
