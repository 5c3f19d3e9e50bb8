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
* a subscriber that used up its attempts (with a sink) has **given up** on
  the event, not decided it for the others: it is handed the event no more
  (:func:`fan_out_set`), and the event goes on to every subscriber that still
  owes it - busy, or with attempts of its own left - and is dead-lettered
  once none does, in the names of those that gave up (or rejected it). Before,
  it was dead-lettered at once, and a subscriber busy meanwhile never got an
  event it was never handed;
* otherwise it is **pending** for exactly the subscribers that failed it
  (:attr:`Fate.PENDING`): it is delivered again, after the backoff, to them
  only - a subscriber that accepted it never sees it again (billing is not
  charged twice because search was busy). Attempts are counted per subscriber;
* an event no subscriber resolved (a **zero-subscriber hand-out**: every
  subscriber it was owed to has been removed) is **not clean** (seed 004's
  ``is_clean``): nothing accepted it, so it is not settled as delivered. It
  is dead-lettered when a sink exists, else it stays pending, loudly;
* a subscriber still inside an earlier call that outlived its
  ``ack_timeout_seconds`` is **busy**: its share of the event is
  :attr:`Kind.DEFERRED` - not handed to it, so **not an attempt** (attempts
  count deliveries to that subscriber only). The event stays owed to it with
  its count unchanged, and :func:`held` keeps events that only busy (or
  removed, without a sink) subscribers owe out of later batches until one of
  them can take them.

The runtime side (threads, timeouts, the dead-letter write) is
:mod:`dbtrigger.runtime.subscribers`; ``tests/test_fanout.py`` checks this
module table by table.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.Enum):
    """How one subscriber resolved one event."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    FAILED = "failed"
    """Asked for a retry, raised or timed out: deliver it again (an attempt)."""
    DEFERRED = "deferred"
    """Not handed to it (it was busy): deliver it later, no attempt counted."""


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


def defer(reason: str) -> Resolution:
    return Resolution(Kind.DEFERRED, reason)


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
    deferred: int = 0

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
    def counted(self) -> bool:
        """This hand-out was an attempt: False only for an event left PENDING
        because every subscriber that still owes it was busy (nobody received
        it, see :attr:`Kind.DEFERRED`)."""
        return self.fate is not Fate.PENDING or self.tally.failed > 0 or not self.tally.deferred

    @property
    def reason(self) -> str:
        """One line naming each subscriber's reason, for a record or the window."""
        if not self.reasons:
            return ""
        return "; ".join(f"{name}: {why}" for name, why in sorted(self.reasons.items()))


def fan_out_set(
    owed: Mapping[str, int] | None,
    subscribers: Sequence[str],
    *,
    max_attempts: int | None = None,
    has_sink: bool = False,
) -> tuple[dict[str, int], tuple[str, ...]]:
    """The subscribers an event is handed to now, with their attempts so far,
    and those it was owed to that are gone.

    ``owed`` is the event's pending entry (None: a new event, or one that a
    single-handler poller left pending - every subscriber gets it). With a
    sink (and ``max_attempts``), a subscriber that used up its attempts is
    not handed it again (:func:`given_up`): it waits for the others.
    """
    if owed is None:
        return dict.fromkeys(subscribers, 0), ()
    configured = set(subscribers)
    spent = given_up(owed, subscribers, max_attempts=max_attempts, has_sink=has_sink)
    kept = {name: count for name, count in owed.items() if name in configured and name not in spent}
    gone = tuple(sorted(name for name in owed if name not in configured))
    return kept, gone


def given_up(
    owed: Mapping[str, int] | None,
    subscribers: Collection[str],
    *,
    max_attempts: int | None,
    has_sink: bool,
) -> dict[str, int]:
    """The configured subscribers that used up their attempts on a waiting event
    (``owed``: its pending entry), each with its count. Only with a sink: without
    one nothing can take the event off the checkpoint, so it stays handed to them
    (reported as poison)."""
    if owed is None or not has_sink or max_attempts is None:
        return {}
    return {
        name: count for name, count in owed.items() if name in subscribers and count >= max_attempts
    }


def decide(
    handed: Mapping[str, int],
    results: Mapping[str, Resolution],
    *,
    max_attempts: int,
    has_sink: bool,
    gone: Collection[str] = (),
    spent: Mapping[str, int] | None = None,
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
        spent: subscribers that gave up on it in an earlier batch (not handed
            it now, :func:`given_up`), each with its count.
    """
    accepted = rejected = failed = deferred = 0
    owed: dict[str, int] = {}
    rejects: dict[str, str] = {}
    failures: dict[str, str] = {}
    spent_now: list[str] = []
    for name, before in handed.items():
        result = results.get(name, _MISSING)
        if result.kind is Kind.ACCEPTED:
            accepted += 1
        elif result.kind is Kind.REJECTED:
            rejected += 1
            rejects[name] = result.reason
        elif result.kind is Kind.DEFERRED:
            # Never handed to it: still owed, and not an attempt.
            deferred += 1
            failures[name] = result.reason
            owed[name] = before
        else:
            failed += 1
            failures[name] = result.reason
            owed[name] = before + 1
            if before + 1 >= max_attempts:
                spent_now.append(name)
    tally = Tally(accepted, rejected, failed, deferred)
    gone_t = tuple(sorted(gone))
    earlier = dict(spent or {})
    gave_up = {name: f"failed on all {count} attempts" for name, count in earlier.items()}
    if rejects:
        return Decision(
            Fate.DEAD_LETTER, tally, reasons={**gave_up, **failures, **rejects}, gone=gone_t
        )
    if (spent_now or earlier) and has_sink:
        # Given up by some: dead-lettered once nobody else still owes it (a busy
        # subscriber never had it; another may have attempts left).
        still = {name: count for name, count in owed.items() if name not in spent_now}
        if not still:
            why = {**gave_up, **{name: failures[name] for name in spent_now}}
            return Decision(Fate.DEAD_LETTER, tally, reasons=why, exhausted=True, gone=gone_t)
        return Decision(
            Fate.PENDING, tally, owed={**owed, **earlier}, reasons=failures, gone=gone_t
        )
    if owed:
        return Decision(
            Fate.PENDING, tally, owed=owed, reasons=failures, gone=gone_t, stuck=tuple(spent_now)
        )
    if tally.is_clean:
        return Decision(Fate.SETTLED, tally, gone=gone_t)
    # Nobody resolved it: every subscriber it was owed to is gone. Not clean.
    why = dict.fromkeys(gone_t, "unsubscribed before resolving it")
    if has_sink:
        return Decision(Fate.DEAD_LETTER, tally, reasons=why, gone=gone_t)
    return Decision(Fate.PENDING, tally, owed=dict.fromkeys(gone_t, 1), reasons=why, gone=gone_t)


#: Why :func:`held` keeps an event back.
BUSY = "busy"
GONE = "gone"


def held(
    owed: Mapping[str, int] | None,
    subscribers: Collection[str],
    busy: Collection[str],
    *,
    has_sink: bool,
    max_attempts: int | None = None,
) -> str | None:
    """Must a waiting event stay out of the next batch? Why (:data:`BUSY`,
    :data:`GONE`), or None when some subscriber can take it now.

    Handing it out would change nothing and cost a commit: every subscriber
    that owes it is still inside a call that outlived its ack timeout (it
    comes as soon as one is free), or has been removed while no dead-letter
    sink can take it (it comes once the subscriber is back or a sink is
    configured). ``owed`` None (a single handler's retry) is owed to every
    subscriber. A subscriber that gave up on it (:func:`given_up`, with
    ``max_attempts``) takes nothing: it waits for the others.
    """
    names = list(subscribers) if owed is None else list(owed)
    configured = [name for name in names if name in subscribers]
    able = takers(owed, subscribers, max_attempts=max_attempts, has_sink=has_sink)
    if any(name not in busy for name in able):
        return None
    if able:
        return BUSY
    if configured:
        return None  # only subscribers that gave up on it: handed out, it is dead-lettered
    return None if has_sink else GONE


def takers(
    owed: Mapping[str, int] | None,
    subscribers: Collection[str],
    *,
    max_attempts: int | None = None,
    has_sink: bool = False,
) -> list[str]:
    """The configured subscribers a waiting event is still to be handed to:
    those it is owed to (every one for ``owed`` None) less those that gave up on
    it (:func:`given_up`)."""
    names = list(subscribers) if owed is None else list(owed)
    spent = given_up(owed, subscribers, max_attempts=max_attempts, has_sink=has_sink)
    return [name for name in names if name in subscribers and name not in spent]


def owed_by(pending: Sequence[Any]) -> dict[str, int]:
    """Subscriber -> how many waiting events (window ``pending`` entries, as
    :class:`dbtrigger.state.window.Pending`) it still owes a resolution.
    Entries with no ``owed`` (a single handler's retries) are not counted."""
    out: dict[str, int] = {}
    for entry in pending:
        for name in entry.owed or ():
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


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
        elif resolution.kind is Kind.FAILED:
            self.failed += 1
        # DEFERRED: not handed to it, so no outcome of its to count.
