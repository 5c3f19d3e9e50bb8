"""Held-back bookkeeping shared by every horizon guard (PostgreSQL and MariaDB/MySQL).

A horizon guard withholds rows while a transaction that may still commit
below them is open. :class:`HeldBackWarner` turns what each fetch reports
into one rate-limited WARNING naming the blocker and one INFO line when the
hold ends, the same for every database (:class:`HorizonActive` gives one to
every horizon guard bound to a source); :func:`greater` is the comparison the
guards use on cursor values that may be None or of mixed types. Its own module
so that the PostgreSQL and the MariaDB/MySQL guards both stand on it instead of
one importing the other.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from dbtrigger.sources.visibility.base import (
    ActiveGuard,
    FetchInfo,
    GuardTarget,
    VisibilityGuard,
    _check_seconds,
)

# The package's logger name, which docs and log configurations refer to.
log = logging.getLogger("dbtrigger.sources.visibility")

#: Held back longer than this, a horizon guard logs a WARNING naming the
#: blocking backend (and repeats it at this interval while it lasts).
DEFAULT_WARN_AFTER_SECONDS = 60.0


@dataclass(frozen=True)
class HorizonGuard(VisibilityGuard):
    """Base of the horizon guards: each warns about the transaction holding rows
    back once that has lasted ``warn_after_seconds``, and makes the one promise
    its :attr:`promise` states (whatever the dialect: one it cannot keep there is
    refused by ``activate``)."""

    warn_after_seconds: float = DEFAULT_WARN_AFTER_SECONDS
    promise: ClassVar[str]

    def __post_init__(self) -> None:
        _check_seconds("warn_after_seconds", self.warn_after_seconds)

    def guarantee(self, dialect: str) -> str:
        del dialect
        return self.promise


class HeldBackWarner:
    """Rate-limits the held-back WARNING and logs (INFO) when the hold ends.

    "Held back" is measured as the *staleness of the horizon*: how long the
    oldest withheld data has been waiting. Under a steady write load the
    horizon trails by about one fetch and keeps moving; only a transaction that
    stays open makes the staleness grow.
    """

    def __init__(self, target: GuardTarget, mode: str, warn_after: float) -> None:
        self.target = target
        self.mode = mode
        self.warn_after = warn_after
        self.warned = False
        self.last_warning = -math.inf

    def observe(self, info: FetchInfo) -> None:
        fields = {
            "source": self.target.source_name,
            "mode": self.mode,
            "held_back_seconds": info.held_back_seconds,
            "blocking_pid": info.blocking_pid,
            "blocking_xact_age_seconds": info.blocking_xact_age_seconds,
            "blocking_detail": info.blocking_detail,
            "horizon": None if info.horizon is None else str(info.horizon),
        }
        if not info.held_back or info.held_back_seconds < self.warn_after:
            if self.warned:
                self.warned = False
                self.last_warning = -math.inf
                log.info(
                    "%s: %s is no longer held back",
                    self.target.source_name,
                    self.mode,
                    extra={"event": "visibility_released", **fields},
                )
            return
        now = time.monotonic()
        if now - self.last_warning < self.warn_after:
            return
        self.last_warning = now
        self.warned = True
        if info.blocking_detail:
            blocker = info.blocking_detail
        elif info.blocking_pid is not None:
            age = info.blocking_xact_age_seconds or 0.0
            blocker = f"backend pid {info.blocking_pid} (transaction open {age:.0f}s)"
        else:
            blocker = "a transaction this role cannot identify"
        log.warning(
            "%s: %s has held rows back for %.0fs, blocked by %s; the poller resumes when it "
            "ends (rows are delayed, not skipped)",
            self.target.source_name,
            self.mode,
            info.held_back_seconds,
            blocker,
            extra={"event": "visibility_held_back", **fields},
        )


class HorizonActive(ActiveGuard):
    """Base of the horizon guards bound to a source: what a fetch reports goes
    through :meth:`_reported`, which bounds the hold's age by what the guard
    saw and warns about a hold that lasts."""

    def __init__(self, guard: HorizonGuard, target: GuardTarget) -> None:
        super().__init__(guard, target)
        self._warner = HeldBackWarner(target, self.mode, guard.warn_after_seconds)
        #: When the last report that found nothing held back was made (the guard's
        #: start before the first): a hold seen now began after it.
        self._clear_at = time.monotonic()

    def _reported(
        self, info: FetchInfo, *, blocker_age_bounds: bool = True, measured: bool = False
    ) -> FetchInfo:
        """``info`` as this fetch's report, its ``held_back_seconds`` no more than
        the hold can have lasted (:func:`hold_age`); logged when rows have been held
        back too long (or no longer are), and kept as :attr:`last_info`.
        ``blocker_age_bounds``: ``blocking_xact_age_seconds`` is the blocking
        transaction's whole age (not, say, the time since a two-phase one was
        prepared), so no hold it causes is older. ``measured``: the guard's own
        ``held_back_seconds`` counts no time it did not look (MariaDB's bound
        truncated to the current second, which the runner's waits are timed by)."""
        now = time.monotonic()
        if info.held_back:
            age = info.blocking_xact_age_seconds if blocker_age_bounds else None
            since_clear = math.inf if measured else now - self._clear_at
            seconds = hold_age(info.held_back_seconds, since_clear, age)
            if seconds != info.held_back_seconds:
                info = replace(info, held_back_seconds=seconds)
        else:
            self._clear_at = now
        self._warner.observe(info)
        self.last_info = info
        return info


def hold_age(staleness: float, since_clear: float, blocker_age: float | None) -> float:
    """How long rows have been held back, as a horizon guard reports it.

    ``staleness`` is what the guard measured (how long its bound has not moved
    past the withheld rows); it counts time the guard did not look, so the
    first held-back fetch after an idle sleep reported the whole sleep
    (``held back for 300s`` of a writer's transaction a few milliseconds old),
    reaching ``status``, the ``visibility_held_back_seconds`` metric, the
    held-back WARNING and the runner's held-back waits. A hold began after the
    last report that found nothing held back (``since_clear`` ago), and no
    earlier than the transaction that causes it (``blocker_age``, when known):
    the age reported is the least of the three, never negative.
    """
    bound = min(staleness, since_clear)
    if blocker_age is not None:
        bound = min(bound, blocker_age)
    return max(0.0, bound)


def greater(a: Any, b: Any) -> bool:
    """``a > b``, treating None as minus infinity and incomparable values as greater."""
    if a is None:
        return False
    if b is None:
        return True
    try:
        return bool(a > b)
    except TypeError:
        return True


__all__ = [
    "DEFAULT_WARN_AFTER_SECONDS",
    "HeldBackWarner",
    "HorizonActive",
    "HorizonGuard",
    "greater",
    "hold_age",
]
