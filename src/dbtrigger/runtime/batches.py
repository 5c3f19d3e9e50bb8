"""The batches of one tick, under the lease it took: deliver, settle, commit.

:class:`~dbtrigger.runtime.tick.TickDriver` reads the state document, takes
the lease and reads the first batch; from there this loop runs until a batch
is the tick's last: normalise the rows, hand them to the handler
(:class:`~dbtrigger.runtime.delivery.Delivery`), settle the window, read the
next batch (ahead, on the read-ahead's thread, or on this one while the lanes
run) and commit by CAS, the last commit releasing the lease. It lives apart
from the tick's top so that each reads on one screen; the two share one
object (:class:`BatchSequence` is a base of ``TickDriver``).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dbtrigger.cursor import Position
from dbtrigger.errors import DbTriggerError, LostLeaseError
from dbtrigger.events import RowChange
from dbtrigger.runtime import crash_loop, windowing
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.crash_isolation import OneByOne
from dbtrigger.runtime.delivery import Delivered, Delivery, Undelivered, cancelled_error
from dbtrigger.runtime.heartbeat import Heartbeat
from dbtrigger.runtime.kernel import Handler, wants_context
from dbtrigger.runtime.prefetch import Prefetch
from dbtrigger.runtime.readahead import ReadAhead
from dbtrigger.runtime.reading import BatchReader, TickSettings, landing
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.runtime.trigger import Outcome, TickResult
from dbtrigger.runtime.windowing import Selection
from dbtrigger.runtime.writes import StateWriter
from dbtrigger.sources.base import SourceAdapter, position_of
from dbtrigger.state import crashes
from dbtrigger.state import lease as leasemod
from dbtrigger.state import window as windowmod
from dbtrigger.state.document import FailureRecord, StateDocument
from dbtrigger.state.journal import JournalEntry
from dbtrigger.state.window import Window

__all__ = ["BatchSequence", "Landed", "Next", "batch_id_for"]


@dataclass(frozen=True)
class Landed:
    """Where a delivered batch leaves the checkpoint and the window."""

    batch_id: str
    before: Position
    after: Position
    window: Window
    started_at: dt.datetime


@dataclass(frozen=True)
class Next:
    """What decides the batch after this one: its index, the stop flag, the
    lanes' prefetch and the read-ahead's tag."""

    index: int
    should_stop: Callable[[], bool] | None
    prefetch: Prefetch | None
    tag: object


def batch_id_for(started_at: dt.datetime, token: int, index: int) -> str:
    # The tick's start, formatted once a tick: strftime costs more than the rest of it.
    # (Keyed with the zone too: equal instants in two zones read differently.)
    key = (started_at, started_at.tzinfo, token)
    prefix = _prefixes.get(key)
    if prefix is None:
        if len(_prefixes) > 64:
            _prefixes.clear()
        prefix = _prefixes[key] = f"batch_{started_at:%Y%m%d_%H%M%S}_{token}_"
    return f"{prefix}{index + 1:04d}"


_prefixes: dict[tuple[dt.datetime, dt.tzinfo | None, int], str] = {}


class BatchSequence:
    """The batch loop of :class:`~dbtrigger.runtime.tick.TickDriver`, which
    sets these attributes (its reads, writes, delivery and telemetry)."""

    settings: TickSettings
    reader: BatchReader
    writer: StateWriter
    delivery: Delivery
    source: SourceAdapter
    name: str
    clock: Callable[[], dt.datetime]
    emit: Callable[..., None]
    #: Rows and batches the current (or last) tick committed so far.
    committed: tuple[int, int]
    #: The current lease's heartbeat; it watches each handler call.
    heartbeat: Heartbeat

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
        *,
        carry: bool = False,
    ) -> TickResult:
        """Deliver and commit batches until one is the last; that commit releases.

        With read-ahead the batch after each one is read while it is handed
        over and committed (:mod:`dbtrigger.runtime.readahead`), under the tag
        of this lease; the tick's last batch reads ahead for the next tick
        only when ``carry`` (ticks follow each other at once).
        """
        s = self.settings
        read_ahead = self.reader.read_ahead
        tag = ("lease", session.token)
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
                events = self.reader.normalise(selection.rows, batch_id, session.token)
                call, call_ctx = handler, wants_ctx
                if failure is not None and failure.crashes:  # it killed its process last time
                    call, call_ctx = self.after_deaths(
                        failure, events, position, batch_id, session, handler, wants_ctx
                    )
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
                    failed_digest=failure.batch_digest if failure is not None else None,
                    lease_lost=lost,
                    marks=EventMarks(
                        events,
                        can_reject=self.delivery.quarantine is not None,
                        attempts=windowing.attempts(events, selection.window),
                        owed=windowing.owed(events, selection.window),
                    ),
                )
                done = frozenset(failure.done) if failure else frozenset()
                prefetch = self.reader.look_ahead(
                    selection, events, position, index, started_at, tag, carry=carry
                )
                outcome = self.hand_over(
                    session, call, call_ctx, events, done, ctx, selection, prefetch
                )
                settlement = self.settle(selection, events, outcome)
            failure = None
            after, window = landing(position, events, selection, settlement)

            following, deferred = self.commit(
                session,
                Landed(batch_id, position, after, window, started_at),
                selection,
                events,
                settlement,
                outcome,
                Next(index, should_stop, prefetch, tag),
            )
            # After retries that did not fit the window, batches are cut to what it
            # can hold as waiting, until a batch of new rows retries nothing.
            if settlement is not None and settlement.unremembered:
                self.reader.reserve = True
            elif selection.fresh and not outcome.retried:
                self.reader.reserve = False
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
                if read_ahead is not None:
                    self.end_read_ahead(read_ahead, tag, session, index, should_stop)
                # A short batch was the last one: nothing is pending.
                self.emit("tick_committed", values={"lag_rows": None if more else 0})
                return self.result(
                    total, index + 1, "committed", more=more, document=session.document
                )
            selection = following
            index += 1

    def after_deaths(
        self,
        failure: FailureRecord,
        events: list[RowChange],
        position: Position,
        batch_id: str,
        session: LeaseSession,
        handler: Handler,
        wants_ctx: bool,
    ) -> tuple[Handler, bool]:
        """The handler (and its shape) for a batch whose delivery killed its process:
        itself; or each row alone (:mod:`~dbtrigger.runtime.crash_isolation`; with
        fan-out to each subscriber alone, with lanes one after another) once it did so
        on the last of ``max_attempts`` attempts, with a dead-letter sink; else
        :class:`~dbtrigger.errors.CrashLoopError`."""
        limit = self.delivery.max_attempts
        d = self.delivery
        alone = d.quarantine is not None
        verdict = crashes.after_deaths(failure, max_attempts=limit, can_isolate=alone)
        if verdict is crashes.AfterDeaths.DELIVER:
            return handler, wants_ctx
        if verdict is crashes.AfterDeaths.ISOLATE:
            one_by_one = OneByOne(
                handler,
                wants_ctx,
                session=session,
                failure=failure,
                clock=self.clock,
                ttl=self.settings.lease_ttl,
                stopped=cancelled_error,
                emit=self.emit,
            )
            return one_by_one, True
        raise crash_loop.refuse(
            self.emit,
            poller=self.name,
            target=d.cli_target(),
            failure=failure,
            events=events,
            position=position,
            batch_id=batch_id,
            fencing_token=session.token,
            max_attempts=limit,
            outside=verdict is crashes.AfterDeaths.OUTSIDE,
        )

    def commit(
        self,
        session: LeaseSession,
        landed: Landed,
        selection: Selection,
        events: list[RowChange],
        settlement: windowmod.Settlement | None,
        outcome: Delivered,
        nxt: Next,
    ) -> tuple[Selection | None, DbTriggerError | None]:
        """Commit the batch; the batch after it (None: the tick's last), or the
        error reading it.

        The next batch is read before the commit, so that the last commit can
        release the lease in the same write - unless it is being read ahead,
        which the commit then overlaps too: it is taken after the commit, and
        the lease released in a write of its own if nothing came back.
        """
        s = self.settings
        read_ahead = self.reader.read_ahead
        ahead = read_ahead is not None and read_ahead.pending is not None
        index, should_stop, after, window = nxt.index, nxt.should_stop, landed.after, landed.window
        if ahead:
            following, deferred = None, None
            release = self.last(selection, index, should_stop)
        else:
            following, deferred = self.following(
                selection, index, should_stop, nxt.prefetch, after, window, nxt.tag
            )
            release = following is None
        entry = JournalEntry.commit(
            batch_id=landed.batch_id,
            before=landed.before,
            after=after,
            rows=len(events),
            owner_id=s.owner_id,
            fencing_token=session.token,
            now=self.clock(),
            started_at=landed.started_at,
            quarantined=outcome.quarantined,
            outcomes=outcome.outcomes(len(events)),
        )
        self.writer.commit_batch(session, entry, release, settlement, events, outcome)
        if ahead and not release:
            following, deferred = self.following(
                selection, index, should_stop, None, after, window, nxt.tag
            )
            if following is None and deferred is None:
                self.writer.release(session)
        return following, deferred

    def last(
        self, selection: Selection, index: int, should_stop: Callable[[], bool] | None
    ) -> bool:
        """Is this batch the tick's last whatever the next read returns?"""
        if index + 1 >= self.settings.max_batches_per_tick or not selection.more:
            return True
        return should_stop is not None and should_stop()

    def following(
        self,
        selection: Selection,
        index: int,
        should_stop: Callable[[], bool] | None,
        prefetch: Prefetch | None,
        after: Position,
        window: Window,
        tag: object = None,
    ) -> tuple[Selection | None, DbTriggerError | None]:
        """The batch after this one (None: this is the tick's last), or the error
        reading it, deferred until this batch is committed. A prefetch read from
        exactly ``after`` and ``window`` is used; any other is dropped."""
        if self.last(selection, index, should_stop):
            return None, None
        if prefetch is not None and prefetch.matches(after, window):
            return prefetch.take()
        try:
            return self.reader.next_batch(after, window, tag=tag), None
        except DbTriggerError as exc:
            return None, exc

    def end_read_ahead(
        self,
        read_ahead: ReadAhead,
        tag: object,
        session: LeaseSession,
        index: int,
        should_stop: Callable[[], bool] | None,
    ) -> None:
        """The tick's last batch is committed: a read-ahead of the next batch is
        kept for the next tick (tagged with the etag this commit wrote) when the
        tick stopped at ``max_batches_per_tick``, dropped otherwise. A kept read
        goes on while the tick returns and the next one reads the document (not
        waiting for it here: with one batch a tick, that is most of what it
        overlaps); the next tick's first read takes or drops it."""
        stopping = should_stop is not None and should_stop()
        if index + 1 >= self.settings.max_batches_per_tick and not stopping:
            read_ahead.retag(tag, ("etag", session.etag))
        else:
            read_ahead.drop()

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
        watched = self.delivery.watched
        try:
            # (Heartbeat.watching written out: a generator context manager a batch costs.)
            if watched:
                self.heartbeat.watch(ctx.batch_id, len(events))
            try:
                outcome = self.delivery.deliver(handler, events, done, ctx, wants_ctx, meanwhile)
            finally:
                if watched:
                    self.heartbeat.unwatch()
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

    def settle(
        self, selection: Selection, events: Sequence[RowChange], outcome: Delivered
    ) -> windowmod.Settlement | None:
        if not selection.window and not outcome.retried:
            return None  # (what settle_delivered says then, without reading the clock)
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

    def result(
        self,
        rows: int,
        batches: int,
        outcome: Outcome,
        *,
        more: bool = False,
        document: StateDocument | None = None,
    ) -> TickResult:
        """The tick's report; ``document``: the state as the tick left it (the
        checkpoint, its commit time, the retries waiting). With it, the visibility
        guard's report on the tick's last fetch and the rows the settled window
        kept back on it."""
        held = self.reader.visibility
        back = held is not None and held.held_back
        checkpoint = document.checkpoint if document is not None else None
        window = document.window if document is not None else None
        return TickResult(
            rows,
            batches,
            outcome,
            more=more,
            held_back=back,
            held_back_seconds=float(held.held_back_seconds) if held is not None and back else 0.0,
            blocking_pid=held.blocking_pid if held is not None and back else None,
            checkpoint=checkpoint.position if checkpoint is not None else None,
            committed_at=checkpoint.updated_at if checkpoint is not None else None,
            waiting_retries=len(window.pending) if window is not None else 0,
            next_retry_at=min((p.not_before for p in window.pending), default=None)
            if window is not None
            else None,
            window_withheld=self.reader.window_report.withheld,
        )
