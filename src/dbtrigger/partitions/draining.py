"""Draining a partitioned member: rounds of its partitions until nothing is left.

A round that committed nothing but says ``more`` (a partition stopped with rows
pending) is ticked again at once; otherwise the waits are a poller's drain's
(:class:`~dbtrigger.runtime.drain.DrainWait`): rows the visibility guard held
back and events waiting for a retry. "Drained" concerns the partitions this
member owns when the drain ends: one that moved to another member meanwhile
is that member's to deliver.
"""

from __future__ import annotations

import threading
from typing import Protocol

from dbtrigger.runtime import drain as draining
from dbtrigger.runtime.kernel import Handler


class Member(draining.Ticks, Protocol):
    """What a member's drain asks of it (a :class:`~dbtrigger.partitions.member.PartitionedPoller`):
    a poller's drain's ticks, and its history written before the drain returns."""

    def flush_history(self) -> bool: ...


def drain(
    member: Member,
    handler: Handler,
    *,
    max_ticks: int | None,
    held_wait_seconds: float,
    retry_wait_seconds: float,
    stop: threading.Event | None,
) -> int:
    """Tick ``member``'s rounds until nothing is left to deliver (or ``max_ticks``
    rounds, or ``stop``); the rows committed. History is flushed on the way out."""
    total = ticks = 0
    waits = draining.DrainWait(
        member.name,
        held_seconds=held_wait_seconds,
        retry_seconds=retry_wait_seconds,
        clock=member.clock,
        stop=stop,
    )
    try:
        while (max_ticks is None or ticks < max_ticks) and not waits.stopped:
            result = member.tick_result(handler)
            ticks += 1
            total += result.rows
            if result.rows == 0 and result.more:
                continue
            if not waits.wait_after(result, total):
                break
    finally:
        member.flush_history()
    return total


__all__ = ["Member", "drain"]
