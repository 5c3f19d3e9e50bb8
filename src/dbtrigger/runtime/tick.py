"""One tick, top-down: the I/O in order, every decision delegated.

:class:`TickDriver.run` reads like the contract (``docs/reliability.md``):

1. **Read** the state document (one store read). A live lease held by someone
   else ends the tick here: nothing written.
2. **Fetch** the first batch after the checkpoint *before* taking the lease.
   An idle tick therefore costs one read and no write.
3. **Acquire** the lease with a conditional write on the etag from step 1
   (:meth:`LeaseSession.acquire`). If it wins, nobody committed since our
   read, so the fetched rows are exactly the rows after the committed
   checkpoint. If it loses, another instance got there first.
4. For each batch: **normalise**, **deliver** (:class:`Delivery` calls the
   handler and returns a typed outcome), prefetch the next batch (so we know
   whether this is the last one), then **commit** by CAS. The last commit of
   a tick also releases the lease: a tick with k batches costs 1 read + k + 1
   writes. A batch that did not settle is recorded as a failed attempt, in
   one write that also releases the lease.

   With lanes (``max_concurrency > 1``) the next batch is read *while* the
   lanes run (:class:`Prefetch`), after where this batch leaves the
   checkpoint and window if all of it is accepted. It is used only if the
   batch did leave them exactly there; otherwise (a retry moved the window,
   the batch failed, the lease was lost, the tick stops) it is dropped and,
   if needed, read again: a read has nothing to undo, and the rows are handed
   out only after this batch's commit succeeded under the same lease. The
   storage cost is unchanged (the read is the source's, not the store's).

What to write is always decided by a pure function of :mod:`dbtrigger.state`
(``lease.decide_*``, ``verdict.advance``, ``journal.JournalEntry``); what is
reported is declared once in :mod:`dbtrigger.runtime.telemetry`. Errors an
operator must fix (corrupt state, fingerprint mismatch, unusable credentials,
a broken source definition) always propagate.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger._gc import gc_paused, older_objects_frozen
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import (
    CorruptStateError,
    DbTriggerError,
    FetchError,
    LostLeaseError,
    OperatorError,
    SerializationError,
    StoreError,
    StoreUnavailableError,
)
from dbtrigger.events import RowChange
from dbtrigger.runtime import windowing
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.delivery import Delivered, Delivery, Undelivered
from dbtrigger.runtime.heartbeat import Heartbeat
from dbtrigger.runtime.kernel import Handler, KeepAlive, wants_context
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.runtime.trigger import Outcome, TickResult
from dbtrigger.runtime.window_report import WindowReport
from dbtrigger.runtime.windowing import Selection
from dbtrigger.runtime.writes import StateWriter, WriterSettings
from dbtrigger.sources.base import (
    AcknowledgesCheckpoints,
    FindsNullCursors,
    LocatesRows,
    MeasuresCursorAge,
    MeasuresLag,
    ReportsVisibility,
    SourceAdapter,
    VisibilityReport,
    accepted_fingerprints,
    check_reachable,
    position_of,
    source_definition,
)
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state import window as windowmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.journal import JournalEntry, Outcomes
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.window import Window

DEFAULT_BOUND = windowmod.Bound()

__all__ = ["TickDriver", "TickResult", "TickSettings", "wants_context"]


@dataclass(frozen=True)
class TickSettings:
    """The trigger's configuration, as the driver needs it."""

    name: str
    owner_id: str
    batch_size: int
    max_batches_per_tick: int
    lease_ttl: dt.timedelta
    journal_limit: int
    heartbeat_interval: float
    null_check_interval: float
    retry: RetryPolicy
    bound: windowmod.Bound = DEFAULT_BOUND
    retry_delay: float = 5.0
    retry_delay_max: float = 300.0
    jitter: Callable[[], float] = random.random


class NullCursorProbe:
    """Warns about rows the source cannot deliver because their cursor is NULL.

    Runs on the first tick and then at most every ``interval`` seconds.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -float("inf")

    def run(self, source: SourceAdapter, telemetry: Telemetry) -> None:
        finder = source if isinstance(source, FindsNullCursors) else None
        if finder is None or self.interval <= 0:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        try:
            keys = finder.null_cursor_keys()
        except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the tick
            telemetry.emit("null_check_failed", "NULL-cursor probe failed: %s", exc)
            return
        telemetry.emit("null_cursor_probe", values={"count": len(keys)})
        if keys:
            telemetry.emit(
                "null_cursor_rows",
                "%d%s row(s) have a NULL %s and cannot be delivered until it is set, e.g. %s",
                len(keys),
                "+" if len(keys) >= 10 else "",
                finder.cursor_column,
                keys[:5],
                keys=keys[:10],
            )


@dataclass
class Prefetch:
    """The next batch, read on the tick's thread while the current batch's lanes run.

    ``after`` and ``window`` are where the current batch leaves the checkpoint
    and the settled window if all of its events are accepted; the read is of
    the batch that follows from there. Any error is kept, not raised: the
    lanes are still running, and the read may turn out not to be needed.
    """

    read: Callable[[], Selection | None]
    after: Position
    window: Window
    ran: bool = False
    selection: Selection | None = None
    error: Exception | None = None

    def run(self) -> None:
        self.ran = True
        try:
            self.selection = self.read()
        except Exception as exc:  # noqa: BLE001 - kept for take(), raised if the read is used
            self.error = exc

    def matches(self, after: Position, window: Window) -> bool:
        """Did it run, from where the batch really left the checkpoint and window?"""
        return self.ran and self.after == after and self.window == window

    def take(self) -> tuple[Selection | None, DbTriggerError | None]:
        """The selection, or the read's error (deferred like any fetch error)."""
        if self.error is not None and not isinstance(self.error, DbTriggerError):
            raise self.error
        return self.selection, self.error


def landing(
    position: Position,
    events: Sequence[RowChange],
    selection: Selection,
    settlement: windowmod.Settlement | None,
) -> tuple[Position, Window]:
    """Where a delivered batch leaves the checkpoint and the window."""
    if settlement is None:  # no per-event window in play: the whole batch settled
        return position_of(events[-1]), selection.window
    after = position if settlement.checkpoint is None else settlement.checkpoint
    return after, settlement.window


def batch_id_for(started_at: dt.datetime, token: int, index: int) -> str:
    return f"batch_{started_at:%Y%m%d_%H%M%S}_{token}_{index + 1:04d}"


class TickDriver:
    """Performs ticks for one trigger; holds no state between them except the
    NULL-cursor probe's timer (owned by the trigger)."""

    def __init__(
        self,
        settings: TickSettings,
        *,
        source: SourceAdapter,
        store: CheckpointStore,
        clock: Callable[[], dt.datetime],
        fingerprint: Callable[[], str],
        telemetry: Telemetry,
        delivery: Delivery,
        null_probe: NullCursorProbe,
        keepalive: KeepAlive,
        cli_source: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.settings = settings
        #: ``module:attribute`` naming the trigger, for commands printed in errors.
        self.cli_source = cli_source
        self.writer = StateWriter(
            WriterSettings(
                name=settings.name,
                owner_id=settings.owner_id,
                lease_ttl=settings.lease_ttl,
                journal_limit=settings.journal_limit,
                bound=settings.bound,
            ),
            clock=clock,
            telemetry=telemetry,
            cursor_age=source.cursor_age_seconds if isinstance(source, MeasuresCursorAge) else None,
            lag_after=source.lag_after if isinstance(source, MeasuresLag) else None,
        )
        self.name = settings.name
        self.source = source
        self.store = store
        self.clock = clock
        self.fingerprint = fingerprint
        self.telemetry = telemetry
        self.emit = telemetry.emit
        #: The source holds data until told it is checkpointed (a replication slot).
        self.acknowledges = isinstance(source, AcknowledgesCheckpoints)
        self.delivery = delivery
        self.null_probe = null_probe
        #: The trigger's heartbeat thread (the lease is renewed on it).
        self.keepalive = keepalive
        self.visibility: VisibilityReport | None = None
        #: Rows and batches the current (or last) tick committed so far: what a
        #: tick that fails half way did get done.
        self.committed = (0, 0)
        #: The state etag as last read and when (our clock) it was first read:
        #: how long a lease has stood unchanged, for leases written by a clock
        #: running ahead (see dbtrigger.state.lease.believed_expiry).
        self._seen: tuple[str | None, dt.datetime] | None = None
        self._skew_warned: str | None = None
        self._definition: tuple[dict[str, Any] | None] | None = None
        #: Says when the settled window starts or stops blocking progress.
        self.window_report = WindowReport(settings.name, settings.bound, telemetry)
        #: Hand out no more rows than the window can hold as waiting, even when
        #: it is empty (see dbtrigger.state.window.Settlement.unremembered).
        self._reserve = False

    def definition(self) -> dict[str, Any] | None:
        """The source's readable definition (kept in the document), computed once."""
        if self._definition is None:
            self._definition = (source_definition(self.source),)
        return self._definition[0]

    def _first_seen(self, etag: str | None, now: dt.datetime) -> dt.datetime:
        if self._seen is None or self._seen[0] != etag:
            self._seen = (etag, now)
        return self._seen[1]

    # --- the tick, top-down -------------------------------------------------------------

    def run(self, handler: Handler, should_stop: Callable[[], bool] | None = None) -> TickResult:
        s = self.settings
        started_at = self.clock()
        self.visibility = None
        self.committed = (0, 0)
        self.emit("tick_start", "tick start")
        try:
            doc, etag = self.read()
        except DbTriggerError as exc:
            self.emit("state_read_failed", "state read failed: %s", exc)
            raise

        decision = leasemod.decide_acquire(
            doc,
            poller=self.name,
            fingerprint=self.fingerprint(),
            owner=s.owner_id,
            now=started_at,
            ttl=s.lease_ttl,
            first_seen=self._first_seen(etag, started_at),
            definition=self.definition(),
        )
        if isinstance(decision, leasemod.Busy):
            if decision.skew is not None and self._skew_warned != etag:
                self._skew_warned = etag
                self.emit(
                    "clock_skew_suspected",
                    "the lease of %s (token %s) was written by a clock about %s ahead of "
                    "ours; its expiry is not believed as written: unless its holder "
                    "heartbeats, it is taken over once it has stood unchanged for its own "
                    "TTL (at %s). Check the clocks (NTP) of both hosts",
                    decision.holder,
                    decision.fencing_token,
                    decision.skew,
                    docmod.format_time(decision.free_at),
                    holder=decision.holder,
                    skew_seconds=decision.skew.total_seconds(),
                )
            self.emit(
                "lease_busy",
                "lease held by %s (token %s), %s; skipping tick",
                decision.holder,
                decision.fencing_token,
                decision.reason,
                holder=decision.holder,
                values={"result": "lease_busy"},
            )
            return TickResult(
                0, 0, "lease_busy", holder=decision.holder, lease_until=decision.free_at
            )

        position = doc.position if doc else BEGINNING
        window = (doc.window if doc is not None else None) or Window()
        try:
            selection = self.next_batch(position, window)
        except DbTriggerError as exc:
            self.emit("fetch_failed", "fetch failed: %s", exc)
            raise
        # After the fetch: a source that cannot be read is reported once, by the fetch.
        self.null_probe.run(self.source, self.telemetry)
        if selection is None:
            self.emit("tick_idle", "nothing after the checkpoint")
            self.acknowledge(position)  # the stored checkpoint is durable: nothing after it
            return self.result(0, 0, "idle")

        try:
            session = LeaseSession.acquire(
                self.store,
                self.name,
                decision,
                etag,
                owner=s.owner_id,
                retry=s.retry,
                on_retry=self.telemetry.on_retry,
                on_checkpoint=self.acknowledge if self.acknowledges else None,
            )
        except DbTriggerError as exc:
            self.emit(
                "lease_acquire_failed",
                "lease acquisition failed: %s",
                exc,
                values={"error_type": type(exc).__name__},
            )
            raise
        if session is None:
            self.emit(
                "lease_busy",
                "another instance acquired the lease first",
                reason="lost_race",
                values={"result": "lost_race"},
            )
            return self.result(0, 0, "lost_race")

        lost = threading.Event()
        heartbeat = Heartbeat(
            session,
            interval=s.heartbeat_interval,
            ttl=s.lease_ttl,
            clock=self.clock,
            lost=lost,
            telemetry=self.telemetry,
            keepalive=self.keepalive,
        )
        self.emit(
            "lease_acquired",
            "lease acquired (token %s)",
            decision.fencing_token,
            fencing_token=decision.fencing_token,
        )
        try:
            # See dbtrigger._gc: full collections during the tick skip older objects.
            with older_objects_frozen(), heartbeat:
                return self.batches(
                    session, handler, selection, position, started_at, doc, should_stop, lost
                )
        finally:
            if not session.released and not session.lost:
                self.writer.release(session)

    def batches(
        self,
        session: LeaseSession,
        handler: Handler,
        selection: Selection,
        position: Position,
        started_at: dt.datetime,
        previous: StateDocument | None,
        should_stop: Callable[[], bool] | None,
        lost: threading.Event,
    ) -> TickResult:
        """Deliver and commit batches until one is the last; that commit releases."""
        s = self.settings
        total = 0
        wants_ctx = wants_context(handler)
        failure = leasemod.failure_at(previous, position)
        attempt = failure.attempts + 1 if failure else 1
        if attempt > 1:
            self.emit("redelivery")
        index = 0
        prefetch: Prefetch | None = None
        while True:
            prefetch = None
            # A redelivered batch keeps the id of its first attempt (the failure
            # record holds it), so its log lines correlate across attempts.
            batch_id = (
                failure.batch_id
                if failure is not None and failure.batch_id
                else batch_id_for(started_at, session.token, index)
            )
            events: list[RowChange] = []
            outcome = Delivered()
            settlement = selection.tidy
            if settlement is None:
                events = self.normalise(selection.rows, batch_id, session.token)
                ctx = BatchContext(
                    poller_name=self.name,
                    batch_id=batch_id,
                    batch_index=index,
                    fencing_token=session.token,
                    owner_id=s.owner_id,
                    source_name=self.source.name,
                    checkpoint_before=position,
                    checkpoint_after=position_of(events[-1]),
                    tick_started_at=started_at,
                    attempt=attempt,
                    lease_lost=lost,
                    marks=EventMarks(
                        events,
                        can_reject=self.delivery.quarantine is not None,
                        attempts=windowing.attempts(events, selection.window),
                        owed=windowing.owed(events, selection.window),
                    ),
                )
                done = frozenset(failure.done) if failure else frozenset()
                prefetch = self.prefetch(selection, events, position, index, started_at)
                outcome = self.hand_over(
                    session, handler, wants_ctx, events, done, ctx, selection, prefetch
                )
                settlement = self.settle(selection, events, outcome)
            failure = None
            after, window = landing(position, events, selection, settlement)

            # Prefetch so the last commit can release the lease in the same write.
            following, deferred = self.following(
                selection, index, should_stop, prefetch, after, window
            )
            release = following is None
            entry = JournalEntry.commit(
                batch_id=batch_id,
                before=position,
                after=after,
                rows=len(events),
                owner_id=s.owner_id,
                fencing_token=session.token,
                now=self.clock(),
                started_at=started_at,
                quarantined=outcome.quarantined,
                outcomes=Outcomes(
                    accepted=len(events)
                    - len(outcome.rejected)
                    - len(outcome.retried)
                    - len(outcome.exhausted),
                    rejected=len(outcome.rejected),
                    failed=len(outcome.retried) + len(outcome.exhausted),
                    subscribers=outcome.by_subscriber,
                ),
            )
            self.commit(session, entry, release, settlement)
            # After retries that did not fit the window, batches are cut to what it
            # can hold as waiting, until a batch of new rows retries nothing.
            if settlement is not None and settlement.unremembered:
                self._reserve = True
            elif selection.fresh and not outcome.retried:
                self._reserve = False
            total += len(events)
            self.committed = (total, index + 1)
            position = after
            attempt = 1
            if deferred is not None:
                self.emit(
                    "fetch_failed",
                    "fetch failed: %s",
                    deferred,
                    batch_id=batch_id,
                    fencing_token=session.token,
                )
                raise deferred
            if following is None:
                more = selection.more
                # A short batch was the last one: nothing is pending.
                self.emit("tick_committed", values={"lag_rows": None if more else 0})
                return self.result(total, index + 1, "committed", more=more)
            selection = following
            index += 1

    def following(
        self,
        selection: Selection,
        index: int,
        should_stop: Callable[[], bool] | None,
        prefetch: Prefetch | None,
        after: Position,
        window: Window,
    ) -> tuple[Selection | None, DbTriggerError | None]:
        """The batch after this one (None: this is the tick's last), or the error
        reading it, deferred until this batch is committed. A prefetch read from
        exactly ``after`` and ``window`` is used; any other is dropped."""
        s = self.settings
        stopping = should_stop is not None and should_stop()
        if index + 1 >= s.max_batches_per_tick or not selection.more or stopping:
            return None, None
        if prefetch is not None and prefetch.matches(after, window):
            return prefetch.take()
        try:
            return self.next_batch(after, window), None
        except DbTriggerError as exc:
            return None, exc

    def hand_over(
        self,
        session: LeaseSession,
        handler: Handler,
        wants_ctx: bool,
        events: list[RowChange],
        done: frozenset[str],
        ctx: BatchContext,
        selection: Selection,
        prefetch: Prefetch | None = None,
    ) -> Delivered:
        """Deliver the batch; a batch that did not settle is recorded as a failed
        attempt (one write, which also releases the lease) and its error raised.
        ``prefetch`` runs while the lanes do (a failed batch drops it)."""
        meanwhile = prefetch.run if prefetch is not None else None
        try:
            outcome = self.delivery.deliver(handler, events, done, ctx, wants_ctx, meanwhile)
        except LostLeaseError:
            session.lost = True
            raise
        if isinstance(outcome, Undelivered):
            # Per-key order: what follows an unsettled event of its key comes again after it.
            settled = windowing.in_key_order(events, outcome.settled)
            self.writer.record_failure(
                session,
                ctx,
                outcome.cause,
                events,
                settled,
                windowing.settle_failed(selection, events, settled, self.settings.bound),
            )
            raise outcome.error
        return outcome

    # --- choosing a batch, settling it ------------------------------------------------

    def prefetch(
        self,
        selection: Selection,
        events: list[RowChange],
        position: Position,
        index: int,
        started_at: dt.datetime,
    ) -> Prefetch | None:
        """The read of the batch after this one, to run while its lanes run.

        None when the handler runs on this thread (no lanes, no subscribers:
        nothing can overlap it) or when no further batch will be read this tick. The
        landing is computed for "every event accepted": no retry, so ``now``
        and the jitter play no part.
        """
        s = self.settings
        if not self.delivery.overlaps or not selection.more:
            return None
        if index + 1 >= s.max_batches_per_tick:
            return None
        accepted = windowing.settle_delivered(
            selection,
            events,
            {},
            now=started_at,
            bound=s.bound,
            backoff=(s.retry_delay, s.retry_delay_max),
            jitter=s.jitter,
        )
        after, window = landing(position, events, selection, accepted)
        return Prefetch(lambda: self.next_batch(after, window), after, window)

    def next_batch(self, position: Position, window: Window) -> Selection | None:
        """Read after ``position`` and choose the next batch (None: nothing to do).

        Without a per-event window this is the plain read of ``batch_size``
        rows. With one, the read also covers the window (its rows come back
        after the checkpoint too) and :func:`dbtrigger.runtime.windowing.choose`
        picks the rows to hand out: new ones, due retries, late arrivals.
        """
        s = self.settings
        held = self.delivery.holding(window)
        if held is None:
            return None  # fan-out: every subscriber is busy (said once, at WARNING)
        limit = s.batch_size + len(window)
        rows = self.fetch(position, limit)
        positions = None
        if (window or self._reserve) and rows:
            positions = [position_of(e) for e in self.normalise(rows, "plan", 0)]
        selection, view = windowing.choose(
            rows,
            positions,
            window,
            limit=limit,
            batch_size=s.batch_size,
            bound=s.bound,
            now=self.clock(),
            locate=self._locate if isinstance(self.source, LocatesRows) else None,
            hold=held,
            reserve=self._reserve,
        )
        self.window_report.report(view)
        return selection

    def _locate(self, positions: Sequence[Position]) -> Sequence[Position]:
        """The source's lookup of window entries a read could not place; on a
        failure every entry is kept (asked again when the window next blocks)."""
        assert isinstance(self.source, LocatesRows)  # noqa: S101 - checked by the caller
        source = self.source
        try:
            return self.settings.retry.call(
                lambda: source.present(positions),
                operation="window lookup",
                kinds=(FetchError,),
                on_retry=self.telemetry.on_retry,
                fields={"poller": self.name},
            )
        except FetchError as exc:
            self.emit(
                "window_lookup_failed",
                "looking up %d settled-window entries failed (kept; asked again while the "
                "window blocks): %s",
                len(positions),
                exc,
            )
            return positions

    def settle(
        self, selection: Selection, events: Sequence[RowChange], outcome: Delivered
    ) -> windowmod.Settlement | None:
        s = self.settings
        return windowing.settle_delivered(
            selection,
            events,
            outcome.retried,
            now=self.clock(),
            bound=s.bound,
            backoff=(s.retry_delay, s.retry_delay_max),
            jitter=s.jitter,
            owed=outcome.owed,
            terminal=outcome.dead_lettered,
            deferred=outcome.deferred,
            delays=outcome.delays,
        )

    def commit(
        self,
        session: LeaseSession,
        entry: JournalEntry,
        release: bool,
        settlement: windowmod.Settlement | None,
    ) -> None:
        """The batch's one write, then what it changed, reported."""
        window: leasemod.WindowUpdate = leasemod.KEEP
        if settlement is not None:
            window = dataclasses.replace(settlement.window, bound=self.settings.bound)
        self.writer.commit(session, entry, release, window)
        outcomes = entry.outcomes
        if outcomes is not None:
            self.emit(
                "event_outcomes",
                values={
                    "accepted": outcomes.accepted,
                    "rejected": outcomes.rejected,
                    "failed": outcomes.failed,
                },
            )
            for name, sub in outcomes.subscribers.items():
                self.emit("subscriber_outcomes", subscriber=name, values=sub.counts())
        if settlement is None:
            return
        self.emit(
            "window_changed",
            values={
                "events": len(settlement.window),
                "bytes": settlement.window.encoded_size(),
            },
        )
        if settlement.overflow or settlement.unremembered:
            self.emit(
                "window_overflow",
                "the settled window is full (bound %d events / %d bytes): of batch %s, %d "
                "settled event(s) could not be remembered and will be delivered again, and "
                "%d event(s) asked to retry could not be remembered as waiting and will be "
                "delivered again at once, without a backoff, that delivery not counted as "
                "an attempt. Batches are cut to what the window can hold as waiting until "
                "one retries nothing; raise window_max_events / window_max_bytes or lower "
                "batch_size",
                self.settings.bound.max_events,
                self.settings.bound.max_bytes,
                entry.batch_id,
                settlement.overflow,
                settlement.unremembered,
                batch_id=entry.batch_id,
                unremembered=settlement.unremembered,
                values={"count": settlement.overflow + settlement.unremembered},
            )

    # --- the I/O steps ----------------------------------------------------------------

    def acknowledge(self, position: Position) -> None:
        """Tell a source that holds data until it is checkpointed that ``position`` is durable.

        Called once a write that moved the checkpoint landed, and on an idle
        tick with the stored checkpoint (:class:`AcknowledgesCheckpoints`). A
        failure to release is the source's to retry: the checkpoint stands.
        """
        if not self.acknowledges:
            return
        try:
            self.source.acknowledge(position)  # type: ignore[attr-defined]
        except DbTriggerError as exc:
            self.emit(
                "acknowledge_failed",
                "the source could not release what it holds up to %s: %s",
                position.cursor,
                exc,
            )

    def read(self) -> tuple[StateDocument | None, str | None]:
        s = self.settings
        try:
            stored = s.retry.call(
                lambda: self.store.read(self.name),
                operation="state read",
                kinds=(StoreUnavailableError,),
                on_retry=self.telemetry.on_retry,
                fields={"poller": self.name},
            )
        except OperatorError:
            raise
        except StoreError as exc:
            self.emit("state_read_error")
            raise FetchError(
                f"could not read the state of poller {self.name!r}: {exc}", poller=self.name
            ) from exc
        if stored is None:
            return None, None
        doc = docmod.loads(stored.data)
        if doc.poller_name != self.name:
            raise CorruptStateError(
                f"state document under {self.name!r} belongs to poller {doc.poller_name!r}",
                poller=self.name,
            )
        if doc.source_fingerprint != self.fingerprint():
            # Only on a mismatch: older fingerprints of the same definition
            # (an earlier algorithm) still name this source.
            also = accepted_fingerprints(self.source)
            if doc.source_fingerprint not in also:
                # A typo (a port nothing listens on) changes the definition too:
                # say first that the configured source cannot be read, and never
                # suggest accepting an endpoint that does not answer.
                check_reachable(
                    self.source,
                    poller=self.name,
                    then="its definition also differs from the one the checkpoint was written "
                    f"for ({leasemod.what_changed(doc, self.definition()) or 'fingerprint'}): "
                    "fix the connection (host, port, database, credentials) first; do not "
                    "accept a definition that cannot be read",
                )
            leasemod.check_fingerprint(
                doc,
                self.fingerprint(),
                also=also,
                spec=self.cli_source(),
                definition=self.definition(),
            )
        return doc, stored.etag

    def fetch(self, position: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        s = self.settings
        started = time.perf_counter()
        try:
            rows = s.retry.call(
                lambda: self._fetch_paused(position, limit),
                operation="fetch",
                kinds=(FetchError,),
                on_retry=self.telemetry.on_retry,
                fields={"poller": self.name},
            )
        except FetchError:
            self.emit("fetch_error")
            raise
        self.emit("fetched", values={"seconds": time.perf_counter() - started})
        self._report_visibility()
        return rows

    def _fetch_paused(self, position: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        with gc_paused():  # see dbtrigger._gc: the batch's rows are all still alive
            return self.source.fetch(position, limit)

    def _report_visibility(self) -> None:
        """Turn the source's visibility-guard report into gauges (and the result).

        A guard that holds rows back (a long transaction may still commit an
        older cursor) is correct behaviour, but an operator needs to see it: the
        gauges say for how long, and which backend is blocking.
        """
        reporter = self.source if isinstance(self.source, ReportsVisibility) else None
        info = reporter.last_fetch_info if reporter is not None else None
        if info is None:
            return
        self.visibility = info
        self.emit(
            "visibility",
            values={
                "held_back": 1.0 if info.held_back else 0.0,
                "held_back_seconds": float(info.held_back_seconds),
                "blocking_pid": info.blocking_pid,
            },
        )

    def normalise(
        self, rows: Sequence[Mapping[str, Any]], batch_id: str, token: int
    ) -> list[RowChange]:
        try:
            with gc_paused():
                return self.source.to_events(rows, poller=self.name, batch_id=batch_id)
        except SerializationError as exc:
            self.emit("serialization_failed", "%s", exc, batch_id=batch_id, fencing_token=token)
            raise

    def result(
        self, rows: int, batches: int, outcome: Outcome, *, more: bool = False
    ) -> TickResult:
        info = self.visibility
        held = info is not None and info.held_back
        return TickResult(
            rows,
            batches,
            outcome,
            more=more,
            held_back=held,
            held_back_seconds=float(info.held_back_seconds) if info is not None and held else 0.0,
            blocking_pid=info.blocking_pid if info is not None and held else None,
        )
