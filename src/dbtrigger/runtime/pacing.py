"""How long a worker waits after a tick (:class:`~dbtrigger.runtime.runner.Runner`).

At once while batches come back full and after any tick that delivered rows;
soon after a tick whose rows the visibility guard held back; after a failing
tick, a backoff that doubles up to a ceiling; otherwise the interval. The
pure rules are here, table-tested; the runner keeps the counts they take.
"""

from __future__ import annotations

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
    "backoff_delay",
    "held_back_delay",
]
