"""Saying that events cannot settle (``poison_event``), without a flood.

Without a dead-letter sink an event that used up ``max_attempts`` stays in the
window and is handed out again after each backoff (up to 12 times an hour with
the default one, at every tick with ``retry_delay_seconds=0``), to be failed
again. It is said at ERROR once, on the delivery that made it poison; after
that, the deliveries that find such events again say so in one WARNING record
(the same ``poison_event`` name, ``again`` true, how many ``events``) at most
once per :data:`POISON_REMINDER` for the poller. ``dbtrigger status`` and
``window_blocked`` say what pins the checkpoint meanwhile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence

from dbtrigger.events import RowChange
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state.fanout import Decision, Fate

#: How often events already said to be poison are said to be poison still.
POISON_REMINDER = dt.timedelta(minutes=15)


class PoisonReport:
    """One poller's ``poison_event`` records (shared by its partitions' deliveries)."""

    def __init__(
        self, telemetry: Telemetry, clock: Callable[[], dt.datetime], max_attempts: int
    ) -> None:
        self.telemetry = telemetry
        self.clock = clock
        self.max_attempts = max_attempts
        self._reminded: dt.datetime | None = None

    def again(self, ctx: BatchContext, ids: Sequence[str]) -> None:
        """``ids``: events of this batch said to be poison on an earlier delivery."""
        if not ids:
            return
        now = self.clock()
        if self._reminded is not None and now - self._reminded < POISON_REMINDER:
            return
        self._reminded = now
        self.telemetry.emit(
            "poison_event_again",
            "%d event(s) already reported as poison (the first %s) were handed out again and "
            "still cannot settle: configure a dead-letter (quarantine) sink or settle them by "
            "hand; said again at most every %d minutes",
            len(ids),
            ids[0],
            POISON_REMINDER.total_seconds() // 60,
            batch_id=ctx.batch_id,
            event_id=ids[0],
            events=len(ids),
            again=True,
        )

    def fanout(
        self, ctx: BatchContext, by_id: Mapping[str, RowChange], decisions: Mapping[str, Decision]
    ) -> None:
        """Fan-out: who left each event of a batch unsettled for good, and who is gone."""
        emit = self.telemetry.emit
        again = [
            i
            for i, d in decisions.items()
            if d.stuck and min(d.owed[name] for name in d.stuck) > self.max_attempts
        ]
        self.again(ctx, again)
        for i, d in decisions.items():
            if d.gone:
                emit(
                    "subscriber_gone",
                    "event %s was owed to subscriber(s) %s, which are no longer configured: "
                    "they count as unsubscribed",
                    i,
                    ", ".join(d.gone),
                    batch_id=ctx.batch_id,
                    event_id=i,
                )
            if d.fate is not Fate.PENDING or i in again:
                continue
            if d.stuck or not d.tally.accepted + d.tally.failed:
                who = ", ".join(d.stuck or d.gone)
                emit(
                    "poison_event",
                    "event %s (pk %s) cannot settle: %s; configure a dead-letter (quarantine) "
                    "sink or settle it by hand: it holds the checkpoint back",
                    i,
                    dict(by_id[i].pk),
                    f"subscriber(s) {who} failed it on all {self.max_attempts} attempts"
                    if d.stuck
                    else f"every subscriber it is owed to ({who}) is gone",
                    batch_id=ctx.batch_id,
                    event_id=i,
                )
