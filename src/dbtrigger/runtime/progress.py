"""Progress while a worker drains a backlog: rows delivered, rows behind, a rate, an ETA.

The worker loop (:mod:`dbtrigger.runtime.runner`) starts a :class:`Tracker`
when a tick leaves rows pending and ends it at the first idle tick; in
between it reports a :class:`DrainProgress` every ``progress_interval``
seconds to a callback (default :func:`log_progress`, one INFO line; the CLI
draws a progress bar on a terminal), none while no row moved since the last
(a drain held back says so in its tick line, not in the same progress line
every interval). How many rows are behind is counted by
the trigger (:meth:`~dbtrigger.runtime.trigger.Trigger.rows_behind`) when the
drain starts and about once a minute since, never per tick.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dbtrigger.durations import human_duration
from dbtrigger.errors import DbTriggerError
from dbtrigger.runtime.trigger import Trigger

log = logging.getLogger("dbtrigger.runner")

#: Default time between two progress lines while a backlog drains.
DEFAULT_PROGRESS_INTERVAL_SECONDS = 10.0
#: How often the rows still behind are counted again while draining.
BEHIND_RECOUNT_SECONDS = 60.0
#: A rate (and an ETA from it) is given once the drain has run this long: over
#: the first milliseconds it would say nothing about the backlog.
MIN_RATE_SECONDS = 1.0


@dataclass(frozen=True)
class DrainProgress:
    """Where a draining poller is: rows delivered since it fell behind, and what is left.

    ``behind`` is an estimate (counted when the drain started and about once
    a minute since, minus what was delivered meanwhile); None when the source
    cannot count. ``caught_up`` is True on the last report of a drain.
    """

    poller: str
    delivered: int
    behind: int | None
    elapsed_seconds: float
    caught_up: bool = False

    @property
    def rate(self) -> float:
        return self.delivered / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def rate_known(self) -> bool:
        return self.elapsed_seconds >= MIN_RATE_SECONDS

    def describe(self) -> str:
        per_second = f"{self.rate:,.0f}" if self.rate >= 1 else f"{self.rate:.2f}"
        rate = f" ({per_second} rows/s)" if self.rate_known else ""
        took = human_duration(self.elapsed_seconds)
        if self.caught_up:
            return f"caught up: {self.delivered:,} rows in {took}{rate}"
        if self.behind == 0:
            # The rows counted behind are delivered, yet the drain goes on: rows
            # written since the count (it is taken again about once a minute).
            behind = "the rows counted behind are delivered and more keep arriving"
        else:
            behind = "an unknown number" if self.behind is None else f"about {self.behind:,}"
            behind += " behind"
        eta = ""
        if self.behind and self.rate > 0 and self.rate_known:
            eta = f", ETA {dt.timedelta(seconds=round(self.behind / self.rate))}"
        return f"catching up: {self.delivered:,} rows in {took}{rate}, {behind}{eta}"


ProgressCallback = Callable[[DrainProgress], None]


def _count_behind(trigger: Trigger) -> int | None:
    """Rows after the committed checkpoint, if the trigger can count them."""
    try:
        return trigger.rows_behind()
    except DbTriggerError as exc:
        log.debug("could not count the rows behind: %s", exc)
        return None


class Tracker:
    """Progress of one backlog: started when a tick leaves rows pending, ended when idle."""

    def __init__(
        self,
        trigger: Trigger,
        callback: ProgressCallback,
        interval: float,
        first_rows: int,
        *,
        started: float | None = None,
    ) -> None:
        self.trigger = trigger
        self.callback = callback
        self.interval = interval
        #: When the drain began (monotonic): the start of the tick that found it.
        self.started = time.monotonic() if started is None else started
        # The first tick's rows are committed already: the count starts after them.
        self.delivered = first_rows
        self.counted_at = self.started
        self.counted_delivered = first_rows
        self.counted = _count_behind(trigger)
        self.last_report = -float("inf")
        self.reported: int | None = None  # rows at the last line: a stalled drain repeats none
        self.add(0)

    def _behind(self) -> int | None:
        if self.counted is None:
            return None
        return max(0, self.counted - (self.delivered - self.counted_delivered))

    def _report(self, *, caught_up: bool) -> None:
        now = time.monotonic()
        self.last_report, self.reported = now, self.delivered
        self.callback(
            DrainProgress(
                poller=self.trigger.name,
                delivered=self.delivered,
                behind=0 if caught_up else self._behind(),
                elapsed_seconds=now - self.started,
                caught_up=caught_up,
            )
        )

    def add(self, rows: int) -> None:
        self.delivered += rows
        now = time.monotonic()
        if self.counted is not None and now - self.counted_at >= BEHIND_RECOUNT_SECONDS:
            recount = _count_behind(self.trigger)
            if recount is not None:
                self.counted, self.counted_at, self.counted_delivered = recount, now, self.delivered
        if now - self.last_report >= self.interval and self.delivered != self.reported:
            self._report(caught_up=False)

    def finish(self) -> None:
        self._report(caught_up=True)


def log_progress(progress: DrainProgress) -> None:
    """The default progress callback: one INFO line."""
    log.info(
        "%s: %s",
        progress.poller,
        progress.describe(),
        extra={
            "event": "drain_caught_up" if progress.caught_up else "drain_progress",
            "poller": progress.poller,
            "rows": progress.delivered,
            "behind": progress.behind,
            "rows_per_second": round(progress.rate, 1) if progress.rate_known else None,
        },
    )
