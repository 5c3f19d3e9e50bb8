"""Draining a trigger: tick until nothing is left to deliver.

"Nothing left" means the source had no rows after the checkpoint and no event
waits for a retry. Four kinds of empty tick are not that, and a drain that
returned on them would tell its caller "drained" with rows still waiting:

* another instance holds the lease: the drain waits for the lease to come
  free (for at most its ``lease_wait`` budget in all) and otherwise raises
  :class:`~dbtrigger.errors.LeaseAcquireError` naming the holder;
* a partitioned member's round found a partition it now owns still leased by
  its previous owner, a live member finishing its batch in flight (a
  handover): the drain ticks again every 0.1 s until that lease is released,
  for at most ``handover_wait`` seconds of one handover, and otherwise raises
  :class:`~dbtrigger.errors.LeaseAcquireError` naming the partitions;
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

A ``stop`` event ends every wait at once, and the drain after the batch in
flight (a call given up at the handler timeout is let go): ``dbtrigger
backfill``'s Ctrl-C / SIGTERM, a caller's own thread.

One loop, :func:`tick_until_drained`, drains every trigger; what differs is
said by its arguments: :meth:`PollTrigger.drain
<dbtrigger.runtime.poller.PollTrigger.drain>` waits for its lease (a
:class:`LeaseWait`) and reports progress; a partitioned member's rounds have no
lease of their own (a :class:`HandoverWait` waits for its partitions'); a
queue counts rows claimed as delivered and takes a claim that came back short
for the end (it has no visibility guard); ``dbtrigger backfill`` ticks with
retries of its own. The faces flush their history on the way out.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from dbtrigger.errors import FetchError, HandlerError, LeaseAcquireError
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.pacing import held_back_delay
from dbtrigger.runtime.trigger import TickResult, utc_now
from dbtrigger.sources.base import VisibilityReport
from dbtrigger.state import document as docmod

#: How long one hold of the visibility guard may stop a drain before it raises.
DEFAULT_HELD_WAIT_SECONDS = 60.0
#: How long after its last row a drain waits for an event's retry to come due.
DEFAULT_RETRY_WAIT_SECONDS = 60.0
#: How long a member's drain waits for a previous owner's batch in flight on a
#: partition it now owns (a handover) before it raises.
DEFAULT_HANDOVER_WAIT_SECONDS = 60.0
#: Slept past a retry's due time, so the tick after it finds the event due.
_PAST_DUE_SECONDS = 0.02
#: Between a member's rounds while a handover lasts (its holder releases the lease
#: as its batch ends, long before the lease's own end).
_HANDOVER_POLL_SECONDS = 0.1


class DrainTick(VisibilityReport, Protocol):
    """What the drain loop reads of a tick's result (a poller's, a member's round,
    a queue's claims): what its fetch's visibility guard did, and these."""

    @property
    def rows(self) -> int: ...

    @property
    def more(self) -> bool: ...

    @property
    def waiting_retries(self) -> int: ...

    @property
    def next_retry_at(self) -> dt.datetime | None: ...


R = TypeVar("R", bound=DrainTick)


def rows_delivered(result: DrainTick) -> bool:
    """A poller's tick delivered when it committed rows."""
    return result.rows > 0


def more_or_delivered(result: DrainTick) -> bool:
    """A poller ticks again at once after rows (only an empty tick says nothing is
    left) and after a round that says ``more`` (a partition taken over mid-tick)."""
    return result.more or result.rows > 0


def tick_until_drained(
    tick: Callable[[], R],
    waits: DrainWait,
    *,
    max_ticks: int | None = None,
    progress: Callable[[int, R], None] | None = None,
    busy: Callable[[R, int], bool] | None = None,
    delivered: Callable[[R], bool] = rows_delivered,
    again: Callable[[R], bool] = more_or_delivered,
) -> int:
    """The drain loop of every trigger: ``tick()`` until nothing is left to deliver
    (or ``max_ticks``, or ``waits.stop``); the rows completed.

    After each tick: ``progress(rows_so_far, result)``; ``busy(result, rows)``
    True when the tick found the lease held elsewhere and waited for it (a
    poller's :class:`LeaseWait`); ``delivered(result)`` ends a hold and starts
    the retry budget again; ``again(result)`` ticks again at once. Otherwise
    ``waits`` pauses for rows held back or a retry coming due, or the drain is
    done. A poller reads its ticks with the defaults; a queue passes its own
    (rows claimed are delivered; a claim that came back short is the end).
    """
    total = ticks = 0
    while (max_ticks is None or ticks < max_ticks) and not waits.stopped:
        result = tick()
        ticks += 1
        total += result.rows
        if progress is not None:
            progress(total, result)
        if busy is not None and busy(result, total):
            continue
        if delivered(result):
            waits.delivered()
        if again(result):
            continue
        if not waits.wait_for_rows(result, total):
            break
    return total


class Ticks(Protocol):
    """What :func:`drain` asks of the trigger it drives (a :class:`PollTrigger`,
    a partitioned member)."""

    name: str
    clock: Callable[[], dt.datetime]

    def tick_result(
        self, handler: Handler | None = None, *, should_stop: Callable[[], bool] | None = None
    ) -> TickResult: ...


def drain(
    trigger: Ticks,
    handler: Handler,
    *,
    max_ticks: int | None,
    progress: Callable[[int, TickResult], None] | None,
    lease_wait_seconds: float | None,
    held_wait_seconds: float = DEFAULT_HELD_WAIT_SECONDS,
    retry_wait_seconds: float = DEFAULT_RETRY_WAIT_SECONDS,
    stop: threading.Event | None = None,
    handover_wait_seconds: float = DEFAULT_HANDOVER_WAIT_SECONDS,
) -> int:
    """Tick ``trigger`` until nothing is left to deliver (or ``max_ticks``, or
    ``stop``); the rows committed. ``progress(rows_so_far, result)`` is called
    after every tick. ``lease_wait_seconds`` None: the trigger has no lease of its
    own to wait for (a member's partitions are leased one by one in its rounds,
    and ``handover_wait_seconds`` bounds its :class:`HandoverWait`).
    With a ``stop``, each tick asks it between batches, and a call given up at the
    handler timeout is let go once it is set (:mod:`dbtrigger.runtime.let_go`);
    without one, calls run inline on the caller's thread as a plain tick's do."""
    waits = DrainWait(
        trigger.name,
        held_seconds=held_wait_seconds,
        retry_seconds=retry_wait_seconds,
        clock=trigger.clock,
        stop=stop,
    )
    busy: Callable[[TickResult, int], bool] = (
        LeaseWait(trigger, lease_wait_seconds, waits)
        if lease_wait_seconds is not None
        else HandoverWait(trigger.name, handover_wait_seconds, waits)
    )

    def tick() -> TickResult:
        if stop is None:
            return trigger.tick_result(handler)
        return trigger.tick_result(handler, should_stop=stop.is_set)

    return tick_until_drained(
        tick,
        waits,
        max_ticks=max_ticks,
        progress=progress,
        busy=busy,
    )


class LeaseWait:
    """A poller's drain waits for its lease held by another instance: until the
    holder's lease ends, for at most ``seconds`` in all since the drain began,
    and otherwise raises :class:`~dbtrigger.errors.LeaseAcquireError` naming it."""

    def __init__(self, trigger: Ticks, seconds: float, waits: DrainWait) -> None:
        self.trigger = trigger
        self.waits = waits
        self.deadline = time.monotonic() + seconds

    def __call__(self, result: TickResult, total: int) -> bool:
        """True: the tick found the lease held elsewhere and the wait is over."""
        if result.outcome not in ("lease_busy", "lost_race"):
            return False
        name = self.trigger.name
        now = self.trigger.clock()
        wait = (result.lease_until - now).total_seconds() if result.lease_until else 0.05
        wait = max(wait, 0.0) + 0.01
        if time.monotonic() + wait > self.deadline:
            holder = result.holder or "another instance"
            until = f" until {docmod.format_time(result.lease_until)}" if result.lease_until else ""
            raise LeaseAcquireError(
                f"drain of poller {name!r} stopped after {total} row(s): the lease is "
                f"held by {holder}{until}, which is draining it; pass lease_wait_seconds= "
                "to wait for it",
                poller=name,
                holder=result.holder,
            )
        self.waits.pause(wait)
        return True


class HandoverWait:
    """A member's drain waits for the partitions it owns whose lease is still held
    by their previous owner, a live member finishing its batch in flight (it
    releases the lease as the batch ends): a round delivering nothing then is not
    the end. The drain ticks again every :data:`_HANDOVER_POLL_SECONDS` for at
    most ``seconds`` of one handover, and otherwise raises
    :class:`~dbtrigger.errors.LeaseAcquireError` naming the partitions, rather
    than return "drained" with their rows waiting."""

    def __init__(self, poller: str, seconds: float, waits: DrainWait) -> None:
        self.poller = poller
        self.seconds = seconds
        self.waits = waits
        self._since: float | None = None  # when (monotonic) this handover was first seen

    def __call__(self, result: TickResult, total: int) -> bool:
        """True: the round found only partitions handed over still busy, and paused."""
        if not result.handover:
            self._since = None
            return False
        if result.rows or result.more:
            return False  # ticked again at once anyway
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since + _HANDOVER_POLL_SECONDS > self.seconds:
            raise LeaseAcquireError(
                f"drain of poller {self.poller!r} stopped after {total} row(s): partition(s) "
                f"{', '.join(result.handover)}, which this member now owns, are still leased "
                f"by their previous owner after {now - self._since:.1f}s, finishing a batch "
                "(a slow handler; the partition moved to this member meanwhile). Nothing was "
                "skipped: their rows wait after their checkpoints; drain again once that "
                "batch ends, or pass handover_wait_seconds= to wait longer",
                poller=self.poller,
            )
        self.waits.pause(_HANDOVER_POLL_SECONDS)
        return True


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

    def wait_after(self, result: DrainTick, total: int) -> bool:
        """One tick read alone, as a poller's drain reads it: True: tick again
        (after the pause, taken here); False: the drain is done, or stopped."""
        if self.stopped:
            return False
        if result.rows:
            self.delivered()
            return True
        return self.wait_for_rows(result, total)

    def wait_for_rows(self, result: DrainTick, total: int) -> bool:
        """A tick that delivered nothing: pause while rows wait for the drain (held
        back, a retry coming due) and True; False: nothing waits, or stopped."""
        if self.stopped:
            return False
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

    def _held(self, result: DrainTick, total: int) -> bool:
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


__all__ = [
    "DEFAULT_HANDOVER_WAIT_SECONDS",
    "DEFAULT_HELD_WAIT_SECONDS",
    "DEFAULT_RETRY_WAIT_SECONDS",
    "DrainTick",
    "DrainWait",
    "HandoverWait",
    "LeaseWait",
    "Ticks",
    "drain",
    "more_or_delivered",
    "retries_pending",
    "rows_delivered",
    "tick_until_drained",
]
