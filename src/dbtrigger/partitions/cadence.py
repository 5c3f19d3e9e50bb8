"""When a member balances next, and who it believes is alive: on its own clock only.

Two rules keep a group both quick and cheap:

* **Fast while things move, slow when settled.** After a cycle in which
  anything changed (a member appeared or vanished, a partition was claimed,
  stolen or released, someone is not at its share, a partition is free, or
  this member is still in its join window), and for a settling period of two
  intervals after it, the next cycle comes after the *fast* interval; then
  after the balance interval (plus up to 20% jitter, so members do not write
  in lock-step). A join, leave or takeover therefore converges in a few fast
  cycles, while a steady group costs one read and one write per member per
  interval.
* **Never later than a death.** A member whose heartbeat counter stops moving
  is dead once it has stood still for the member TTL *on this observer's
  monotonic clock* (no two hosts' clocks are ever compared). The next cycle
  is scheduled no later than the moment the first such member would expire,
  so a killed member's partitions are taken over within the TTL plus the
  delay until its last heartbeat was first seen, not a whole interval after.

Everything here is pure or keeps only in-process observations; the member
(:mod:`dbtrigger.partitions.member`) does the I/O.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions.layout import BalanceDecision, Membership

#: The balance interval when nothing is configured: a settled member writes
#: its heartbeat this often (one read and one write of the membership document).
DEFAULT_BALANCE_INTERVAL_SECONDS = 3.0
#: The member TTL as a multiple of the interval when none is configured: 3 s
#: gives 10 s, so a killed member's partitions move within about 10-14 s.
DEFAULT_TTL_FACTOR = 10 / 3
#: The fast interval: this fraction of the balance interval, at most
#: :data:`MAX_FAST_SECONDS`.
FAST_FRACTION = 1 / 6
MAX_FAST_SECONDS = 0.5
#: Jitter added to every delay, as a fraction of it.
JITTER = 0.2
#: How far past a member's expiry the cycle that declares it dead is scheduled.
EXPIRY_MARGIN_SECONDS = 0.05


def fast_interval(interval: float) -> float:
    """The delay between cycles while ownership is changing."""
    return min(MAX_FAST_SECONDS, interval * FAST_FRACTION)


def default_ttl(interval: float) -> float:
    return interval * DEFAULT_TTL_FACTOR


class Liveness:
    """Which other members are alive, judged by this observer's own monotonic clock.

    A member is alive while its ``beat`` has moved within ``ttl`` seconds of
    when this observer *first saw* its current value. A member seen for the
    first time is alive (it just wrote), so a newcomer counts at once.
    """

    def __init__(self, ttl: float, monotonic: Callable[[], float]) -> None:
        self.ttl = ttl
        self.monotonic = monotonic
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, doc: Membership, me: str) -> frozenset[str]:
        """The members of ``doc`` other than ``me`` whose heartbeat moved within the TTL."""
        now = self.monotonic()
        live = set()
        for name, member in doc.members.items():
            if name == me:
                continue
            seen = self._seen.get(name)
            if seen is None or seen[0] != member.beat:
                seen = self._seen[name] = (member.beat, now)
            if now - seen[1] < self.ttl:
                live.add(name)
        for gone in set(self._seen) - set(doc.members):
            del self._seen[gone]  # left or removed: a name that comes back starts afresh
        return frozenset(live)

    def seconds_to_first_expiry(self, names: Iterable[str]) -> float | None:
        """Seconds until the first of ``names`` would be dead if it stopped beating now."""
        now = self.monotonic()
        times = [self._seen[name][1] + self.ttl - now for name in names if name in self._seen]
        return min(times) if times else None

    def silent_for(self, name: str) -> float | None:
        """Seconds since ``name``'s heartbeat last moved, as this observer saw it."""
        seen = self._seen.get(name)
        return None if seen is None else self.monotonic() - seen[1]


def owners(doc: Membership) -> dict[str, frozenset[str]]:
    """Member name -> the partitions it owns: what a cycle compares with the last one."""
    return {name: frozenset(m.owns) for name, m in doc.members.items()}


class Cadence:
    """Picks the delay to each next balance cycle of one member.

    Fast (:func:`fast_interval`) while anything moves and for ``settle``
    seconds after the last movement this member saw - so a member that has
    just settled still notices a newcomer, or a member started a few seconds
    after the others, within a fast cycle, and its partitions become old
    enough to steal in about a second rather than several intervals - then
    the slow ``interval``. Every delay gets up to 20% jitter, and none ends
    after the moment a silent member would expire.
    """

    def __init__(
        self,
        interval: float,
        monotonic: Callable[[], float],
        rng: random.Random,
        settle: float | None = None,
    ) -> None:
        self.interval = interval
        self.fast = fast_interval(interval)
        self.settle = 2 * interval if settle is None else settle
        self.monotonic = monotonic
        self.rng = rng
        self._owners: dict[str, frozenset[str]] | None = None
        self._moved_at = -float("inf")

    def next(
        self,
        decision: BalanceDecision | None,
        doc: Membership | None,
        *,
        joining: bool,
        expiry_in: float | None,
    ) -> float:
        """Seconds until the next cycle, after one that decided ``decision`` on ``doc``
        (``decision`` None: the cycle lost every compare-and-swap round)."""
        now = self.monotonic()
        after = owners(doc) if doc is not None else None
        moving = (
            joining
            or decision is None
            or decision.changed
            or not decision.settled
            or after != self._owners
        )
        self._owners = after
        if moving:
            self._moved_at = now
        base = self.fast if now - self._moved_at < self.settle else self.interval
        delay = base + self.rng.uniform(0, JITTER * base)
        if expiry_in is not None:
            delay = min(delay, max(expiry_in, 0.0) + EXPIRY_MARGIN_SECONDS)
        return delay

    def after_failure(self) -> float:
        """After a cycle that failed (the store is down): the slow interval."""
        return self.interval * (1 + self.rng.uniform(0, JITTER))


def settings(
    interval: float | None, ttl: float | None, join_window: float | None
) -> tuple[float, float, float]:
    """The balance interval, member TTL and join window, defaults filled in and checked.

    Raises:
        ConfigurationError: a value that would make healthy members look dead
            (TTL under twice the interval) or never let a member claim.
    """
    interval = DEFAULT_BALANCE_INTERVAL_SECONDS if interval is None else interval
    if interval <= 0:
        raise ConfigurationError(f"balance_interval_seconds must be > 0, got {interval:g}")
    ttl = default_ttl(interval) if ttl is None else ttl
    if ttl < 2 * interval:
        raise ConfigurationError(
            f"member_ttl_seconds ({ttl:g}) must be at least twice balance_interval_seconds "
            f"({interval:g}): a member that misses one cycle is not dead"
        )
    window = fast_interval(interval) if join_window is None else join_window
    if window < 0 or window >= ttl:
        raise ConfigurationError(
            f"join_window_seconds must be between 0 and member_ttl_seconds ({ttl:g}), "
            f"got {window:g}"
        )
    return interval, ttl, window
