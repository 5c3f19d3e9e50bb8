"""Fan-out: one read, several subscribers, each resolving every event for itself.

``PollTrigger(..., subscribers={"billing": handle_billing, "search": handle_search})``
fetches each batch once and hands it to every subscriber, each in its own thread
with its own :class:`~dbtrigger.runtime.context.BatchContext` (``ctx.subscriber``,
``ctx.reject`` / ``retry`` / ``attempts`` are its own). What each event then
becomes is the pure decision of :mod:`dbtrigger.state.fanout`:

* settled when every subscriber it was handed to accepted it, or when one
  rejected it - or used up ``max_attempts`` and no other still owes it - and
  the dead-letter write succeeded: one record per event, with the reasons;
* otherwise pending for the subscribers that failed it - a ``ctx.retry``, a
  raise (a :class:`~dbtrigger.errors.PartialBatchError` fails only the rows
  it names; at the last attempt, with a sink, a raise on several events has
  them bisected first: :mod:`dbtrigger.runtime.subscriber_poison`), or no
  answer within ``ack_timeout_seconds`` - and delivered again, after the
  backoff, **to those subscribers only**; who owes what is kept in the
  window's pending entries, so this survives restarts.

A subscriber that raises or hangs fails its own events only; the others'
outcomes stand and commit. A hung synchronous subscriber cannot be stopped
(``ctx.cancelled`` says it was given up; an async one is cancelled): until its
call returns it is *busy*, and its share of later batches waits for it,
uncounted (:func:`dbtrigger.state.fanout.held`; the window's pressure rule
bounds how far the others run ahead). A lost lease ends the wait at once.

Said once per change: what holds the checkpoint (``checkpoint_held``), and who
joined or left (``subscriber_joined``, :mod:`dbtrigger.runtime.set_report`). Cost: one
fetch and one commit per batch however many subscribers; never writes state itself.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dbtrigger.errors import LostLeaseError, QuarantineError
from dbtrigger.events import RowChange
from dbtrigger.runtime.batch_outcome import Delivered, Outcome, Undelivered, batch_fields
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.crash_isolation import OneByOne, ProcessDied
from dbtrigger.runtime.dead_letters import EventRejected, RetriesExhausted
from dbtrigger.runtime.delivery import Delivery, DeliveryOptions
from dbtrigger.runtime.held_report import ALL_BUSY, HeldReport
from dbtrigger.runtime.kernel import CANCEL_POLL_SECONDS, Handler, lingering, wants_context
from dbtrigger.runtime.subscriber_crashes import deliver_alone
from dbtrigger.runtime.subscriber_options import TIMER_ACK_TIMEOUT, SubscriberCall, Wrap
from dbtrigger.runtime.subscriber_poison import failed_resolutions, isolate_share
from dbtrigger.state import fanout
from dbtrigger.state.fanout import Decision, Fate, Resolution
from dbtrigger.state.journal import Outcomes
from dbtrigger.state.window import Window, key_of

#: A subscriber that did not report on an event (it was not called: never expected).
NO_RESULT = fanout.fail("no result")


@dataclass
class _Call:
    """One subscriber's call on one batch, as it runs in its thread."""

    name: str
    events: list[RowChange]
    ctx: BatchContext
    marks: EventMarks
    thread: threading.Thread | None = None
    error: BaseException | None = None
    timed_out: bool = False
    busy: bool = False

    @property
    def clean(self) -> bool:
        """It returned in time without marking anything: it accepted every event."""
        if self.busy or self.timed_out or self.error is not None:
            return False
        rejected, retried = self.marks.snapshot()
        return not rejected and not retried


def delivery_for(
    options: DeliveryOptions, *, subscribers: Mapping[str, Handler] | None, ack_timeout: float
) -> Delivery:
    """A poller's delivery: to its one handler, or (``subscribers``) fanned out."""
    if subscribers is None:
        return Delivery(options)
    return FanOut(options, subscribers=subscribers, ack_timeout=ack_timeout)


class FanOut(Delivery):
    """Hands each batch to every subscriber and folds their outcomes; see the module."""

    watched = False  # each call is bounded (and reported) by ack_timeout_seconds

    def __init__(
        self, options: DeliveryOptions, *, subscribers: Mapping[str, Handler], ack_timeout: float
    ) -> None:
        super().__init__(options)
        self.subscribers = dict(subscribers)
        self.wants = {name: wants_context(fn) for name, fn in self.subscribers.items()}
        self.ack_timeout = ack_timeout
        #: Calls that outlived their ack timeout (or a lost lease) and are still running
        #: (one registry for every partition of a PartitionedPoller member).
        self.abandoned: dict[str, threading.Thread] = {}
        sink = self.quarantine is not None
        self._limits: dict[str, Any] = {"max_attempts": self.max_attempts, "has_sink": sink}
        #: Says what holds the checkpoint, once per change.
        self._report_held = HeldReport(
            self.telemetry, poller=self.poller, ack_timeout=ack_timeout, cli_target=self.cli_target
        )

    def under_timer(self) -> None:
        """A timer drives the ticks (a Functions invocation): a default ack timeout
        is cut to :data:`~dbtrigger.runtime.subscriber_options.TIMER_ACK_TIMEOUT`."""
        self.ack_timeout = self._report_held.ack_timeout = min(self.ack_timeout, TIMER_ACK_TIMEOUT)

    @property
    def overlaps(self) -> bool:
        """Subscribers always run on threads of their own."""
        return True

    def fan_out_set(self) -> tuple[str, ...]:
        return tuple(sorted(self.subscribers))

    def busy(self) -> frozenset[str]:
        """Subscribers still inside a call that outlived its ack timeout."""
        for name, thread in list(self.abandoned.items()):
            if not thread.is_alive():
                self.abandoned.pop(name, None)
        return frozenset(self.abandoned)

    def holding(self, window: Window) -> frozenset[str] | None:
        """The window keys of waiting events no subscriber can take now (see
        :func:`dbtrigger.state.fanout.held`): left out of the next batch. None
        when every subscriber is busy: nothing can be handed to anyone, not
        even a new row (it would only take room in the window). Reports a
        change of what holds the checkpoint, once."""
        busy = self.busy()
        if busy and busy >= self.subscribers.keys():
            self._report_held({(ALL_BUSY, tuple(sorted(busy))): len(window.pending)})
            return None
        if not window.pending:
            self._report_held({})
            return frozenset()
        keys: set[str] = set()
        held: dict[tuple[str, tuple[str, ...]], int] = {}
        for entry in window.pending:
            why = fanout.held(entry.owed, self.subscribers, busy, **self._limits)
            if why is None:
                continue
            keys.add(key_of(entry.position))
            names = list(self.subscribers) if entry.owed is None else list(entry.owed)
            if why == fanout.BUSY:  # (those that gave up on it hold nothing: they wait)
                names = fanout.takers(entry.owed, self.subscribers, **self._limits)
            group = (why, tuple(sorted(names)))
            held[group] = held.get(group, 0) + 1
        self._report_held(held)
        return frozenset(keys)

    def deliver(
        self,
        handler: Handler,
        events: list[RowChange],
        done: frozenset[str],
        ctx: BatchContext,
        wants_ctx: bool,
        meanwhile: Callable[[], None] | None = None,
    ) -> Outcome:
        """Hand the batch to each subscriber it is owed to; fold the outcomes.
        ``meanwhile`` (the tick's read of the next batch) runs on this thread
        while the subscribers do.

        Raises:
            LostLeaseError: the lease was lost; nothing may be written.
            ConfigurationError: a subscriber misused ``ctx.reject`` / ``ctx.retry``.
        """
        del wants_ctx  # each subscriber has its own
        inner = handler.handler if isinstance(handler, OneByOne) else handler
        wrap = inner.wrap if isinstance(inner, SubscriberCall) else None
        marks = ctx.marks
        event_attempts = dict(marks.attempts) if marks is not None else {}
        owed = dict(marks.owed) if marks is not None else {}
        if marks is not None:
            marks.close()
        names = list(self.subscribers)
        pending = [e for e in events if e.event_id not in done] if done else list(events)
        handed: dict[str, dict[str, int]] = {}
        gone: dict[str, tuple[str, ...]] = {}
        spent: dict[str, dict[str, int]] = {}  # event id -> who gave up on it (not handed it)
        # The usual batch: no event of it waits for a retry, so every subscriber
        # gets all of it, and no event id need be computed unless one is marked.
        uniform = not owed and not event_attempts
        parts: dict[str, list[RowChange]] = {name: [] for name in names}
        if uniform:
            parts = dict.fromkeys(names, pending)  # read-only here; each call gets a copy
        for event in [] if uniform else pending:
            before = owed.get(event.event_id)
            if before is None and event.event_id in event_attempts:
                # Left pending by a single-handler poller: every subscriber owes it.
                before = dict.fromkeys(names, event_attempts[event.event_id])
            fan, left = fanout.fan_out_set(before, names, **self._limits)
            handed[event.event_id] = fan
            if left:
                gone[event.event_id] = left
            if gave_up := fanout.given_up(before, names, **self._limits):
                spent[event.event_id] = gave_up
            for name in fan:
                parts[name].append(event)
        if isinstance(handler, OneByOne):  # it killed its process: each row to each alone
            if uniform:
                handed = {e.event_id: dict.fromkeys(names, 0) for e in pending}
            results, died = deliver_alone(self, handler, wrap, parts, handed, pending, ctx)
            return self._fold(ctx, events, pending, handed, gone, results, done, spent, died)
        calls = self._run(wrap, parts, handed, ctx, meanwhile)
        self._check(calls, ctx)
        if uniform and all(call.clean for call in calls):
            return Delivered(
                by_subscriber={call.name: Outcomes(len(call.events)) for call in calls}
            )
        if uniform:
            handed = {e.event_id: dict.fromkeys(names, 0) for e in pending}
        results = self._results(calls, ctx)
        return self._fold(ctx, events, pending, handed, gone, results, done, spent)

    # --- running the subscribers ------------------------------------------------------

    def _run(
        self,
        wrap: Wrap | None,
        parts: Mapping[str, list[RowChange]],
        handed: Mapping[str, Mapping[str, int]],
        ctx: BatchContext,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[_Call]:
        busy = self.busy()
        calls: list[_Call] = []
        for name, part in parts.items():
            if not part:
                continue
            sub_marks = EventMarks(
                part,
                can_reject=self.quarantine is not None,
                attempts={e.event_id: handed[e.event_id][name] for e in part} if handed else None,
            )
            sub_ctx = dataclasses.replace(
                ctx, marks=sub_marks, subscriber=name, timed_out=threading.Event()
            )
            call = _Call(name, part, sub_ctx, sub_marks)
            calls.append(call)
            if name in busy:
                call.busy = True
                continue
            fn = self.subscribers[name]
            wants = self.wants[name]
            if wrap is not None:
                fn, wants = wrap(fn, wants), True
            call.thread = threading.Thread(
                target=self._call_one,
                args=(call, fn, wants),
                name=f"dbtrigger-subscriber-{self.poller}-{name}",
                daemon=True,  # a hung subscriber must not keep the process alive
            )
            call.thread.start()
        deadline = time.monotonic() + self.ack_timeout
        if meanwhile is not None:
            meanwhile()  # keeps its own errors (tick.Prefetch): the joins below always run
        self._wait(calls, deadline, ctx)
        lost = ctx.lease_lost.is_set()
        for call in calls:
            if call.thread is not None and call.thread.is_alive():
                # Still running: handed nothing new until it returns. After a
                # lost lease its context says cancelled already; nothing commits.
                self.abandoned[call.name] = call.thread
                call.marks.close()
                if not lost:
                    call.timed_out = True
                    if call.ctx.timed_out is not None:
                        call.ctx.timed_out.set()
        return calls

    @staticmethod
    def _wait(calls: list[_Call], deadline: float, ctx: BatchContext) -> None:
        """Until every call returned, the ack timeout ran out, or the lease was
        lost (the heartbeat's flag, looked at every few tens of milliseconds: a
        hung subscriber must not keep a lost lease unnoticed for the whole ack
        timeout)."""
        running = [call.thread for call in calls if call.thread is not None]
        while running:
            left = deadline - time.monotonic()
            if left <= 0 or ctx.lease_lost.is_set():
                return
            running[0].join(min(left, CANCEL_POLL_SECONDS))
            running = [thread for thread in running if thread.is_alive()]

    @lingering  # (an async call let go keeps its thread: the subscriber stays busy)
    def _call_one(self, call: _Call, fn: Handler, wants: bool) -> None:
        try:
            # Its own list: a subscriber may sort or pop its batch, the others run on.
            self._invoke(fn, list(call.events), call.ctx, wants)
        except LostLeaseError as exc:
            call.error = exc
        except Exception as exc:  # noqa: BLE001 - sorted out by _results on the tick's thread
            call.error = isolate_share(
                call.events,
                lambda part: self._invoke(fn, part, call.ctx, wants),
                exc,
                attempts=call.marks.attempts,
                max_attempts=self.max_attempts,
                has_sink=self.quarantine is not None,
                limit=self.quarantine_limit,
                ctx=call.ctx,
                telemetry=self.telemetry,
            )
        except BaseException as exc:  # noqa: BLE001 - as above
            call.error = exc
        finally:
            call.marks.close()

    def _check(self, calls: list[_Call], ctx: BatchContext) -> None:
        """Raise what must stop the tick: a lost lease, a misused ctx.reject/retry."""
        for call in calls:
            if not call.timed_out and isinstance(call.error, LostLeaseError):
                raise call.error
        if ctx.lease_lost.is_set():
            raise self._lost_during_handler(
                ctx, batch_fields(ctx, 0), "every subscriber's results discarded"
            )
        for call in calls:
            if not call.timed_out and call.marks.misuse is not None:
                # ctx.reject/retry misused: a bug to fix, not a batch to retry.
                raise call.marks.misuse

    def _results(self, calls: list[_Call], ctx: BatchContext) -> dict[str, dict[str, Resolution]]:
        """Each subscriber's resolution of each event it was handed."""
        emit = self.telemetry.emit
        out: dict[str, dict[str, Resolution]] = {}
        for call in calls:
            fields = {**batch_fields(call.ctx, len(call.events)), "subscriber": call.name}
            mine: dict[str, Resolution] = {}
            out[call.name] = mine
            if call.busy:
                # Not handed to it: no attempt. The events wait for it (owed,
                # count unchanged) and are held back until it is free.
                emit(
                    "subscriber_busy",
                    "subscriber %s is still running a call that timed out: its %d event(s) "
                    "of batch %s wait for it (no attempt counted) and are handed to it once "
                    "it returns",
                    call.name,
                    len(call.events),
                    ctx.batch_id,
                    **fields,
                )
                waiting = fanout.defer(
                    "busy: still running an earlier call that outlived ack_timeout_seconds"
                )
                for event in call.events:
                    mine[event.event_id] = waiting
                continue
            if call.timed_out:
                emit(
                    "subscriber_timed_out",
                    "subscriber %s did not finish %d event(s) of batch %s within %gs: they "
                    "count as failed for it and come again; the other subscribers go on. "
                    "Until the call returns it is busy and handed nothing new: a synchronous "
                    "subscriber should stop when ctx.cancelled turns true; one that is only "
                    "slow needs a longer ack_timeout_seconds or a smaller batch_size",
                    call.name,
                    len(call.events),
                    ctx.batch_id,
                    self.ack_timeout,
                    **fields,
                )
                late = fanout.fail(f"no resolution within ack_timeout_seconds={self.ack_timeout:g}")
                for event in call.events:
                    mine[event.event_id] = late
                continue
            error = call.error
            named = failed_resolutions(call.events, error, call.marks.attempts, self.max_attempts)
            if error is not None:
                emit(
                    "subscriber_failed",
                    "subscriber %s failed %d of %d event(s) of batch %s: %s: %s",
                    call.name,
                    len(named),
                    len(call.events),
                    ctx.batch_id,
                    type(error).__name__,
                    error,
                    error=type(error).__name__,
                    **fields,
                )
            rejected, retried = call.marks.snapshot()
            for event in call.events:
                i = event.event_id
                if i in named:
                    mine[i] = named[i]
                elif i in rejected:
                    mine[i] = fanout.reject(rejected[i])
                elif i in retried:
                    mine[i] = fanout.fail(retried[i])
                else:
                    mine[i] = fanout.ACCEPT
        return out

    # --- folding the outcomes ---------------------------------------------------------

    def _fold(
        self,
        ctx: BatchContext,
        events: list[RowChange],
        pending: list[RowChange],
        handed: Mapping[str, Mapping[str, int]],
        gone: Mapping[str, tuple[str, ...]],
        results: Mapping[str, Mapping[str, Resolution]],
        done: frozenset[str],
        spent: Mapping[str, Mapping[str, int]],
        died: frozenset[str] = frozenset(),
    ) -> Outcome:
        counts = {name: fanout.SubscriberCounts() for name in self.subscribers}
        decisions: dict[str, Decision] = {}
        for event in pending:
            i = event.event_id
            fan = handed[i]
            mine = {name: results.get(name, {}).get(i, NO_RESULT) for name in fan}
            for name, resolution in mine.items():
                counts[name].add(resolution)
            decisions[i] = fanout.decide(
                fan,
                mine,
                max_attempts=self.max_attempts,
                has_sink=self.quarantine is not None,
                gone=gone.get(i, ()),
                spent=spent.get(i),
            )
        by_id = {e.event_id: e for e in pending}
        self.poison.fanout(ctx, by_id, decisions)
        doomed: list[tuple[RowChange, BaseException]] = []
        attempts: dict[str, int] = {}
        for i, d in decisions.items():
            if d.fate is not Fate.DEAD_LETTER:
                continue
            error: BaseException = (
                ProcessDied(d.reason)
                if i in died
                else RetriesExhausted(d.reason)
                if d.exhausted
                else EventRejected(d.reason)
            )
            doomed.append((by_id[i], error))
            earlier = [*spent.get(i, {}).values()]
            attempts[i] = max([n + 1 for n in handed[i].values()] + earlier, default=1)
        if doomed:
            try:
                owing = {e.event_id: dict(decisions[e.event_id].reasons) for e, _ in doomed}
                self.dead_letters.write(ctx, doomed, attempts, owing)
            except QuarantineError as exc:
                settled = frozenset(done) | {
                    i for i, d in decisions.items() if d.fate is Fate.SETTLED
                }
                return Undelivered(exc, settled, exc)
        return Delivered(
            rejected={
                i: d.reason
                for i, d in decisions.items()
                if d.fate is Fate.DEAD_LETTER and not d.exhausted
            },
            retried={i: d.reason for i, d in decisions.items() if d.fate is Fate.PENDING},
            deferred=frozenset(
                i for i, d in decisions.items() if d.fate is Fate.PENDING and not d.counted
            ),
            exhausted=frozenset(
                i for i, d in decisions.items() if d.fate is Fate.DEAD_LETTER and d.exhausted
            ),
            owed={i: dict(d.owed) for i, d in decisions.items() if d.fate is Fate.PENDING},
            by_subscriber={
                name: Outcomes(c.accepted, c.rejected, c.failed)
                for name, c in counts.items()
                if c.accepted or c.rejected or c.failed
            },
        )
