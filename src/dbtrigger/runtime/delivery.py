"""What happens to one batch: the handler call, and every way it can fail.

The tick driver (:mod:`dbtrigger.runtime.tick`) owns the state document: it
reads it, takes the lease, commits, records failures and releases. This
collaborator owns the batch in the middle and never writes state:

* it calls the handler through the delivery kernel
  (:mod:`dbtrigger.runtime.kernel`) - sync or async, with the lease-lost flag
  turned into a real cancellation of an async handler, on up to
  ``max_concurrency`` lanes at once;
* it sorts out a failure: a :class:`~dbtrigger.errors.PartialBatchError`
  names its failed rows, anything else fails the whole batch; once a batch
  has failed ``max_attempts`` times and a quarantine sink is configured, it
  is bisected and rows that fail alone are written to the sink (the verdict
  itself is :func:`dbtrigger.state.verdict.judge`, a pure function);
* it returns a typed outcome - :class:`Delivered` (every row settled) or
  :class:`Undelivered` (which rows did settle, what to record, what to
  raise) - that the driver turns into a state transition. A lost lease is
  raised as :class:`~dbtrigger.errors.LostLeaseError`: nothing may be
  written then.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from dbtrigger._paste import pasteable
from dbtrigger.errors import (
    AckTimeoutError,
    HandlerError,
    LostLeaseError,
    PartialBatchError,
    QuarantineError,
)
from dbtrigger.events import RowChange
from dbtrigger.isolation import isolate, match_failed
from dbtrigger.quarantine import QuarantineSink
from dbtrigger.runtime import kernel
from dbtrigger.runtime.batch_outcome import Delivered, Outcome, Undelivered, batch_fields
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.dead_letters import (
    DeadLetters,
    EventRejected,
    RetriesExhausted,
    check_lease,
    lease_lost,
)
from dbtrigger.runtime.kernel import Handler, Lanes
from dbtrigger.runtime.poison_report import PoisonReport
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state.verdict import Verdict, judge, should_isolate, transient
from dbtrigger.state.window import Window

__all__ = [
    "Delivered",
    "Delivery",
    "DeliveryOptions",
    "EventRejected",
    "Handler",
    "Outcome",
    "RetriesExhausted",
    "Undelivered",
    "cancelled_error",
]


@dataclass(frozen=True)
class DeliveryOptions:
    """What a :class:`Delivery` (or its fan-out) is built with: one poller's name,
    identity, clock, telemetry, retry policy, dead-letter sink and limits."""

    poller: str
    owner_id: str
    clock: Callable[[], dt.datetime]
    telemetry: Telemetry
    retry: RetryPolicy
    quarantine: QuarantineSink | None
    max_attempts: int
    quarantine_limit: int
    max_concurrency: int = 1
    #: The ``dbtrigger`` CLI's name for the poller in the commands it prints.
    cli_target: Callable[[], str] | None = None


class Delivery:
    """Hands batches to a handler and settles them; see the module docstring."""

    #: Is a hung call reported (and timed out) by the heartbeat's watch? Fan-out's
    #: subscriber calls are bounded by their own ``ack_timeout_seconds``.
    watched = True

    def __init__(self, options: DeliveryOptions) -> None:
        self.poller = poller = options.poller
        self.cli_target = options.cli_target or (lambda: poller)
        self.telemetry = options.telemetry
        self.quarantine = options.quarantine
        self.max_attempts = options.max_attempts
        self.quarantine_limit = options.quarantine_limit
        #: Where failed, rejected and exhausted events are set aside (nowhere without a sink).
        self.dead_letters = DeadLetters(
            options.quarantine,
            poller=poller,
            owner_id=options.owner_id,
            clock=options.clock,
            retry=options.retry,
            telemetry=options.telemetry,
        )
        #: Parallel lanes (``max_concurrency > 1``): see :mod:`dbtrigger.runtime.kernel`.
        concurrency = options.max_concurrency
        self.lanes = Lanes(concurrency, name=poller) if concurrency > 1 else None
        #: Says that events (``poison_event``) or a batch (``poison_batch``) cannot
        #: settle, once and then now and then.
        self.poison = PoisonReport(options.telemetry, options.clock, options.max_attempts)

    def close(self) -> None:
        """Shut the lane pool down (it starts again on the next batch)."""
        if self.lanes is not None:
            self.lanes.close()

    @property
    def overlaps(self) -> bool:
        """Does the handler run off the tick's thread, so that the tick can read
        the next batch meanwhile (``deliver(..., meanwhile=)``)?"""
        return self.lanes is not None

    def fan_out_set(self) -> tuple[str, ...] | None:
        """The subscribers' names, sorted (fan-out); None for one handler."""
        return None

    def holding(self, window: Window) -> frozenset[str] | None:
        """Window keys of waiting events to leave out of the next batch (None:
        hand out nothing now). None held for a handler; fan-out holds events
        only busy or removed subscribers owe, and everything while every
        subscriber is busy."""
        del window
        return frozenset()

    def under_timer(self) -> None:
        """A timer firing drives the ticks (a Functions invocation); nothing changes
        for one handler (fan-out: :meth:`~dbtrigger.runtime.subscribers.FanOut.under_timer`)."""

    def deliver(
        self,
        handler: Handler,
        events: list[RowChange],
        done: frozenset[str],
        ctx: BatchContext,
        wants_ctx: bool,
        meanwhile: Callable[[], None] | None = None,
    ) -> Outcome:
        """Hand the batch over and say whether every row is settled.

        A row is settled when the handler processed it (now, or on an earlier
        delivery: ``done``) or it was quarantined; per-event marks
        (``ctx.reject`` / ``ctx.retry``) are settled here too, rejected events
        written to the dead-letter sink before the outcome is returned.

        With lanes, ``meanwhile`` runs on this thread while the first handler
        call's lanes run (the tick's prefetch); it may not run at all (no call,
        or no lanes).

        Raises:
            LostLeaseError: the lease was lost; nothing may be written.
        """
        marks = ctx.marks
        try:
            # Ids only matter when an earlier delivery settled some rows; an event
            # computes its id on first read, so the usual batch never computes one.
            pending = [e for e in events if e.event_id not in done] if done else list(events)
            if len(pending) < len(events):
                self.telemetry.emit(
                    "rows_skipped_done",
                    "skipping %d row(s) processed on an earlier delivery of this batch",
                    len(events) - len(pending),
                    batch_id=ctx.batch_id,
                    rows=len(events) - len(pending),
                )
            error: Exception | None = None
            if pending:
                try:
                    self._invoke(handler, pending, ctx, wants_ctx, meanwhile)
                except LostLeaseError:
                    raise
                except Exception as exc:  # handler failures are sorted out by _failed
                    if marks is not None and marks.misuse is exc:
                        raise  # the misuse itself, let through: not its own cause
                    if marks is not None and marks.misuse is not None:
                        raise marks.misuse from exc
                    error = exc
            outcome = (
                Delivered()
                if error is None
                else self._failed(handler, events, pending, done, ctx, wants_ctx, error)
            )
        finally:
            if marks is not None:
                marks.close()
        if marks is not None and marks.misuse is not None:
            # ctx.reject/retry misused: a bug to fix, not a batch to retry.
            raise marks.misuse
        if isinstance(outcome, Delivered) and marks is not None:
            return self._apply_marks(ctx, events, outcome, marks)
        return outcome

    def _failed(
        self,
        handler: Handler,
        events: list[RowChange],
        pending: list[RowChange],
        done: frozenset[str],
        ctx: BatchContext,
        wants_ctx: bool,
        error: Exception,
    ) -> Outcome:
        """What the failed call on ``pending`` (``events`` less the rows ``done``
        on an earlier delivery) makes of the batch: the rows a
        :class:`~dbtrigger.errors.PartialBatchError` names or, once it is time,
        the rows bisection finds failing alone; the verdict on them."""
        emit = self.telemetry.emit
        succeeded: list[RowChange] = []
        failed: list[tuple[RowChange, BaseException]] = []
        if isinstance(error, PartialBatchError):
            failed = match_failed(pending, error)
            failed_ids = {e.event_id for e, _ in failed}
            succeeded = [e for e in pending if e.event_id not in failed_ids]
        named = bool(failed)
        if not named:
            failed = [(e, error) for e in pending]
        aborted = False
        # A lock waited on too long, a lost connection: not the rows' fault, never poison.
        passing = any(transient(exc) for _, exc in failed)
        if not passing and should_isolate(
            attempt=ctx.attempt,
            max_attempts=self.max_attempts,
            has_sink=self.quarantine is not None,
            named=named,
            pending=len(pending),
        ):
            found = isolate(
                pending,
                lambda part: self._invoke(handler, part, ctx, wants_ctx),
                first_error=error,
                limit=self.quarantine_limit,
                check=lambda: check_lease(ctx),
            )
            succeeded, failed, aborted = found.ok, found.bad, found.aborted
            passing = any(transient(exc) for _, exc in failed)
            emit(
                "batch_bisected",
                "bisected batch %s in %d handler calls: %d row(s) fail alone, %d passed%s",
                ctx.batch_id,
                found.calls,
                len(failed),
                len(succeeded),
                " (stopped: too many failing rows for poison, looks like an outage)"
                if aborted
                else "",
                batch_id=ctx.batch_id,
                calls=found.calls,
            )
        settled = frozenset(done) | {e.event_id for e in succeeded}
        if ctx.marks is not None:
            # Rows that passed a bisection part but were marked are not settled
            # by a failed batch: they come back with it.
            rejected, retried = ctx.marks.snapshot()
            settled = settled - rejected.keys() - retried.keys()
        verdict = judge(
            rows=len(events),
            settled=len(settled),
            failed=len(failed),
            aborted=aborted,
            attempt=ctx.attempt,
            max_attempts=self.max_attempts,
            has_sink=self.quarantine is not None,
            quarantine_limit=self.quarantine_limit,
            transient_failure=passing,
        )
        if verdict is Verdict.SETTLED:
            return Delivered()
        if verdict is Verdict.QUARANTINE:
            try:  # the rows that fail alone, durably in the sink before the checkpoint passes
                self.dead_letters.write(ctx, failed, ctx.attempt)
            except QuarantineError as exc:
                return Undelivered(exc, settled, exc)
            return Delivered(quarantined=len(failed))
        self._report_failure(ctx, events, error, failed, verdict, passing)
        handler_error = HandlerError(
            f"handler failed on batch {ctx.batch_id}: {type(error).__name__}: {error}",
            poller=self.poller,
            batch_id=ctx.batch_id,
            fencing_token=ctx.fencing_token,
            failed_rows=len(failed),
        )
        handler_error.__cause__ = error
        return Undelivered(error, settled, handler_error)

    def _invoke(
        self,
        handler: Handler,
        events: list[RowChange],
        ctx: BatchContext,
        wants_ctx: bool,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """One handler call on ``events`` (over the lanes, if any), reported; a
        failed call takes the ``ctx.reject`` / ``ctx.retry`` marks it made with it."""
        emit = self.telemetry.emit
        if self.telemetry.logs("batch_start"):  # (its fields encode two positions)
            emit("batch_start", "batch of %d rows", len(events), **batch_fields(ctx, len(events)))
        started = time.perf_counter()

        def one(part: list[RowChange]) -> None:
            kernel.call(handler, part, ctx, wants_ctx, cancelled_error)

        with ctx.marks.undone_on_failure() if ctx.marks is not None else nullcontext():
            try:
                if self.lanes is None or getattr(handler, "alone", False):
                    one(events)  # (rows handed alone to find a killer: one after another)
                else:
                    self.lanes.run(events, one, meanwhile)
            except LostLeaseError:
                emit(
                    "lease_lost", "lease lost during the handler", **batch_fields(ctx, len(events))
                )
                raise
            except Exception as exc:
                emit("handler_returned", values={"seconds": time.perf_counter() - started})
                if not ctx.lease_lost.is_set():
                    raise
                # The handler gave up because it saw ctx.cancelled: that is the lost
                # lease, not a failure of the batch (no attempt is counted).
                raise self._lost_during_handler(
                    ctx,
                    batch_fields(ctx, len(events)),
                    f"it stopped with {type(exc).__name__}; nothing committed",
                ) from exc
            emit("handler_returned", values={"seconds": time.perf_counter() - started})
            if ctx.lease_lost.is_set():
                raise self._lost_during_handler(
                    ctx, batch_fields(ctx, len(events)), "results discarded"
                )

    def _apply_marks(
        self, ctx: BatchContext, events: list[RowChange], outcome: Delivered, marks: EventMarks
    ) -> Outcome:
        """Settle the per-event marks of a delivered batch: rejected events, and
        retried ones on their last attempt, go to the dead-letter sink (one
        write) before anything counts as settled."""
        rejected, retried = marks.snapshot()
        if not rejected and not retried:
            return outcome
        exhausted = {i for i in retried if marks.attempts.get(i, 0) + 1 >= self.max_attempts}
        by_id = {e.event_id: e for e in events}
        doomed: list[tuple[RowChange, BaseException]] = [
            (by_id[i], EventRejected(reason)) for i, reason in rejected.items()
        ]
        if self.quarantine is not None:
            doomed += [
                (by_id[i], RetriesExhausted(retried[i]))
                for i in sorted(exhausted, key=list(by_id).index)
            ]
        else:
            again = [
                i for i in by_id if i in exhausted and marks.attempts.get(i, 0) >= self.max_attempts
            ]
            self.poison.again(ctx, again)
            for i in exhausted.difference(again):
                self.telemetry.emit(
                    "poison_event",
                    "event %s was retried on all %d attempts (%s); configure a dead-letter "
                    "(quarantine) sink or settle it by hand: it holds the checkpoint back",
                    i,
                    marks.attempts.get(i, 0) + 1,
                    retried[i],
                    batch_id=ctx.batch_id,
                    event_id=i,
                    attempt=marks.attempts.get(i, 0) + 1,
                )
            exhausted = set()
        if doomed:
            try:
                attempts = {i: marks.attempts.get(i, 0) + 1 for i in by_id}
                self.dead_letters.write(ctx, doomed, attempts)
            except QuarantineError as exc:
                settled = frozenset(by_id) - rejected.keys() - retried.keys()
                return Undelivered(exc, settled, exc)
        waiting = {i: r for i, r in retried.items() if i not in exhausted}
        return Delivered(
            quarantined=outcome.quarantined,
            rejected=rejected,
            retried=waiting,
            exhausted=frozenset(exhausted),
            delays={i: d for i, d in marks.delays.items() if i in waiting},
        )

    def _lost_during_handler(
        self, ctx: BatchContext, fields: dict[str, Any], what: str
    ) -> LostLeaseError:
        """Report a lease lost while the handler ran; the error to raise."""
        self.telemetry.emit("lease_lost", "lease lost while the handler ran", **fields)
        return lease_lost(
            ctx, f"lease lost while the handler ran ({what}); the batch will be redelivered"
        )

    def _report_failure(
        self,
        ctx: BatchContext,
        events: list[RowChange],
        error: BaseException,
        failed: list[tuple[RowChange, BaseException]],
        verdict: Verdict,
        passing: bool = False,
    ) -> None:
        fields = batch_fields(ctx, len(events))
        self.telemetry.emit(
            "handler_failed",
            "handler failed on batch %s (attempt %d, %d of %d rows failed): %s: %s",
            ctx.batch_id,
            ctx.attempt,
            len(failed),
            len(events),
            type(error).__name__,
            error,
            error=type(error).__name__,
            failed_rows=len(failed),
            **fields,
        )
        if verdict is not Verdict.RETRY:
            target = self.cli_target()
            # skip-batch reads the source to check the batch: naming only the store
            # (a trigger with no import path) it refuses, so the command asks for one.
            skip = target if " --source " in target else f"{self.poller} --source MODULE:ATTR"
            start = ctx.checkpoint_before
            # ERROR once per poison batch, then a reminder now and then (poison_report).
            self.poison.batch(
                ctx,
                events,
                verdict.value,
                "batch starting at %s has failed %d times%s",
                "the beginning" if start.is_beginning else start.cursor,
                ctx.attempt,
                "; configure a quarantine sink or skip it by hand (the poller cannot pass it). "
                f"Inspect: {pasteable(f'dbtrigger status {target}')}  "
                "Skip (data loss, journaled): "
                + pasteable(f"dbtrigger skip-batch {skip} --reason 'poison batch' --yes")
                + ("" if skip == target else " (MODULE:ATTR: where this trigger is defined)")
                if verdict is Verdict.POISON
                else "; on a transient error (a lock waited on too long, a lost connection), "
                "which says nothing about its rows: not poison, nothing set aside, retrying"
                if passing
                else "; no row of it passes (or more than quarantine_limit fail on their "
                "own), which looks like an outage, not poison: nothing set aside, retrying",
                **fields,
            )


def cancelled_error(ctx: BatchContext) -> Exception:
    """What an async handler cancelled by ``ctx.cancelled`` raises once it stopped:
    the lost lease, or (fan-out) this subscriber's ack timeout."""
    if not ctx.lease_lost.is_set():
        return AckTimeoutError(
            "the subscriber outlived ack_timeout_seconds; its task was cancelled",
            poller=ctx.poller_name,
            batch_id=ctx.batch_id,
        )
    return lease_lost(ctx, "lease lost while the async handler ran; it was cancelled")
