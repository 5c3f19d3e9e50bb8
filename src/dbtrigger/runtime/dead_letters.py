"""Setting events aside: a poller's dead-letter (quarantine) writes, durable and reported.

A batch's events go to the sink - one :class:`~dbtrigger.quarantine.QuarantineRecord`
each, built by the delivery kernel (:func:`dbtrigger.runtime.kernel.dead_letter_records`) -
when they fail alone after ``max_attempts`` (poison rows), when the handler
rejects them (``ctx.reject``), or when it asked to retry them on every attempt.
The write is one ``put``, retried under the tick's policy, and it happens
*before* the checkpoint moves past the events: an event is never settled
without its record. Each record is then reported (``row_quarantined``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass

from dbtrigger.errors import LostLeaseError, QuarantineError
from dbtrigger.events import RowChange
from dbtrigger.quarantine import QuarantineRecord, QuarantineSink, put_records
from dbtrigger.runtime import kernel
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.runtime.telemetry import Telemetry


def lease_lost(ctx: BatchContext, message: str) -> LostLeaseError:
    """The :class:`~dbtrigger.errors.LostLeaseError` that ends ``ctx``'s batch:
    ``message`` with the poller, the batch and its fencing token."""
    return LostLeaseError(
        message, poller=ctx.poller_name, batch_id=ctx.batch_id, fencing_token=ctx.fencing_token
    )


def check_lease(ctx: BatchContext) -> None:
    """Raise :class:`~dbtrigger.errors.LostLeaseError` once the lease of ``ctx``'s
    batch is lost: nothing of it may be written or set aside any more."""
    if ctx.lease_lost.is_set():
        raise lease_lost(
            ctx, "lease lost while the batch was being processed; nothing was committed"
        )


class EventRejected(Exception):
    """The handler rejected the event (``ctx.reject``); the text is its reason."""


class RetriesExhausted(Exception):
    """The handler asked to retry the event on every one of ``max_attempts`` deliveries."""


@dataclass(eq=False, repr=False)
class DeadLetters:
    """One poller's dead-letter writes (none without a sink); see the module docstring."""

    sink: QuarantineSink | None
    _: KW_ONLY
    poller: str
    owner_id: str
    clock: Callable[[], dt.datetime]
    retry: RetryPolicy
    telemetry: Telemetry

    def write(
        self,
        ctx: BatchContext,
        failed: list[tuple[RowChange, BaseException]],
        attempts: Mapping[str, int] | int,
        subscribers: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        """Write ``failed`` (event, why) to the sink in one ``put``, then report each;
        nothing without a sink or events, and never once the lease is lost.
        ``subscribers`` (fan-out): event id -> who did not take it, and why.

        Raises:
            LostLeaseError: the lease was lost; nothing may be written.
            QuarantineError: the sink kept refusing; nothing may be settled.
        """
        sink = self.sink
        if sink is None or not failed:
            return
        check_lease(ctx)
        records = kernel.dead_letter_records(
            failed,
            trigger=self.poller,
            attempts=attempts,
            checkpoint=ctx.checkpoint_before,
            batch_id=ctx.batch_id,
            fencing_token=ctx.fencing_token,
            owner_id=self.owner_id,
            now=self.clock(),
            subscribers=subscribers,
        )
        self.retry.call(
            lambda: put_records(sink, records),
            operation="quarantine write",
            kinds=(QuarantineError,),
            on_retry=self.telemetry.on_retry,
            fields={"poller": self.poller, "batch_id": ctx.batch_id},
        )
        self.telemetry.emit("rows_quarantined", values={"count": len(records)})
        for record in records:
            self.telemetry.emit(
                "row_quarantined",
                "%s set aside in %s after %d failed attempts: %s",
                _what(record),
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
                subscribers=sorted(record.subscribers) if record.subscribers else None,
            )


def _what(record: QuarantineRecord) -> str:
    """``row {key}``, or a change log's truncate (no row, every key value None)."""
    pk = record.pk
    if record.row is None and pk and all(v is None for v in pk.values()):
        return f"truncate of every row (cursor {record.cursor})"
    return f"row {pk}"
