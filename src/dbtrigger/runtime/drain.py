"""Draining a poller: tick until nothing is left to deliver.

"Nothing left" means the source had no rows after the checkpoint and no event
waits for a retry. Three kinds of empty tick are not that, and a drain that
returned on them would tell its caller "drained" with rows still waiting:

* another instance holds the lease: the drain waits for the lease to come
  free (for at most its ``lease_wait`` budget in all) and otherwise raises
  :class:`~dbtrigger.errors.LeaseAcquireError` naming the holder;
* the visibility guard held committed rows back behind a transaction that
  may still commit rows sorting before them: the drain ticks again after
  the runner's short held-back waits (50 ms, doubling up to a second, none
  past the end of a young hold's second) while the hold lasts, for at most
  ``held_wait`` seconds of one hold without a row delivered, and otherwise
  raises :class:`~dbtrigger.errors.FetchError` naming the blocking session.
  A writer's own transactions end within milliseconds; a hold of a minute is
  a transaction someone left open;
* events of the settled window wait for a retry (``ctx.retry``, a
  subscriber's failure): the drain sleeps until the next comes due and
  delivers it, as long as it is due within ``retry_wait`` seconds of the
  last row delivered, and otherwise raises
  :class:`~dbtrigger.errors.HandlerError` saying how many wait, until when,
  and that nothing was skipped. The default backoff (5 s doubling, the fifth
  delivery dead-lettered) fits in the default minute: a drain ends with every
  event settled, the checkpoint past the last row.

A ``stop`` event ends every wait at once (and the drain after the tick in
flight): ``dbtrigger backfill``'s Ctrl-C / SIGTERM, a caller's own thread.

:meth:`PollTrigger.drain <dbtrigger.runtime.poller.PollTrigger.drain>` is
the public face.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dbtrigger.errors import FetchError, HandlerError, LeaseAcquireError
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.pacing import held_back_delay
from dbtrigger.runtime.trigger import TickResult, utc_now
from dbtrigger.state import document as docmod

#: How long one hold of the visibility guard may stop a drain before it raises.
DEFAULT_HELD_WAIT_SECONDS = 60.0
#: How long after its last row a drain waits for an event's retry to come due.
DEFAULT_RETRY_WAIT_SECONDS = 60.0
#: Slept past a retry's due time, so the tick after it finds the event due.
_PAST_DUE_SECONDS = 0.02


class Ticks(Protocol):
    """What a drain asks of the trigger it drives (a :class:`PollTrigger`)."""

    name: str
    clock: Callable[[], dt.datetime]

    def tick_result(self, handler: Handler | None = None) -> TickResult: ...


def drain(
    trigger: Ticks,
    handler: Handler,
    *,
    max_ticks: int | None,
    progress: Callable[[int, TickResult], None] | None,
    lease_wait_seconds: float,
    held_wait_seconds: float = DEFAULT_HELD_WAIT_SECONDS,
    retry_wait_seconds: float = DEFAULT_RETRY_WAIT_SECONDS,
    stop: threading.Event | None = None,
) -> int:
    """Tick ``trigger`` until nothing is left to deliver (or ``max_ticks``, or
    ``stop``); the rows committed. ``progress(rows_so_far, result)`` is called
    after every tick."""
    total = 0
    ticks = 0
    deadline = time.monotonic() + lease_wait_seconds
    waits = DrainWait(
        trigger.name,
        held_seconds=held_wait_seconds,
        retry_seconds=retry_wait_seconds,
        clock=trigger.clock,
        stop=stop,
    )
    while (max_ticks is None or ticks < max_ticks) and not waits.stopped:
        result = trigger.tick_result(handler)
        ticks += 1
        total += result.rows
        if progress is not None:
            progress(total, result)
        if result.outcome in ("lease_busy", "lost_race"):
            _wait_for_lease(trigger, result, deadline, total, waits)
            continue
        if not waits.wait_after(result, total):
            break
    return total


class DrainWait:
    """Whether a drain ticks again after a tick, and the pause before it.

    A tick that delivered rows is ticked again at once. One that delivered
    none is ticked again after a pause while rows wait for it: rows the
    visibility guard held back (the runner's short waits, until one hold has
    lasted ``held_seconds``) and events waiting for a retry (until the next is
    due, when that is within ``retry_seconds`` of the last row delivered).
    Otherwise the drain is done, or raises when rows still wait. ``stop``
    ends a pause at once, and the drain with it (:attr:`stopped`); ``say`` is
    told, once a due time, what a retry wait waits for (a backfill's stderr);
    ``where`` says where waiting events are kept (the error's "nothing was
    skipped").
    """

    def __init__(
        self,
        poller: str,
        *,
        held_seconds: float = DEFAULT_HELD_WAIT_SECONDS,
        retry_seconds: float = DEFAULT_RETRY_WAIT_SECONDS,
        clock: Callable[[], dt.datetime] = utc_now,
        stop: threading.Event | None = None,
        say: Callable[[str], None] | None = None,
        where: str = "the checkpoint stays below the first of them",
    ) -> None:
        self.poller = poller
        self.say = say
        self.where = where
        self.held_seconds = held_seconds
        self.retry_seconds = retry_seconds
        self.clock = clock
        self.stop = stop if stop is not None else threading.Event()
        self._held_since: float | None = None
        self._held_ticks = 0
        self._delivered_at = time.monotonic()
        self._waited_from: dt.datetime | None = None  # the clock when the last retry wait began
        self._said: dt.datetime | None = None  # the due time ``say`` was last told of

    @property
    def stopped(self) -> bool:
        return self.stop.is_set()

    def pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless stopped first; False when stopped."""
        return not self.stop.wait(max(seconds, 0.0))

    def wait_after(self, result: TickResult, total: int) -> bool:
        """True: tick again (after the pause, taken here); False: the drain is
        done, or stopped."""
        if self.stopped:
            return False
        if result.rows:
            self.delivered()
            return True
        if result.held_back:
            return self._held(result, total)
        self._held_since, self._held_ticks = None, 0
        if result.waiting_retries:
            return self.wait_for_retry(result.waiting_retries, result.next_retry_at, total)
        return False

    def delivered(self) -> None:
        """Rows were delivered: a hold ends, and the retry budget starts again."""
        self._held_since, self._held_ticks = None, 0
        self._delivered_at, self._waited_from = time.monotonic(), None

    def _held(self, result: TickResult, total: int) -> bool:
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        if now - self._held_since >= self.held_seconds:
            blocker = (
                f" behind the transaction of session {result.blocking_pid}"
                if result.blocking_pid is not None
                else ""
            )
            raise FetchError(
                f"drain of poller {self.poller!r} stopped after {total} row(s): the visibility "
                f"guard has held the rows after the checkpoint back{blocker} for "
                f"{result.held_back_seconds:.0f}s (a transaction open since before they "
                "committed may still commit rows that sort before them). End that "
                "transaction (or find out why it stays open) and drain again; nothing was "
                "skipped, the rows wait after the checkpoint",
                poller=self.poller,
            )
        self._held_ticks += 1
        return self.pause(held_back_delay(self._held_ticks, 1.0, result.held_back_seconds))

    def wait_for_retry(self, waiting: int, due: dt.datetime | None, total: int) -> bool:
        """``waiting`` events wait for a retry, the next ``due``: sleep until then
        (True: tick again) or raise when that is past the budget; False: stopped."""
        if self.stopped:
            return False
        now = self.clock()
        due_in = (due - now).total_seconds() if due is not None else 0.0
        quiet = time.monotonic() - self._delivered_at
        # A clock that did not move while the drain slept (a test's frozen clock)
        # never brings the retry due: waiting longer cannot help.
        frozen = self._waited_from == now
        self._waited_from = now
        if frozen or quiet + max(due_in, 0.0) > self.retry_seconds:
            raise retries_pending(
                self.poller, total, waiting, due, due_in, self.retry_seconds, where=self.where
            )
        if self.say is not None and due is not None and due != self._said:
            self._said = due
            self.say(
                f"{waiting} event(s) wait for a retry, the next due at "
                f"{docmod.format_time(due)}: waiting {max(due_in, 0.0):.1f}s for it"
            )
        return self.pause(max(due_in, 0.0) + _PAST_DUE_SECONDS)


def retries_pending(
    poller: str,
    total: int,
    waiting: int,
    due: dt.datetime | None,
    due_in: float,
    budget: float,
    *,
    where: str,
) -> HandlerError:
    """The error of a drain that will not wait for the next retry: how many
    events wait, until when, and that nothing was skipped (``where`` they wait)."""
    when = (
        f", the next due at {docmod.format_time(due)} (in {max(due_in, 0.0):.1f}s)"
        if due is not None
        else ""
    )
    return HandlerError(
        f"drain of {poller!r} stopped after {total} row(s): {waiting} event(s) wait for a "
        f"retry{when}, later than the drain waits (retry_wait_seconds={budget:g} after the "
        f"last row delivered). Nothing was skipped: {where}, and they are delivered when "
        "due (by a worker, a later tick, or a drain then); pass retry_wait_seconds= to wait "
        "for them",
        poller=poller,
        rows=total,
        waiting_retries=waiting,
        next_retry_at=due.isoformat() if due is not None else None,
    )


def _wait_for_lease(
    trigger: Ticks, result: TickResult, deadline: float, total: int, waits: DrainWait
) -> None:
    now = trigger.clock()
    wait = (result.lease_until - now).total_seconds() if result.lease_until else 0.05
    wait = max(wait, 0.0) + 0.01
    if time.monotonic() + wait > deadline:
        holder = result.holder or "another instance"
        until = f" until {docmod.format_time(result.lease_until)}" if result.lease_until else ""
        raise LeaseAcquireError(
            f"drain of poller {trigger.name!r} stopped after {total} row(s): the lease is "
            f"held by {holder}{until}, which is draining it; pass lease_wait_seconds= "
            "to wait for it",
            poller=trigger.name,
            holder=result.holder,
        )
    waits.pause(wait)


__all__ = [
    "DEFAULT_HELD_WAIT_SECONDS",
    "DEFAULT_RETRY_WAIT_SECONDS",
    "DrainWait",
    "Ticks",
    "drain",
    "retries_pending",
]
