"""A :class:`~dbtrigger.metrics.MetricsCollector` on the OpenTelemetry metrics API.

Install the ``otel`` extra (``opentelemetry-api``); the application brings the
SDK and exporter (OTLP, Azure Monitor, Prometheus...) and sets the global
``MeterProvider``, or passes one here. Without an SDK the API's no-op
provider makes every call free.

Instruments are named ``dbtrigger.<metric>`` (``dbtrigger.batches_total``,
``dbtrigger.lag_seconds``...) with units ``s`` for durations and timestamps and
``{row}`` for row counts; labels become attributes. Counters map to
``Counter``, histograms to ``Histogram`` and gauges to the synchronous
``Gauge`` (API 1.27+), since the poller knows the value at the moment it
changes rather than when the exporter asks.
"""

from __future__ import annotations

import threading
from typing import Any

from dbtrigger.metrics import Labels, metric_help, metric_kind, metric_unit

try:
    from opentelemetry import metrics as otel_metrics
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dbtrigger.metrics_otel needs opentelemetry-api: pip install 'dbtrigger[otel]'"
    ) from exc

from dbtrigger import __version__


class OpenTelemetryMetrics:
    """Instruments created lazily on one ``Meter``.

    Args:
        meter_provider: where to get the meter (default: the global provider).
        meter: use this meter instead.
        prefix: instrument name prefix.
    """

    def __init__(
        self,
        meter_provider: Any = None,
        *,
        meter: Any = None,
        prefix: str = "dbtrigger.",
    ) -> None:
        if meter is None:
            provider = meter_provider or otel_metrics.get_meter_provider()
            meter = provider.get_meter("dbtrigger", __version__)
        self.meter = meter
        self.prefix = prefix
        self._instruments: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _instrument(self, name: str, verb: str) -> Any:
        with self._lock:
            found = self._instruments.get(name)
            if found is not None:
                return found
            kind = metric_kind(name, verb)
            options = {
                "name": f"{self.prefix}{name}",
                "unit": metric_unit(name),
                "description": metric_help(name),
            }
            if kind == "counter":
                instrument = self.meter.create_counter(**options)
            elif kind == "gauge":
                instrument = self.meter.create_gauge(**options)
            else:
                instrument = self.meter.create_histogram(**options)
            self._instruments[name] = instrument
            return instrument

    @staticmethod
    def _attributes(labels: Labels | None) -> dict[str, str]:
        return {k: str(v) for k, v in (labels or {}).items()}

    def increment(self, name: str, value: float = 1, *, labels: Labels | None = None) -> None:
        self._instrument(name, "increment").add(value, attributes=self._attributes(labels))

    def observe(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        self._instrument(name, "observe").record(value, attributes=self._attributes(labels))

    def set_gauge(self, name: str, value: float, *, labels: Labels | None = None) -> None:
        self._instrument(name, "set_gauge").set(value, attributes=self._attributes(labels))


__all__ = ["OpenTelemetryMetrics"]
