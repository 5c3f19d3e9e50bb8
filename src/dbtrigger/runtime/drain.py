"""Draining a poller: tick until a tick finds nothing to do.

"Nothing to do" means the source had no rows after the checkpoint. A tick
that did nothing because another instance holds the lease is not that: the
drain waits for the lease to come free (for at most its ``lease_wait``
budget in all) and otherwise raises
:class:`~dbtrigger.errors.LeaseAcquireError` naming the holder, rather than
returning as if the source were drained. :meth:`PollTrigger.drain
<dbtrigger.runtime.poller.PollTrigger.drain>` is the public face.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Protocol

from dbtrigger.errors import LeaseAcquireError
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.trigger import TickResult
from dbtrigger.state import document as docmod


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
) -> int:
    """Tick ``trigger`` until a tick commits nothing (or ``max_ticks``); the rows
    committed. ``progress(rows_so_far, result)`` is called after every tick."""
    total = 0
    ticks = 0
    deadline = time.monotonic() + lease_wait_seconds
    while max_ticks is None or ticks < max_ticks:
        result = trigger.tick_result(handler)
        ticks += 1
        total += result.rows
        if progress is not None:
            progress(total, result)
        if result.outcome in ("lease_busy", "lost_race"):
            _wait_for_lease(trigger, result, deadline, total)
            continue
        if result.rows == 0:
            break
    return total


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


__all__ = ["Ticks", "drain"]
