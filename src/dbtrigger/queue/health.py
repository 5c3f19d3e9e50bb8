"""A queue worker's health: a claim held far past its visibility timeout.

A claim queue has no state document, so :func:`dbtrigger.check_health` has
nothing to read for it. What goes wrong unseen is in-process: a handler call
that does not return keeps its claim alive through the heartbeat (each beat
extends the visibility timeout), so the rows are neither settled nor handed to
another worker, and only the log says so (``handler_slow`` /
``handler_stuck``). :meth:`QueueTrigger.health <dbtrigger.QueueTrigger.health>`
reports it from the claims this trigger has in flight: **stale** when one has
been held longer than ``stale_after_seconds``, as :func:`~dbtrigger.check_health`
does for a poller's lease held with no commit. It reads nothing (no SQL): other
workers' claims are theirs to report.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass

from dbtrigger.health import OK, STALE, HealthReport


@dataclass(frozen=True)
class InFlight:
    """A claim whose handler call is running: its token, rows and start."""

    token: str
    rows: int
    started_at: dt.datetime


def claims_health(
    name: str,
    in_flight: Mapping[str, InFlight],
    *,
    visibility_timeout: float,
    stale_after_seconds: float,
    now: dt.datetime,
) -> HealthReport:
    """Judge the claims ``in_flight`` (see the module docstring)."""
    claims = list(in_flight.values())
    if not claims:
        return HealthReport(
            name,
            OK,
            "no claim in flight",
            now,
            lease="no claim",
            stale_after_seconds=stale_after_seconds,
        )
    oldest = min(claims, key=lambda c: c.started_at)
    held = (now - oldest.started_at).total_seconds()
    lease = f"{len(claims)} claim(s) in flight, the oldest held {held:.0f}s ({oldest.token})"
    if held > stale_after_seconds:
        return HealthReport(
            name,
            STALE,
            f"claim {oldest.token} ({oldest.rows} row(s)) has been held {held:.0f}s "
            f"(limit {stale_after_seconds:.0f}s; visibility timeout {visibility_timeout:g}s, "
            "extended by the heartbeat while the handler runs): a handler call that does not "
            "return (handler_slow / handler_stuck in this worker's log; "
            "handler_timeout_seconds bounds it)",
            now,
            lease=lease,
            stale_after_seconds=stale_after_seconds,
        )
    return HealthReport(name, OK, lease, now, lease=lease, stale_after_seconds=stale_after_seconds)


__all__ = ["InFlight", "claims_health"]
