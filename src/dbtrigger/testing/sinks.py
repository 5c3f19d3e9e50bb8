"""A dead-letter (quarantine) sink that keeps its records in memory.

For tests of handlers and of the poison-row path: hand a
:class:`MemoryQuarantineSink` to ``PollTrigger(quarantine=...)`` and assert on
:meth:`MemoryQuarantineSink.records`. It passes the same sink contract suite
(:class:`dbtrigger.testing.SinkContract`) as the SQL table and JSON-lines
sinks. Setting :attr:`MemoryQuarantineSink.unavailable` makes every ``put``
fail the way a real sink fails when its storage is down, so the "sink is down,
nothing may be skipped" path can be tested too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dbtrigger.errors import QuarantineError
from dbtrigger.quarantine import QuarantineRecord


class MemoryQuarantineSink:
    """Quarantined rows in a list, stored once per (poller, event_id).

    Thread-safe. A record ``put`` again (a commit that failed after the put)
    replaces nothing: the first copy is kept, as the SQL sink does.
    """

    def __init__(self, name: str = "memory") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], QuarantineRecord] = {}
        #: While True, every ``put`` raises :class:`~dbtrigger.errors.QuarantineError`.
        self.unavailable = False
        #: How many ``put`` calls were made (failed ones included).
        self.puts = 0

    def describe(self) -> str:
        return f"memory:{self._name}"

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        with self._lock:
            self.puts += 1
            if self.unavailable:
                raise QuarantineError(
                    f"could not write {len(records)} row(s) to quarantine {self.describe()}: "
                    "marked unavailable"
                )
            for record in records:
                self._records.setdefault((record.poller, record.event_id), record)

    def records(self, poller: str | None = None) -> list[QuarantineRecord]:
        """The records stored, in the order they were first put."""
        with self._lock:
            out = list(self._records.values())
        return [r for r in out if poller is None or r.poller == poller]


__all__ = ["MemoryQuarantineSink"]
