"""How long a worker waits after a tick (:class:`~dbtrigger.runtime.runner.Runner`),
and what it asks of a wake-up hint that may end or shorten that wait.

At once while batches come back full and after any tick that delivered rows;
soon after a tick whose rows the visibility guard held back; after a failing
tick, a backoff that doubles up to a ceiling; otherwise the interval. The
pure rules are here, table-tested; the runner keeps the counts they take.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, runtime_checkable

#: Default ceiling of the backoff between failing ticks.
DEFAULT_MAX_BACKOFF_SECONDS = 300.0
#: The first wait after a tick whose rows the visibility guard held back.
HELD_BACK_FIRST_SECONDS = 0.05
#: A hold younger than this ends by itself soon, however long the guard's
#: report says nothing moved: a writer's own transaction ends within
#: milliseconds, and the MariaDB horizon's default ``precision=0`` truncates
#: a timestamp bound to the whole second, so a busy table's rows of the
#: current second wait until the clock passes it (up to one second) however
#: short the transactions.
SHORT_HOLD_SECONDS = 1.0


def held_back_delay(held_ticks: int, interval: float, held_seconds: float | None = None) -> float:
    """Seconds to wait after the ``held_ticks``-th tick in a row whose rows the
    visibility guard held back: from :data:`HELD_BACK_FIRST_SECONDS`, doubling,
    never more than the interval; and, given the guard's ``held_back_seconds``
    (``held_seconds``), no longer than

    * the rest of the hold's first second (:data:`SHORT_HOLD_SECONDS`) while
      it is younger: a steady writer on MariaDB keeps its rows held by the
      truncated bound for up to that second, and the doubling alone woke 0.3-0.4 s
      past it on average (half of the ~1 s p50 at 200 rows/s);
    * as long as it has lasted beyond that second once older, so that its
      waits grow from the first again rather than jumping to the count's
      doubling (the ticks of the young second count too).

    The age only ever shortens the doubling: it is an upper bound (the guards
    bound it by their last report that found nothing held and by the blocking
    transaction's age, :func:`~dbtrigger.sources.visibility.held_back.hold_age`),
    so a hold reported old may still end at once.

    Why not the interval: the rows are committed and only wait for transactions
    that were open at the guard's probe, which for a writer's own transaction
    end within milliseconds; after the interval they would wait a whole
    interval more (a third of the rows of a busy MariaDB table did). A long
    transaction costs a few more polls in its first seconds, then the ordinary
    interval.
    """
    wait = HELD_BACK_FIRST_SECONDS * 2 ** min(held_ticks - 1, 30)
    if held_seconds is not None:
        if held_seconds < SHORT_HOLD_SECONDS:
            wait = min(wait, SHORT_HOLD_SECONDS - held_seconds)
        else:
            wait = min(wait, held_seconds - SHORT_HOLD_SECONDS)
    return float(min(interval, max(HELD_BACK_FIRST_SECONDS, wait)))


@runtime_checkable
class WakeHint(Protocol):
    """What a :class:`Runner` asks of a wake-up hint (:mod:`dbtrigger.wakeup`).

    ``attach`` is called once with the trigger the runner drives (a hint may
    refuse it with a :class:`~dbtrigger.errors.ConfigurationError`); ``wait``
    is the idle sleep after a tick that delivered nothing, and must return by
    ``seconds`` at the latest (earlier when ``stop`` is set);
    ``idle_ticks`` is how many ticks in a row found nothing (1 right after
    activity), or None while the worker has delivered nothing since it
    started. ``close`` stops whatever the hint runs (idempotent). A hint that
    also has ``delay`` (:class:`ShortensWait`) is asked that instead of ``wait``,
    one that has ``woken`` (:class:`EndsWait`) ends the trigger's own wait; a
    hint with neither sleeps in the trigger's place.
    """

    def attach(self, trigger: Any) -> None: ...

    def wait(self, seconds: float, stop: threading.Event, *, idle_ticks: int | None) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class ShortensWait(Protocol):
    """A wake-up hint whose whole effect is a shorter idle sleep
    (:class:`~dbtrigger.wakeup.AdaptivePolling`).

    The runner asks it how long, then sleeps through the trigger's own
    ``wait_for_work``: a hint that slept by itself instead skipped what ends
    that wait early (a queue's ``LISTEN``, a partition member gaining
    partitions or waiting out a handover), and so was worse than no hint.
    """

    def delay(self, seconds: float, idle_ticks: int | None) -> float: ...


@runtime_checkable
class EndsWait(Protocol):
    """A wake-up hint that ends the trigger's own wait early
    (:class:`~dbtrigger.wakeup.NotifyHint`).

    ``woken`` is the event the hint sets when work may be there (whatever
    sets it started by the call). The runner sleeps through the trigger's
    own ``wait_for_work`` with a stop that this event sets too
    (:class:`StopOrWoken`), and clears it once the sleep is over. Sleeping in
    the trigger's place instead skipped what ends the trigger's wait (a
    queue's own ``LISTEN``, a partition member gaining partitions).
    """

    def woken(self) -> threading.Event: ...


#: How often a wait that blocks on a hint's event looks at the stop event.
STOP_POLL_SECONDS = 0.2


class StopOrWoken(threading.Event):
    """Set when ``stop`` is or when ``woken`` is: the one stop a trigger's
    ``wait_for_work`` takes, while a hint (:class:`EndsWait`) may end it too.

    ``threading`` waits on one event at a time, and ``stop`` is anyone's (a
    shared stop of several runners, set by a signal relay). So :meth:`wait`
    blocks on ``woken``, which the hint's listener sets (a notification ends
    the wait at once), and looks at ``stop`` every :data:`STOP_POLL_SECONDS`,
    as a listening wait always did: no thread, no spinning. :meth:`set` sets
    ``stop`` (it is a stop); the flag of its own is never used.
    """

    def __init__(self, stop: threading.Event, woken: threading.Event) -> None:
        super().__init__()
        self.stop, self.woken = stop, woken

    def is_set(self) -> bool:
        return self.stop.is_set() or self.woken.is_set()

    def set(self) -> None:
        self.stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stop.is_set():
            left = STOP_POLL_SECONDS
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0:
                    return self.woken.is_set()
            if self.woken.wait(left):
                return True
        return True


def shortened(hint: ShortensWait, seconds: float, idle_ticks: int | None) -> float:
    """The hint's wait, never longer than ``seconds``: a hint may only end a sleep
    sooner (what polling alone waits is the bound, whatever the hint says)."""
    return float(min(seconds, max(0.0, hint.delay(seconds, idle_ticks))))


def backoff_delay(failures: int, interval: float, cap: float) -> float:
    """Seconds to wait after ``failures`` failing ticks in a row: doubling, capped.

    Starts at the interval (one second for an interval of 0, so ``--interval
    0`` does not spin against a database that is down) and never exceeds ``cap``.
    """
    base = interval if interval > 0 else 1.0
    return float(min(cap, base * 2 ** min(failures - 1, 30)))


def isolated_failure(last: Any) -> bool:
    """A failed tick of a partitioned member whose other partitions work: the
    failing partitions back off on their own (``TickResult.failing_partitions``),
    so the worker's next round comes at its usual pace, not after its backoff."""
    if last is None or last.outcome != "failed":
        return False
    return 0 < len(getattr(last, "failing_partitions", ())) < (last.partitions or 0)


__all__ = [
    "DEFAULT_MAX_BACKOFF_SECONDS",
    "HELD_BACK_FIRST_SECONDS",
    "SHORT_HOLD_SECONDS",
    "STOP_POLL_SECONDS",
    "EndsWait",
    "ShortensWait",
    "StopOrWoken",
    "WakeHint",
    "backoff_delay",
    "held_back_delay",
    "isolated_failure",
    "shortened",
]
