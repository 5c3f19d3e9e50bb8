"""Draining a poller: tick until a tick finds nothing to do.

"Nothing to do" means the source had no rows after the checkpoint. Two kinds
of empty tick are not that, and a drain that returned on them would tell its
caller "drained" with rows still waiting:

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
  a transaction someone left open.

:meth:`PollTrigger.drain <dbtrigger.runtime.poller.PollTrigger.drain>` is
the public face.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Protocol

from dbtrigger.errors import FetchError, LeaseAcquireError
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.pacing import held_back_delay
from dbtrigger.runtime.trigger import TickResult
from dbtrigger.state import document as docmod

#: How long one hold of the visibility guard may stop a drain before it raises.
DEFAULT_HELD_WAIT_SECONDS = 60.0


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
) -> int:
    """Tick ``trigger`` until a tick commits nothing (or ``max_ticks``); the rows
    committed. ``progress(rows_so_far, result)`` is called after every tick."""
    total = 0
    ticks = 0
    deadline = time.monotonic() + lease_wait_seconds
    held = HeldWait(trigger.name, held_wait_seconds)
    while max_ticks is None or ticks < max_ticks:
        result = trigger.tick_result(handler)
        ticks += 1
        total += result.rows
        if progress is not None:
            progress(total, result)
        if result.outcome in ("lease_busy", "lost_race"):
            _wait_for_lease(trigger, result, deadline, total)
            continue
        if not held.wait_after(result, total):
            break
    return total


class HeldWait:
    """Whether a drain ticks again after an empty tick, and the pause before it.

    Rows delivered end a hold; an empty tick whose rows the guard held back
    waits (:func:`~dbtrigger.runtime.pacing.held_back_delay`, at most a second)
    and asks for another tick, until one hold has lasted ``seconds``.
    """

    def __init__(self, poller: str, seconds: float) -> None:
        self.poller = poller
        self.seconds = seconds
        self._since: float | None = None
        self._ticks = 0

    def wait_after(self, result: TickResult, total: int) -> bool:
        """True: tick again (after the pause, taken here); False: the drain is done."""
        if result.rows:
            self._since, self._ticks = None, 0
            return True
        if not result.held_back:
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since >= self.seconds:
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
                "skipped, the rows wait after the checkpoint"
            )
        self._ticks += 1
        time.sleep(held_back_delay(self._ticks, 1.0, result.held_back_seconds))
        return True


def _wait_for_lease(trigger: Ticks, result: TickResult, deadline: float, total: int) -> None:
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
    time.sleep(wait)


__all__ = ["DEFAULT_HELD_WAIT_SECONDS", "HeldWait", "Ticks", "drain"]
