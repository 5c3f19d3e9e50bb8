"""What happens to one batch: the handler call, and every way it can fail.

:class:`~dbtrigger.runtime.poller.PollTrigger` owns the tick (read the state,
take the lease, fetch, commit, release); this mixin owns the batch in the
middle of it:

* calling the handler - sync or async, with the lease-lost flag turned into a
  real cancellation of an async handler (:func:`guarded`);
* sorting out a failure: a :class:`~dbtrigger.errors.PartialBatchError` names
  its failed rows, anything else fails the whole batch; once a batch has
  failed ``max_attempts`` times and a quarantine sink is configured, it is
  bisected and rows that fail alone are written to the sink;
* recording the failed attempt in the state document in one write that also
  releases the lease, and moves the checkpoint over the leading rows that
  were processed (only a contiguous head can be passed; processed rows after
  the first failed one are remembered in the failure record and skipped when
  the batch comes back, so they are not delivered twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    HandlerError,
    LostLeaseError,
    PartialBatchError,
    QuarantineError,
)
from dbtrigger.events import RowChange
from dbtrigger.metrics import SafeMetrics
from dbtrigger.quarantine import QuarantineRecord, QuarantineSink, isolate, match_failed
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.sources.base import position_of
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod

log = logging.getLogger("dbtrigger.runtime")

#: A batch handler: ``handler(events)`` or ``handler(events, ctx)``, sync or async.
Handler = Callable[..., Any]


class BatchDelivery:
    """Mixin for :class:`~dbtrigger.runtime.poller.PollTrigger`: invoke, settle, fail.

    It relies on the trigger's configuration attributes declared below.
    """

    name: str
    owner_id: str
    clock: Callable[[], dt.datetime]
    metrics: SafeMetrics
    retry: RetryPolicy
    quarantine: QuarantineSink | None
    max_attempts: int
    quarantine_limit: int
    journal_limit: int

    def _log(self, level: int, event: str, msg: str, *args: Any, **fields: Any) -> None:
        """Log ``event`` with structured fields, attributed to the calling line."""
        if log.isEnabledFor(level):
            log.log(
                level,
                msg,
                *args,
                extra={"event": event, "poller": self.name, **fields},
                stacklevel=2,
            )

    def _on_retry(self, operation: str, attempt: int, exc: BaseException, wait: float) -> None:
        del attempt, wait
        self.metrics.increment(
            "retries_total", labels={"operation": operation, "error_type": type(exc).__name__}
        )

    def _check_lost(self, ctx: BatchContext) -> None:
        if ctx.lease_lost.is_set():
            raise LostLeaseError(
                "lease lost while the batch was being processed; nothing was committed",
                poller=self.name,
                batch_id=ctx.batch_id,
                fencing_token=ctx.fencing_token,
            )

    def _invoke(
        self,
        session: LeaseSession,
        handler: Handler,
        events: list[RowChange],
        ctx: BatchContext,
        wants_ctx: bool,
    ) -> None:
        fields = {
            "batch_id": ctx.batch_id,
            "fencing_token": ctx.fencing_token,
            "checkpoint_before": docmod.position_to_json(ctx.checkpoint_before),
            "checkpoint_after": docmod.position_to_json(ctx.checkpoint_after),
            "rows": len(events),
            "attempt": ctx.attempt,
        }
        self._log(logging.DEBUG, "batch_start", "batch of %d rows", len(events), **fields)
        started = time.perf_counter()
        try:
            result = handler(events, ctx) if wants_ctx else handler(events)
            if inspect.isawaitable(result):
                run_awaitable(result, ctx)
        except LostLeaseError:
            session.lost = True
            self.metrics.increment("batches_total", labels={"result": "lost"})
            self.metrics.increment("failures_total", labels={"error_type": "LostLeaseError"})
            self._log(logging.WARNING, "lease_lost", "lease lost during the handler", **fields)
            raise
        except Exception as exc:
            self.metrics.observe("handler_duration_seconds", time.perf_counter() - started)
            if not ctx.lease_lost.is_set():
                raise
            # The handler gave up because it saw ctx.cancelled: that is the lost
            # lease, not a failure of the batch (no attempt is counted).
            raise self._lost_during_handler(
                session,
                ctx,
                fields,
                f"it stopped with {type(exc).__name__}; nothing committed",
            ) from exc
        self.metrics.observe("handler_duration_seconds", time.perf_counter() - started)
        if ctx.lease_lost.is_set():
            raise self._lost_during_handler(session, ctx, fields, "results discarded")

    def _lost_during_handler(
        self, session: LeaseSession, ctx: BatchContext, fields: dict[str, Any], what: str
    ) -> LostLeaseError:
        """Account for a lease lost while the handler ran; the error to raise."""
        session.lost = True
        self.metrics.increment("batches_total", labels={"result": "lost"})
        self.metrics.increment("failures_total", labels={"error_type": "LostLeaseError"})
        self._log(logging.WARNING, "lease_lost", "lease lost while the handler ran", **fields)
        return LostLeaseError(
            f"lease lost while the handler ran ({what}); the batch will be redelivered",
            poller=self.name,
            batch_id=ctx.batch_id,
            fencing_token=ctx.fencing_token,
        )

    def _deliver(
        self,
        session: LeaseSession,
        handler: Handler,
        events: list[RowChange],
        done: frozenset[str],
        ctx: BatchContext,
        wants_ctx: bool,
    ) -> int:
        """Hand the batch over; return normally only when every row is settled.

        A row is settled when the handler processed it (now, or on an earlier
        delivery: ``done``) or it was quarantined; the return value is how many
        were quarantined. Otherwise the failed attempt is recorded - with the
        checkpoint moved over the leading settled rows and the settled rows
        after them remembered - and :class:`HandlerError` is raised.
        """
        pending = [e for e in events if e.event_id not in done]
        if len(pending) < len(events):
            self._log(
                logging.INFO,
                "rows_skipped_done",
                "skipping %d row(s) processed on an earlier delivery of this batch",
                len(events) - len(pending),
                batch_id=ctx.batch_id,
                rows=len(events) - len(pending),
            )
        if not pending:
            return 0
        try:
            self._invoke(session, handler, pending, ctx, wants_ctx)
            return 0
        except LostLeaseError:
            raise
        except Exception as exc:  # noqa: BLE001 - handler failures are sorted out below
            error: Exception = exc

        succeeded: list[RowChange] = []
        failed: list[tuple[RowChange, BaseException]] = []
        if isinstance(error, PartialBatchError):
            failed = match_failed(pending, error)
            failed_ids = {e.event_id for e, _ in failed}
            succeeded = [e for e in pending if e.event_id not in failed_ids]
        named = bool(failed)
        if not named:
            failed = [(e, error) for e in pending]
        poison = ctx.attempt >= self.max_attempts
        aborted = False
        if poison and self.quarantine is not None and not named and len(pending) > 1:
            found = isolate(
                pending,
                lambda part: self._invoke(session, handler, part, ctx, wants_ctx),
                first_error=error,
                limit=self.quarantine_limit,
                check=lambda: self._check_lost(ctx),
            )
            succeeded, failed, aborted = found.ok, found.bad, found.aborted
            self._log(
                logging.WARNING,
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
        settled = set(done) | {e.event_id for e in succeeded}
        # Poison is a row that fails while its neighbours pass (now, or on an
        # earlier delivery). When no row of a multi-row batch has passed, or
        # more than the limit fail on their own, the handler's dependency is
        # down: setting the rows aside would empty the source into the sink.
        # Keep retrying instead.
        outage = aborted or len(failed) > self.quarantine_limit
        outage = outage or (len(events) > 1 and not settled)
        if poison and self.quarantine is not None and not outage:
            try:
                self._quarantine(ctx, failed)
                return len(failed)
            except QuarantineError as exc:
                self._record_failure(session, ctx, exc, events=events, settled=settled)
                raise
        self._handler_failed(session, ctx, events, error, failed, settled)
        raise HandlerError(
            f"handler failed on batch {ctx.batch_id}: {type(error).__name__}: {error}",
            poller=self.name,
            batch_id=ctx.batch_id,
            fencing_token=ctx.fencing_token,
            failed_rows=len(failed),
        ) from error

    def _handler_failed(
        self,
        session: LeaseSession,
        ctx: BatchContext,
        events: list[RowChange],
        error: BaseException,
        failed: list[tuple[RowChange, BaseException]],
        settled: set[str],
    ) -> None:
        fields = {
            "batch_id": ctx.batch_id,
            "fencing_token": ctx.fencing_token,
            "checkpoint_before": docmod.position_to_json(ctx.checkpoint_before),
            "checkpoint_after": docmod.position_to_json(ctx.checkpoint_after),
            "rows": len(events),
            "attempt": ctx.attempt,
        }
        self.metrics.increment("batches_total", labels={"result": "failed"})
        self.metrics.increment("failures_total", labels={"error_type": "HandlerError"})
        self._log(
            logging.ERROR,
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
        if ctx.attempt >= self.max_attempts:
            self._log(
                logging.ERROR,
                "poison_batch",
                "batch starting at %s has failed %d times%s",
                ctx.checkpoint_before.cursor,
                ctx.attempt,
                "; configure a quarantine sink or skip it by hand (the poller cannot pass it)"
                if self.quarantine is None
                else "; no row of it passes (or more than quarantine_limit fail on their "
                "own), which looks like an outage, not poison: nothing set aside, retrying",
                **fields,
            )
        self._record_failure(session, ctx, error, events=events, settled=settled)

    def _quarantine(self, ctx: BatchContext, failed: list[tuple[RowChange, BaseException]]) -> None:
        """Record the rows that fail alone in the sink (durably) before the
        checkpoint moves past them."""
        sink = self.quarantine
        if sink is None or not failed:
            return
        self._check_lost(ctx)
        now = self.clock()
        records = [
            QuarantineRecord.from_event(
                event,
                poller=self.name,
                error=exc,
                attempts=ctx.attempt,
                checkpoint=ctx.checkpoint_before,
                batch_id=ctx.batch_id,
                fencing_token=ctx.fencing_token,
                owner_id=self.owner_id,
                now=now,
            )
            for event, exc in failed
        ]
        self.retry.call(
            lambda: sink.put(records),
            operation="quarantine write",
            kinds=(QuarantineError,),
            on_retry=self._on_retry,
            fields={"poller": self.name, "batch_id": ctx.batch_id},
        )
        self.metrics.increment("quarantined_total", len(records))
        for record in records:
            self._log(
                logging.WARNING,
                "row_quarantined",
                "row %s set aside in %s after %d failed attempts: %s",
                record.pk,
                sink.describe(),
                record.attempts,
                record.error,
                batch_id=ctx.batch_id,
                fencing_token=ctx.fencing_token,
                event_id=record.event_id,
                pk=record.pk,
                cursor=record.cursor,
                sink=sink.describe(),
                attempt=record.attempts,
            )

    def _record_failure(
        self,
        session: LeaseSession,
        ctx: BatchContext,
        exc: BaseException,
        *,
        events: Sequence[RowChange] = (),
        settled: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """Count the failed attempt and release the lease, in one write.

        The checkpoint can only move over a *contiguous* run of settled rows at
        the head of the batch; settled rows after the first unsettled one are
        written to the failure record instead, and skipped on redelivery.
        """
        now = self.clock()
        head = 0
        while head < len(events) and events[head].event_id in settled:
            head += 1
        advance_to = position_of(events[head - 1]) if head else None
        done = tuple(e.event_id for e in events[head:] if e.event_id in settled)
        entry: dict[str, object] | None = None
        if advance_to is not None:
            entry = {
                "type": "partial_commit",
                "batch_id": ctx.batch_id,
                "from": docmod.position_to_json(ctx.checkpoint_before),
                "to": docmod.position_to_json(advance_to),
                "rows": head,
                "owner_id": self.owner_id,
                "fencing_token": session.token,
                "committed_at": docmod.format_time(now),
            }
        try:
            session.update(
                lambda d: leasemod.decide_failure(
                    d,
                    owner=self.owner_id,
                    token=session.token,
                    now=now,
                    error=f"{type(exc).__name__}: {exc}",
                    batch_id=ctx.batch_id,
                    advance_to=advance_to,
                    row_count=head,
                    done=done,
                    journal_entry=entry,
                    journal_limit=self.journal_limit,
                ),
                what="failure record",
            )
            session.released = True
            if advance_to is not None:
                self.metrics.increment("events_total", head)
                self._log(
                    logging.INFO,
                    "batch_partially_committed",
                    "committed the first %d of %d rows of batch %s; %d later row(s) "
                    "remembered as done",
                    head,
                    len(events),
                    ctx.batch_id,
                    len(done),
                    batch_id=ctx.batch_id,
                    fencing_token=session.token,
                    rows=head,
                    cursor=docmod.position_to_json(advance_to),
                )
        except DbTriggerError as record_exc:
            # The failure itself is what matters; the lease expires on its own.
            self._log(
                logging.WARNING,
                "failure_record_failed",
                "could not record the failed attempt: %s",
                record_exc,
            )


#: How often an async handler's guard looks at the lease-lost flag.
CANCEL_POLL_SECONDS = 0.05


async def guarded(awaitable: Awaitable[Any], ctx: BatchContext) -> Any:
    """Await an async handler, cancelling it as soon as the lease is lost.

    The task is cancelled *and awaited*, so when the tick reports the lost
    lease the handler has really stopped (no side effect runs after it).
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            if ctx.lease_lost.is_set():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise LostLeaseError(
                    "lease lost while the async handler ran; it was cancelled",
                    poller=ctx.poller_name,
                    batch_id=ctx.batch_id,
                    fencing_token=ctx.fencing_token,
                )
            await asyncio.wait({task}, timeout=CANCEL_POLL_SECONDS)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def run_awaitable(awaitable: Awaitable[Any], ctx: BatchContext) -> Any:
    """Run an async handler's awaitable from the synchronous tick."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(guarded(awaitable, ctx))
    with contextlib.suppress(Exception):
        close = getattr(awaitable, "close", None)
        if close:
            close()
    raise ConfigurationError(
        "an async handler was called from a running event loop; use `await trigger.tick_async(...)`"
    )
