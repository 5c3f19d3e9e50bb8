"""Fan-out: when is an event handed to several subscribers settled?

``PollTrigger(..., subscribers={"billing": f, "search": g})`` reads once and
hands every event to every subscriber. Each subscriber resolves the event
for itself - it accepts it, rejects it (``ctx.reject``) or fails it
(``ctx.retry``, a raise, or its ``ack_timeout_seconds`` ran out) - and this
module decides, without I/O, what that means for the event (the producer ack
channel of seed 004, on a keyset poller):

* the set of subscribers that owe an event a resolution is **frozen when the
  event is handed out** (:func:`fan_out_set`): a subscriber added later is not
  owed an event already handed out; a subscriber that was removed meanwhile
  counts as having unsubscribed (resolved, but it accepted nothing);
* an event is **settled** only when every subscriber it was handed to
  accepted it (:attr:`Fate.SETTLED`), or some subscriber rejected it - or
  used up its ``max_attempts`` - and the dead-letter write succeeded
  (:attr:`Fate.DEAD_LETTER`; a reject is terminal for the *event*, so other
  subscribers' retries of it end there too: the row is dead-lettered once,
  with every subscriber's reason);
* otherwise it is **pending** for exactly the subscribers that failed it
  (:attr:`Fate.PENDING`): it is delivered again, after the backoff, to them
  only - a subscriber that accepted it never sees it again (billing is not
  charged twice because search was busy). Attempts are counted per subscriber;
* an event no subscriber resolved (a **zero-subscriber hand-out**: every
  subscriber it was owed to has been removed) is **not clean** (seed 004's
  ``is_clean``): nothing accepted it, so it is not settled as delivered. It
  is dead-lettered when a sink exists, else it stays pending, loudly.

The runtime side (threads, timeouts, the dead-letter write) is
:mod:`dbtrigger.runtime.subscribers`; ``tests/test_fanout.py`` checks this
module table by table.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


class Kind(enum.Enum):
    """How one subscriber resolved one event."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    FAILED = "failed"
    """Asked for a retry, raised, timed out, or was still busy: deliver it again."""


@dataclass(frozen=True)
class Resolution:
    """One subscriber's outcome for one event (``reason`` for reject/fail)."""

    kind: Kind
    reason: str = ""


ACCEPT = Resolution(Kind.ACCEPTED)


def reject(reason: str) -> Resolution:
    return Resolution(Kind.REJECTED, reason)


def fail(reason: str) -> Resolution:
    return Resolution(Kind.FAILED, reason)


_MISSING = Resolution(Kind.FAILED, "no result (timed out)")


class Fate(enum.Enum):
    """What becomes of an event once its fan-out set has been handed it."""

    SETTLED = "settled"
    """Every subscriber accepted it: settled, never delivered again."""
    DEAD_LETTER = "dead_letter"
    """Rejected (or a subscriber's attempts used up, or nobody owes it): write
    it to the dead-letter sink; settled once that write succeeded."""
    PENDING = "pending"
    """Deliver it again later, to the subscribers in :attr:`Decision.owed` only."""


@dataclass(frozen=True)
class Tally:
    """Per-event counts of how the fan-out set resolved it (seed 004's AdvanceOutcome)."""

    accepted: int = 0
    rejected: int = 0
    failed: int = 0

    @property
    def is_clean(self) -> bool:
        """Every subscriber accepted it, and there was at least one."""
        return self.accepted > 0 and not self.rejected and not self.failed


@dataclass(frozen=True)
class Decision:
    """The fate of one event, and what to remember or write for it."""

    fate: Fate
    tally: Tally
    owed: Mapping[str, int] = field(default_factory=dict)
    """PENDING: subscriber -> deliveries of the event to it that ended unresolved."""
    reasons: Mapping[str, str] = field(default_factory=dict)
    """Subscriber -> its reason, for the dead-letter record or the pending entry."""
    exhausted: bool = False
    """DEAD_LETTER only because some subscriber used up its attempts (no reject)."""
    gone: tuple[str, ...] = ()
    """Subscribers it was owed to that are no longer configured (unsubscribed)."""
    stuck: tuple[str, ...] = ()
    """PENDING without a sink although these subscribers used up their attempts."""

    @property
    def reason(self) -> str:
        """One line naming each subscriber's reason, for a record or the window."""
        if not self.reasons:
            return ""
        return "; ".join(f"{name}: {why}" for name, why in sorted(self.reasons.items()))


def fan_out_set(
    owed: Mapping[str, int] | None, subscribers: Sequence[str]
) -> tuple[dict[str, int], tuple[str, ...]]:
    """The subscribers an event is handed to now, with their attempts so far,
    and those it was owed to that are gone.

    ``owed`` is the event's pending entry (None: a new event, or one that a
    single-handler poller left pending - every subscriber gets it).
    """
    if owed is None:
        return dict.fromkeys(subscribers, 0), ()
    configured = set(subscribers)
    kept = {name: count for name, count in owed.items() if name in configured}
    gone = tuple(sorted(name for name in owed if name not in configured))
    return kept, gone


def decide(
    handed: Mapping[str, int],
    results: Mapping[str, Resolution],
    *,
    max_attempts: int,
    has_sink: bool,
    gone: Collection[str] = (),
) -> Decision:
    """Fold the resolutions of one event's fan-out set into its fate.

    Args:
        handed: the subscribers it was handed to (its frozen fan-out set),
            each with the number of earlier deliveries it left unresolved.
        results: each handed subscriber's resolution (a missing one is a
            failure: the subscriber never reported - treated as a timeout).
        max_attempts: deliveries to one subscriber before a failure of it
            is final (dead-lettered, or held loudly without a sink).
        has_sink: a dead-letter sink is configured.
        gone: subscribers the event was owed to that are no longer configured.
    """
    accepted = rejected = failed = 0
    owed: dict[str, int] = {}
    rejects: dict[str, str] = {}
    failures: dict[str, str] = {}
    spent: list[str] = []
    for name, before in handed.items():
        result = results.get(name, _MISSING)
        if result.kind is Kind.ACCEPTED:
            accepted += 1
        elif result.kind is Kind.REJECTED:
            rejected += 1
            rejects[name] = result.reason
        else:
            failed += 1
            failures[name] = result.reason
            owed[name] = before + 1
            if before + 1 >= max_attempts:
                spent.append(name)
    tally = Tally(accepted, rejected, failed)
    gone_t = tuple(sorted(gone))
    if rejects:
        return Decision(Fate.DEAD_LETTER, tally, reasons={**failures, **rejects}, gone=gone_t)
    if spent and has_sink:
        return Decision(Fate.DEAD_LETTER, tally, reasons=failures, exhausted=True, gone=gone_t)
    if owed:
        return Decision(
            Fate.PENDING, tally, owed=owed, reasons=failures, gone=gone_t, stuck=tuple(spent)
        )
    if tally.is_clean:
        return Decision(Fate.SETTLED, tally, gone=gone_t)
    # Nobody resolved it: every subscriber it was owed to is gone. Not clean.
    why = dict.fromkeys(gone_t, "unsubscribed before resolving it")
    if has_sink:
        return Decision(Fate.DEAD_LETTER, tally, reasons=why, gone=gone_t)
    return Decision(Fate.PENDING, tally, owed=dict.fromkeys(gone_t, 1), reasons=why, gone=gone_t)


@dataclass
class SubscriberCounts:
    """One subscriber's outcomes over a batch (journal and metrics)."""

    accepted: int = 0
    rejected: int = 0
    failed: int = 0

    def add(self, resolution: Resolution) -> None:
        if resolution.kind is Kind.ACCEPTED:
            self.accepted += 1
        elif resolution.kind is Kind.REJECTED:
            self.rejected += 1
        else:
            self.failed += 1
