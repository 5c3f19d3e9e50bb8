"""How often a worker repeats that nothing is happening.

An idle worker ticks every few seconds, and a standby whose lease another
instance holds does too. A line per tick forever buries everything else in
the log, but an operator on call still wants to know, from the log alone,
that the worker is alive and where it stands. So a quiet state (idle, held
back by the visibility guard, waiting for retries, the lease held elsewhere)
is said at INFO when it begins, at DEBUG on the ticks that repeat it, and
again at INFO every ``every`` seconds as "still ...", with how long it has
lasted. Any change (rows delivered, another holder, a failure) starts over.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from dbtrigger.durations import human_duration

#: A worker's committed line when batches came back full (``dbtrigger run``), and
#: what it says instead on the tick a stop let finish.
MORE_AT_ONCE = "; more pending, ticking again at once"
MORE_ON_STOP = "; more pending, left for the next start: stopping"

#: Default time between two "still idle" lines.
DEFAULT_STILL_QUIET_SECONDS = 300.0


class Summarised(Protocol):
    """A tick's result in its own words (a :class:`~dbtrigger.runtime.trigger.TickReport`)."""

    def summary(self, interval: float | None) -> tuple[str, dict[str, Any]]: ...


class QuietCadence:
    """The level of each tick's line while nothing changes (see the module doc)."""

    def __init__(
        self,
        every: float = DEFAULT_STILL_QUIET_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every = every
        self.clock = clock
        self._key: Hashable | None = None
        self._since = 0.0
        self._said = 0.0

    def level(self, key: Hashable | None) -> tuple[int, float | None]:
        """``(level, quiet for)`` of the line of a tick in state ``key``.

        ``key`` None: not quiet (rows moved, or a failure): INFO, and the next
        quiet tick is news again. ``quiet for`` is set on a repeated "still"
        line: seconds since the quiet state began.
        """
        now = self.clock()
        if key is None or key != self._key:
            self._key, self._since, self._said = key, now, now
            return logging.INFO, None
        if now - self._said >= self.every:
            self._said = now
            return logging.INFO, now - self._since
        return logging.DEBUG, None

    def line(
        self, result: Summarised, interval: float | None, *, stopping: bool = False
    ) -> tuple[int, str, dict[str, Any]]:
        """``(level, text, fields)`` of a tick's line: the result's own words
        (``interval``: the sleep that follows, None for a timer firing), said
        as ``still ... (for 12m)`` when a quiet state is repeated at INFO.
        ``stopping``: a stop was asked for, so no tick follows, whatever the
        words said would come next ("ticking again at once", "next tick in 5s")."""
        text, fields = result.summary(interval)
        if stopping:
            text = text.replace(MORE_AT_ONCE, MORE_ON_STOP)
            text = re.sub(r"; next tick in [0-9.e+-]+s", "; stopping", text)
        level, quiet_for = self.level(quiet_key(result))
        if quiet_for is not None:
            text = f"still {text} (for {for_how_long(quiet_for)})"
            fields["quiet_seconds"] = round(quiet_for, 1)
        return level, text, fields


def quiet_key(result: object) -> Hashable | None:
    """What makes two ticks the same quiet state (None: the tick was not quiet)."""
    outcome = getattr(result, "outcome", None)
    if outcome == "idle":
        return (
            "idle",
            bool(getattr(result, "held_back", False)),
            bool(getattr(result, "waiting_retries", 0)),
            bool(getattr(result, "window_withheld", 0)),
        )
    if outcome in ("lease_busy", "lost_race"):
        # A holder that dies while this worker waits is news: it is said at INFO
        # (pid gone from this host, or the lease no longer renewed), not left to
        # the DEBUG repeats of "lease held by" until the lease lapses.
        holder_gone = getattr(result, "holder_gone", False)
        stale = getattr(result, "not_renewed_seconds", None) is not None
        hung = getattr(result, "held_past_ttl_seconds", None) is not None
        return ("lease", getattr(result, "holder", None), bool(holder_gone), stale, hung)
    return None


def for_how_long(seconds: float) -> str:
    """``45s``, ``12m 5s``, ``3h 5m``, ``2d 4h``: whole seconds below a minute."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    return human_duration(seconds)


__all__ = [
    "DEFAULT_STILL_QUIET_SECONDS",
    "MORE_AT_ONCE",
    "MORE_ON_STOP",
    "QuietCadence",
    "for_how_long",
    "quiet_key",
]
