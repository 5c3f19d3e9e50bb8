"""A :class:`~dbtrigger.metrics.MetricsCollector` for ``prometheus_client``.

Install the ``prometheus`` extra. Names get a ``dbtrigger_`` prefix
(``dbtrigger_batches_total``, ``dbtrigger_lag_seconds``...); every metric has a
``poller`` label, and the labels in :data:`~dbtrigger.metrics.METRIC_LABELS`.

Every metric in :data:`~dbtrigger.metrics.METRICS` is registered when the
adapter is created, so its HELP and TYPE are scrapeable before its first sample.
Prometheus fixes a metric's label names when it is created, while the
collector protocol lets each call pass any labels. So other metrics are created
on first use with whatever labels that first call brought;
later calls fill a missing label with ``""`` and drop labels the metric does
not have (logged once at DEBUG). Metrics are registered in ``registry``
(default: the global ``REGISTRY``), so two adapters on one registry would
collide - share one adapter between pollers instead.

Usage::

    from prometheus_client import start_http_server
    metrics = PrometheusMetrics()
    start_http_server(9100)
    trigger = PollTrigger(..., metrics=metrics)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dbtrigger.metrics import (
    DURATION_BUCKETS,
    METRIC_LABELS,
    METRICS,
    SIZE_BUCKETS,
    Labels,
    metric_help,
    metric_kind,
)

try:
    import prometheus_client
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dbtrigger.metrics_prometheus needs prometheus_client: pip install 'dbtrigger[prometheus]'"
    ) from exc

log = logging.getLogger(__name__)

_VERB = {"counter": "increment", "gauge": "set_gauge", "histogram": "observe"}


class PrometheusMetrics:
    """Counters, gauges and histograms in a ``prometheus_client`` registry.

    Args:
        registry: where to register (default ``prometheus_client.REGISTRY``).
        namespace: name prefix, joined with ``_``.
        buckets: override histogram buckets per metric name.
    """

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry | None = None,
        *,
        namespace: str = "dbtrigger",
        buckets: dict[str, tuple[float, ...]] | None = None,
    ) -> None:
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self.namespace = namespace
        self._buckets = dict(buckets or {})
        self._metrics: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._dropped: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        for name, (kind, _) in METRICS.items():
            # Registered up front so HELP/TYPE are scrapeable (and alert rules can
            # reference the series) before the first failure ever happens.
            self._metric(name, _VERB[kind], {})

    def _bucket_bounds(self, name: str) -> tuple[float, ...]:
        if name in self._buckets:
            return self._buckets[name]
        return DURATION_BUCKETS if name.endswith("_seconds") else SIZE_BUCKETS

    def _metric(self, name: str, verb: str, labels: Labels) -> tuple[Any, tuple[str, ...]]:
        with self._lock:
            found = self._metrics.get(name)
            if found is not None:
                return found
            declared = ("poller", *METRIC_LABELS.get(name, ()))
            names = tuple(dict.fromkeys([*declared, *sorted(labels)]))
            kind = metric_kind(name, verb)
            full = f"{self.namespace}_{name}" if self.namespace else name
            common: dict[str, Any] = {
                "documentation": metric_help(name),
                "labelnames": names,
                "registry": self.registry,
            }
            metric: Any
            if kind == "counter":
                metric = prometheus_client.Counter(full, **common)
            elif kind == "gauge":
                metric = prometheus_client.Gauge(full, **common)
            else:
                metric = prometheus_client.Histogram(
                    full, buckets=self._bucket_bounds(name), **common
                )
            self._metrics[name] = (metric, names)
            return metric, names

    def _child(self, name: str, verb: str, labels: Labels | None) -> Any:
        given = dict(labels or {})
        metric, names = self._metric(name, verb, given)
        for extra in set(given) - set(names):
            if (name, extra) not in self._dropped:
                self._dropped.add((name, extra))
                log.debug("metric %s has no label %r; dropped", name, extra)
        return metric.labels(**{n: str(given.get(n, "")) for n in names})

    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None:
        self._child(name, "increment", labels).inc(value)

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        self._child(name, "observe", labels).observe(value)

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        self._child(name, "set_gauge", labels).set(value)


__all__ = ["PrometheusMetrics"]
