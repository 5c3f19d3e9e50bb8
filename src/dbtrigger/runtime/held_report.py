"""What holds a fan-out poller's checkpoint, said once per change.

A fan-out poller's checkpoint waits when subscribers cannot take their events:
busy ones (still inside a call that outlived ``ack_timeout_seconds``), all of
them busy, or removed ones with no dead-letter sink for their events
(:func:`dbtrigger.state.fanout.held` decides which). That is correct, but an
operator must see it and know what to do: :class:`HeldReport` logs
``checkpoint_held`` at WARNING when what holds it changes (not when only the
number of waiting events does), naming the subscribers, the events and the
way out, and ``checkpoint_released`` when it no longer holds.
"""

from __future__ import annotations

from collections.abc import Callable

from dbtrigger._paste import pasteable
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state import fanout

#: Why the checkpoint is held when every subscriber is busy (see FanOut.holding).
ALL_BUSY = "all_busy"


class HeldReport:
    """Reports what holds one fan-out poller's checkpoint; see the module docstring."""

    def __init__(
        self,
        telemetry: Telemetry,
        *,
        poller: str,
        ack_timeout: float,
        cli_target: Callable[[], str],
    ) -> None:
        self.telemetry = telemetry
        self.poller = poller
        self.ack_timeout = ack_timeout
        self.cli_target = cli_target
        #: What holds the checkpoint, as last reported: (why, subscribers) -> events.
        self._held: dict[tuple[str, tuple[str, ...]], int] = {}

    def __call__(self, held: dict[tuple[str, tuple[str, ...]], int]) -> None:
        """Say what holds the checkpoint when that changes (not when only the
        number of events waiting does); ``held``: (why, subscribers) -> events."""
        before, self._held = self._held, held
        if held.keys() == before.keys():
            return
        emit = self.telemetry.emit
        for (why, names), count in sorted(held.items()):
            if (why, names) in before:
                continue
            who = ", ".join(names)
            if why == ALL_BUSY:
                emit(
                    "checkpoint_held",
                    "checkpoint held: every subscriber (%s) is still inside a call that "
                    "outlived ack_timeout_seconds=%g; nothing is handed out until one "
                    "returns (%d event(s) wait). A synchronous subscriber should stop when "
                    "ctx.cancelled turns true; restarting the worker abandons the calls",
                    who,
                    self.ack_timeout,
                    count,
                    reason=why,
                    subscribers=list(names),
                    events=count,
                )
            elif why == fanout.BUSY:
                emit(
                    "checkpoint_held",
                    "checkpoint held: %d event(s) wait for subscriber(s) %s, still inside a "
                    "call that outlived ack_timeout_seconds=%g; they are handed over as soon "
                    "as it returns (no attempt is counted meanwhile), and the other "
                    "subscribers go on until the window's 75%% mark. A synchronous "
                    "subscriber should stop when ctx.cancelled turns true; restarting the "
                    "worker abandons the call (its events then come again)",
                    count,
                    who,
                    self.ack_timeout,
                    reason=why,
                    subscribers=list(names),
                    events=count,
                )
            else:
                emit(
                    "checkpoint_held",
                    "checkpoint held: %d event(s) are owed only to subscriber(s) %s, which "
                    "poller %s no longer has, and there is no dead-letter sink to write them "
                    "to: they are not delivered and the checkpoint cannot pass them (new rows "
                    "stop at the window's 75%% mark). Add %s back to subscribers= (renamed: "
                    "declare it, subscribers={'NEW': dbtrigger.renamed(handler, formerly="
                    "'OLD')}, and the new name takes them over), or pass "
                    "quarantine=... (they are then dead-lettered as 'unsubscribed before "
                    "resolving it'), or move the checkpoint past them by hand (data loss, "
                    "journaled): %s, then dbtrigger reset",
                    count,
                    who,
                    self.poller,
                    who,
                    pasteable(f"dbtrigger status {self.cli_target()}"),
                    reason=why,
                    subscribers=list(names),
                    events=count,
                )
        for (why, names), count in sorted(before.items()):
            if (why, names) not in held:
                emit(
                    "checkpoint_released",
                    "checkpoint no longer held by subscriber(s) %s (%s): their events are "
                    "delivered again",
                    ", ".join(names),
                    why,
                    reason=why,
                    subscribers=list(names),
                    events=count,
                )
