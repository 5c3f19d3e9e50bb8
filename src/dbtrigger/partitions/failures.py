"""A failing partition backs off on its own; the member's other partitions go on.

A member ticks its partitions one after another, and a partition whose tick
fails (a poison batch with no dead-letter sink, a handler that raises on every
call) used to fail the member's whole round: the worker then backed off the
member, up to five minutes, and the rows of every healthy partition it owned
waited as long. Here each failing partition keeps its own count and its own
doubling delay (``backoff_delay``, the worker's rule, from one second to the
worker's cap), is skipped until it is due, and is named at WARNING each time
it fails; the round still raises the error, so the worker says the tick failed
as before, and it is told (``TickResult.failing_partitions``) that the member's
next round is due at the usual pace.

A partition taken over mid-tick (its lease fenced by a member that declared
this one dead, or by an operator) is no failure: it is said at WARNING and
neither backs off nor fails the round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dbtrigger.errors import DbTriggerError
from dbtrigger.runtime.pacing import DEFAULT_MAX_BACKOFF_SECONDS, backoff_delay

log = logging.getLogger("dbtrigger.partitions")

#: The first delay of a failing partition; it doubles per failure in a row.
FIRST_DELAY_SECONDS = 1.0


class PartitionBackoff:
    """Per partition: failures in a row and when it may be ticked again (monotonic)."""

    def __init__(self, poller: str, monotonic: Callable[[], float]) -> None:
        self.poller = poller
        self.monotonic = monotonic
        self._failing: dict[str, tuple[int, float]] = {}

    @property
    def failing(self) -> tuple[str, ...]:
        """The partitions whose last tick failed (backing off or due again)."""
        return tuple(sorted(self._failing))

    def waiting(self, pid: str) -> bool:
        """True while ``pid`` is backing off: the round skips it."""
        entry = self._failing.get(pid)
        return entry is not None and self.monotonic() < entry[1]

    def succeeded(self, pid: str) -> None:
        if self._failing.pop(pid, None) is not None:
            log.info(
                "poller %s: partition %s ticks again",
                self.poller,
                pid,
                extra={"event": "partition_recovered", "poller": self.poller, "partition": pid},
            )

    def failed(self, pid: str, exc: DbTriggerError, others: int) -> None:
        """Count a failure of ``pid`` and say so, with when it is tried again."""
        count = self._failing.get(pid, (0, 0.0))[0] + 1
        delay = backoff_delay(count, FIRST_DELAY_SECONDS, DEFAULT_MAX_BACKOFF_SECONDS)
        self._failing[pid] = (count, self.monotonic() + delay)
        log.warning(
            "poller %s: partition %s failed (%d in a row: %s: %s); it is tried again in %gs "
            "at the earliest, and this member's %d other partition(s) go on meanwhile",
            self.poller,
            pid,
            count,
            type(exc).__name__,
            exc,
            delay,
            others,
            extra={
                "event": "partition_failed",
                "poller": self.poller,
                "partition": pid,
                "failures_in_a_row": count,
                "retry_in_seconds": delay,
            },
        )

    def taken_over(self, pid: str, exc: DbTriggerError, member: str) -> None:
        """Say that ``pid`` was taken over mid-tick: not a failure, so no backoff."""
        log.warning(
            "poller %s: partition %s was taken over while member %s ticked it (%s: %s); "
            "its batch in flight is not committed here and its new owner delivers it "
            "again, and this member goes on with the partitions it still owns",
            self.poller,
            pid,
            member,
            type(exc).__name__,
            exc,
            extra={
                "event": "partition_taken_over",
                "poller": self.poller,
                "partition": pid,
                "member": member,
            },
        )

    def forget(self, keep: set[str]) -> None:
        """Drop the partitions this member no longer owns (a new owner starts afresh)."""
        for pid in [p for p in self._failing if p not in keep]:
            del self._failing[pid]


__all__ = ["FIRST_DELAY_SECONDS", "PartitionBackoff"]
