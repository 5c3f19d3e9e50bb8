"""The retry backoff: one rule for an event a poller retries and a row a queue retries.

A failed delivery waits ``base * 2**(attempt-1)`` seconds, capped at ``cap``,
times a jitter factor drawn in [0.5, 1) ("equal jitter"): deliveries that
failed together (a downstream outage) spread out on the way back, while none
comes back sooner than half its bound. Pure: the caller draws the jitter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dbtrigger import options as opt
from dbtrigger.errors import ConfigurationError

#: Doublings past this are the cap anyway; bounded so 2**n never overflows.
_MAX_DOUBLINGS = 60


def backoff_seconds(attempts: int, *, base: float, cap: float, jitter: float) -> float:
    """Delay before delivery ``attempts + 1``: ``base * 2**(attempts-1)``, capped,
    times a jitter factor in [0.5, 1) (``jitter`` is a uniform draw in [0, 1))."""
    raw = min(cap, base * 2.0 ** min(max(0, attempts - 1), _MAX_DOUBLINGS))
    return raw * (0.5 + jitter / 2)


def check_retry_delays(delay: float, cap: float) -> None:
    """``retry_delay_seconds`` (each checked alone) is at most ``retry_delay_max_seconds``:
    the rule of a poller's options and of a queue's :class:`Backoff`."""
    if cap < delay:
        raise ConfigurationError(
            f"need 0 <= retry_delay_seconds <= retry_delay_max_seconds, got {delay:g} and {cap:g}"
        )


@dataclass(frozen=True)
class Backoff:
    """:func:`backoff_seconds` with its bounds checked once."""

    base_seconds: float = 1.0
    cap_seconds: float = 300.0

    def __post_init__(self) -> None:
        opt.seconds("base_seconds", self.base_seconds, inclusive=True)
        opt.seconds("cap_seconds", self.cap_seconds, inclusive=True)
        check_retry_delays(self.base_seconds, self.cap_seconds)

    def bound(self, attempt: int) -> float:
        """The delay before jitter after failed attempt ``attempt``."""
        return backoff_seconds(attempt, base=self.base_seconds, cap=self.cap_seconds, jitter=1.0)

    def delay(self, attempt: int, rng: random.Random) -> float:
        return backoff_seconds(
            attempt, base=self.base_seconds, cap=self.cap_seconds, jitter=rng.random()
        )
