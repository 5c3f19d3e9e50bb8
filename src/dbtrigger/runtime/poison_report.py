"""Saying that events cannot settle (``poison_event``), without a flood.

Without a dead-letter sink an event that used up ``max_attempts`` stays in the
window and is handed out again after each backoff (up to 12 times an hour with
the default one, at every tick with ``retry_delay_seconds=0``), to be failed
again. It is said at ERROR once, on the delivery that made it poison; after
that, the deliveries that find such events again say so in one WARNING record
(the same ``poison_event`` name, ``again`` true, how many ``events``) at most
once per :data:`POISON_REMINDER` for the poller. ``dbtrigger status`` and
``window_blocked`` say what pins the checkpoint meanwhile.

A poison batch (``poison_batch``: a batch that failed ``max_attempts`` times with
no sink, or looks like an outage by then) is retried for ever too, by whichever
worker takes it. It is said at ERROR on the attempt that made it so (the attempt
count is the state document's, so one worker says it), and again when the batch
changed: its rows are not the ones the failure record describes (rows came or
went), or the verdict on it did (an outage that now looks like poison). The
attempts after that say so in one WARNING record (the same ``poison_batch``
name, the same fields, ``again`` true) at most once per :data:`POISON_REMINDER`
for the batch, in each worker.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dbtrigger.events import RowChange
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state.document import digest_event_ids
from dbtrigger.state.fanout import Decision, Fate

#: How often events already said to be poison are said to be poison still.
POISON_REMINDER = dt.timedelta(minutes=15)

#: How many poison batches (by id) a poller remembers what it said of.
_REMEMBERED = 64


class PoisonReport:
    """One poller's ``poison_event`` and ``poison_batch`` records (shared by its
    partitions' deliveries)."""

    def __init__(
        self, telemetry: Telemetry, clock: Callable[[], dt.datetime], max_attempts: int
    ) -> None:
        self.telemetry = telemetry
        self.clock = clock
        self.max_attempts = max_attempts
        #: When each reminder was last said: "" for the poller's poison events,
        #: a batch id for a poison batch.
        self._reminded: dict[str, dt.datetime] = {}
        #: A poison batch's id -> the verdict last said of it (``poison``, ``outage``).
        self._verdicts: dict[str, str] = {}

    def _due(self, key: str, now: dt.datetime) -> bool:
        """Is the reminder under ``key`` due (none said for :data:`POISON_REMINDER`)?
        If so it counts as said now."""
        last = self._reminded.get(key)
        if last is not None and now - last < POISON_REMINDER:
            return False
        self._said(key, now)
        return True

    def _said(self, key: str, now: dt.datetime) -> None:
        self._reminded.pop(key, None)
        self._reminded[key] = now
        if len(self._reminded) > _REMEMBERED:  # the oldest first (insertion order)
            del self._reminded[next(iter(self._reminded))]

    def again(self, ctx: BatchContext, ids: Sequence[str]) -> None:
        """``ids``: events of this batch said to be poison on an earlier delivery."""
        if not ids:
            return
        if not self._due("", self.clock()):
            return
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

    def batch(
        self,
        ctx: BatchContext,
        events: Sequence[RowChange],
        verdict: str,
        message: str,
        *args: object,
        **fields: Any,
    ) -> None:
        """Say ``poison_batch`` (``message % args``, ``fields``) of a failed attempt
        of a poison batch: at ERROR when it is news (see the module docstring),
        else as the reminder when one is due. ``verdict`` names what it says
        (``poison``, ``outage``): another verdict on the same batch is news."""
        now = self.clock()
        changed = ctx.failed_digest is not None and ctx.failed_digest != digest_event_ids(
            e.event_id for e in events
        )
        before = self._verdicts.pop(ctx.batch_id, None)
        self._verdicts[ctx.batch_id] = verdict
        if len(self._verdicts) > _REMEMBERED:
            del self._verdicts[next(iter(self._verdicts))]
        key = f"batch {ctx.batch_id}"
        if ctx.attempt <= self.max_attempts or changed or before not in (None, verdict):
            self._said(key, now)
            self.telemetry.emit("poison_batch", message, *args, **fields)
            return
        if not self._due(key, now):
            return
        self.telemetry.emit(
            "poison_batch_again",
            message + " (said before; said again at most every %d minutes)",
            *args,
            POISON_REMINDER.total_seconds() // 60,
            again=True,
            **fields,
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
