"""How long a worker waits after a tick (:class:`~dbtrigger.runtime.runner.Runner`),
and what it asks of a wake-up hint that may end or shorten that wait.

At once while batches come back full and after any tick that delivered rows;
soon after a tick whose rows the visibility guard held back; after a failing
tick, a backoff that doubles up to a ceiling; otherwise the interval. The
pure rules are here, table-tested; the runner keeps the counts they take.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

#: Default ceiling of the backoff between failing ticks.
DEFAULT_MAX_BACKOFF_SECONDS = 300.0
#: The first wait after a tick whose rows the visibility guard held back.
HELD_BACK_FIRST_SECONDS = 0.05


def held_back_delay(held_ticks: int, interval: float) -> float:
    """Seconds to wait after the ``held_ticks``-th tick in a row whose rows the
    visibility guard held back: from :data:`HELD_BACK_FIRST_SECONDS`, doubling,
    never more than the interval.

    Why not the interval: the rows are committed and only wait for transactions
    that were open at the guard's probe, which for a writer's own transaction
    end within milliseconds; after the interval they would wait a whole
    interval more (a third of the rows of a busy MariaDB table did). A long
    transaction costs a few more polls in its first seconds, then the ordinary
    interval.
    """
    return float(min(interval, HELD_BACK_FIRST_SECONDS * 2 ** min(held_ticks - 1, 30)))


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
    also has ``delay`` (:class:`ShortensWait`) is asked that instead of ``wait``.
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


__all__ = [
    "DEFAULT_MAX_BACKOFF_SECONDS",
    "HELD_BACK_FIRST_SECONDS",
    "ShortensWait",
    "WakeHint",
    "backoff_delay",
    "held_back_delay",
    "shortened",
]
