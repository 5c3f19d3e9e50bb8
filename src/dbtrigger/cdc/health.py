"""How a log source measures its health while it runs: now and then, never failing a read.

What goes wrong with a log position goes wrong slowly and then all at once (a
slot's retained WAL grows until the disk fills or the server invalidates it;
a binlog file the position needs is purged). So a running source measures,
at most every :data:`REPORT_SECONDS` and only when it has metrics to set, and
a measurement that fails is logged at DEBUG and tried again later: health is
reported, it never stops delivery. :mod:`dbtrigger.cdc.pg_health` and
:mod:`dbtrigger.cdc.binlog_health` say what each database measures, and turn
the same facts into ``dbtrigger check`` findings (:data:`OK`, :data:`WARNING`,
:data:`ERROR`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Generic, Protocol, TypeVar

from dbtrigger.cdc.position import LogPosition
from dbtrigger.errors import DbTriggerError
from dbtrigger.metrics import MetricsCollector

log = logging.getLogger("dbtrigger.cdc")

#: Seconds between measurements while a poller runs.
REPORT_SECONDS = 30.0
OK, WARNING, ERROR = "ok", "warning", "error"


class Measured(Protocol):
    @property
    def metrics(self) -> MetricsCollector | None: ...


S = TypeVar("S", bound=Measured)


class HealthReporter(ABC, Generic[S]):
    """Measures the source now and then and sets the ``cdc_*`` gauges."""

    def __init__(self, source: S) -> None:
        self.source = source
        self._next = 0.0

    def maybe_report(self, after: LogPosition | None) -> None:
        metrics = self.source.metrics
        now = time.monotonic()
        if metrics is None or now < self._next:
            return
        self._next = now + REPORT_SECONDS
        try:
            self.measure(metrics, after)
        except DbTriggerError as exc:
            log.debug("log source health not measured: %s", exc)

    @abstractmethod
    def measure(self, metrics: MetricsCollector, after: LogPosition | None) -> None:
        """Read the server and set the gauges (a DbTriggerError: not measured this time)."""


__all__ = ["ERROR", "OK", "REPORT_SECONDS", "WARNING", "HealthReporter"]
