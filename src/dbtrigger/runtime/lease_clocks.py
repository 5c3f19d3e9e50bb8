"""Leases written by a clock running ahead of ours: how long one has stood.

A lease's expiry is the writer's clock plus its TTL. A holder whose clock
runs ahead writes expiries we would wait for too long, so the lease rule
(:func:`dbtrigger.state.lease.believed_expiry`) also takes a lease over once
it has stood unchanged for its own TTL on *our* clock. That needs to know when
we first saw the document as it is (its etag), kept across ticks here; and an
operator is told once per such lease that the clocks disagree.
"""

from __future__ import annotations

import datetime as dt

from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod


class LeaseClocks:
    """One trigger's view of the leases it found held (see the module docstring)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        #: The state etag as last read and when (our clock) it was first read.
        self._seen: tuple[str | None, dt.datetime] | None = None
        self._warned: str | None = None

    def first_seen(self, etag: str | None, now: dt.datetime) -> dt.datetime:
        """When the document under ``etag`` was first read (``now`` if it just changed)."""
        if self._seen is None or self._seen[0] != etag:
            self._seen = (etag, now)
        return self._seen[1]

    def busy(self, decision: leasemod.Busy, etag: str | None) -> None:
        """Say once per lease (etag) that its holder's clock seems to run ahead."""
        if decision.skew is None or self._warned == etag:
            return
        self._warned = etag
        self.telemetry.emit(
            "clock_skew_suspected",
            "the lease of %s (token %s) was written by a clock about %s ahead of "
            "ours; its expiry is not believed as written: unless its holder "
            "heartbeats, it is taken over once it has stood unchanged for its own "
            "TTL (at %s). Check the clocks (NTP) of both hosts",
            decision.holder,
            decision.fencing_token,
            decision.skew,
            docmod.format_time(decision.free_at),
            holder=decision.holder,
            skew_seconds=decision.skew.total_seconds(),
        )


__all__ = ["LeaseClocks"]
