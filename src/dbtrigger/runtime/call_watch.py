"""Watching a handler call that may never return: one rule for pollers and queues.

While a handler runs, the trigger's heartbeat thread keeps what it holds alive
(a poller's lease, a queue's claim). A call that never returns would keep it
alive for ever: every other worker waits behind it (a poller) or never gets
the rows (a queue), and nothing above DEBUG says so. So each call is watched
on the same thread (:class:`CallWatch`): once it has run longer than
``warn_after`` - the lease TTL or the visibility timeout, which are sized
above the slowest batch, so past it only the heartbeat keeps the hold - it is
reported at WARNING (``handler_slow``), then at ERROR (``handler_stuck``)
after twice as long, four times, ... (at most an hour apart), naming the
batch and what is held for it. With a ``timeout`` (``handler_timeout_seconds``)
the call is given up when it runs out: :attr:`Watched.time_out` stops the
renewals and cancels the handler; what it returns is not recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.runtime.telemetry import Telemetry

#: The longest pause between two reports of a handler call that still runs.
STUCK_REPEAT_MAX_SECONDS = 3600.0


@dataclass(frozen=True)
class Watched:
    """What a :class:`CallWatch` reports on and gives up: one trigger's hold.

    ``kind``/``unit``: how the message names the trigger and the batch
    (``"poller"``/``"batch"``, ``"queue"``/``"claim"``). ``held``: the clause
    saying what the call holds (``"the lease (token 7) is held for it, ..."``).
    ``fields``: extra structured fields of every report. ``lost``: set once the
    hold is gone (then nothing more is reported). ``time_out(watch, ran)``:
    give the call up (on the heartbeat thread).
    """

    telemetry: Telemetry
    kind: str
    unit: str
    held: str
    warn_after: float
    timeout: float | None
    lost: threading.Event
    time_out: Callable[[CallWatch, float], None]
    fields: Mapping[str, Any] = field(default_factory=dict)


class CallWatch:
    """One handler call under watch: reports it while it runs too long and
    gives it up at ``watched.timeout``. Beats on the heartbeat thread."""

    def __init__(self, watched: Watched, batch_id: str, rows: int) -> None:
        self.watched = watched
        self.batch_id = batch_id
        self.rows = rows
        self.started = time.monotonic()
        #: Seconds into the call of the next report (the first at WARNING).
        self.report_at = watched.warn_after
        self.reports = 0

    def next_in(self) -> float:
        """Seconds from now until this watch has something to do."""
        due = self.report_at
        if self.watched.timeout is not None:
            due = min(due, self.watched.timeout)
        return max(0.0, due - (time.monotonic() - self.started))

    def beat(self) -> float | None:
        w = self.watched
        if w.lost.is_set():
            return None  # the hold is gone already; that was reported
        ran = time.monotonic() - self.started
        if w.timeout is not None and ran >= w.timeout:
            w.time_out(self, ran)
            return None
        if ran >= self.report_at:
            self.report(ran)
            self.reports += 1
            self.report_at = min(2 * ran, ran + STUCK_REPEAT_MAX_SECONDS)
        return self.next_in()

    def report(self, ran: float) -> None:
        w = self.watched
        then = (
            f"it is given up at handler_timeout_seconds={w.timeout:g}"
            if w.timeout is not None
            else "set handler_timeout_seconds to give such a call up"
        )
        w.telemetry.emit(
            "handler_slow" if self.reports == 0 else "handler_stuck",
            "%s %s: the handler call on %s %s (%d rows) has run %.1f s and not returned; %s; %s",
            w.kind,
            w.telemetry.poller,
            w.unit,
            self.batch_id,
            self.rows,
            ran,
            w.held,
            then,
            batch_id=self.batch_id,
            rows=self.rows,
            seconds=round(ran, 1),
            **w.fields,
        )
