"""The tick's writes to the state document: commit, failure record, release.

Each is one CAS write through the :class:`~dbtrigger.runtime.session.LeaseSession`
of a document computed by a pure transition (``dbtrigger.state.lease``), and
each reports itself once through :mod:`dbtrigger.runtime.telemetry`. The tick
driver (:mod:`dbtrigger.runtime.tick`) decides *when*; this module knows
*what* each write carries.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import (
    CommitError,
    DbTriggerError,
    FailureRecordError,
    LostLeaseError,
    OperatorError,
)
from dbtrigger.events import RowChange, event_ids
from dbtrigger.history.recorder import Outcome
from dbtrigger.history.wiring import NO_HISTORY
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.sources.base import position_of
from dbtrigger.sources.lag import CURSOR, LagReading
from dbtrigger.state import document as docmod
from dbtrigger.state import journal
from dbtrigger.state import lease as leasemod
from dbtrigger.state import verdict as verdictmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.journal import JournalEntry
from dbtrigger.state.window import Bound, Settlement, key_of


@dataclass(frozen=True)
class WriterSettings:
    name: str
    owner_id: str
    lease_ttl: dt.timedelta
    journal_limit: int
    #: The settled window's bound, written with the window (see Window.to_json).
    bound: Bound | None = None


def _recorded(doc: StateDocument, entry: JournalEntry) -> JournalEntry | Mapping[str, Any]:
    """``entry`` as the commit just wrote it into ``doc``'s journal (its last entry),
    so the history's record is not encoded a second time; ``entry`` itself when the
    journal does not end with it (``journal_limit=0``)."""
    last = doc.journal[-1] if doc.journal else None
    if (
        last is not None
        and last.get("batch_id") == entry.batch_id
        and last.get("type") == entry.type
    ):
        return last
    return entry


class StateWriter:
    """Writes one poller's state document during a tick; see the module docstring."""

    #: Appends each commit to the durable history (dbtrigger.history); set by the trigger.
    history = NO_HISTORY

    def __init__(
        self,
        settings: WriterSettings,
        *,
        clock: Callable[[], dt.datetime],
        telemetry: Telemetry,
        cursor_age: Callable[[Any, dt.datetime], float | None] | None = None,
        lag_after: Callable[[Position, dt.datetime], LagReading | None] | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        #: The settled window's bound (for the overflow report).
        self.bound = settings.bound or Bound()
        self.clock = clock
        self.emit = telemetry.emit
        self.logs = telemetry.logs
        #: The source's own ageing of a cursor (naive timestamps against the
        #: database clock); aware timestamps are aged here without it.
        self.cursor_age = cursor_age
        #: The source's own measurement of lag_seconds and its basis
        #: (dbtrigger.sources.lag): integer cursors too.
        self.lag_after = lag_after
        #: The last lag measurement failed (its WARNING was logged): repeats
        #: log at DEBUG until one succeeds.
        self._lag_failing = False

    def commit(
        self,
        session: LeaseSession,
        entry: JournalEntry,
        release: bool,
        window: leasemod.WindowUpdate = leasemod.KEEP,
    ) -> None:
        """Move the checkpoint to ``entry.after`` (renewing or releasing the lease)
        and, when given, replace the per-event window."""
        s = self.settings
        started = time.perf_counter()
        now = entry.committed_at
        fields: dict[str, Any] = {
            "batch_id": entry.batch_id,
            "fencing_token": session.token,
            "rows": entry.rows,
        }
        try:
            session.update(
                lambda d: leasemod.decide_commit(
                    d,
                    owner=s.owner_id,
                    token=session.token,
                    position=entry.after,
                    batch_id=entry.batch_id,
                    row_count=entry.rows,
                    now=now,
                    ttl=s.lease_ttl,
                    release=release,
                    journal_entry=entry,
                    journal_limit=s.journal_limit,
                    window=window,
                ),
                what="commit",
            )
        except LostLeaseError as exc:
            self.emit("lease_lost", "commit rejected: %s", exc, **fields)
            raise LostLeaseError(
                str(exc), poller=self.name, batch_id=entry.batch_id, fencing_token=session.token
            ) from exc
        except CommitError as exc:
            self.emit("commit_failed", "commit failed: %s", exc, **fields)
            raise
        session.released = release
        after = entry.after
        lag, basis = self._lag(after, now)
        self.emit(
            "batch_committed",
            "committed %d rows up to %s (batch %s)",
            entry.rows,
            after.cursor,
            entry.batch_id,
            # (encoded only for a record someone reads: no metric uses it)
            cursor=docmod.position_to_json(after) if self.logs("batch_committed") else None,
            released=release,
            batch_id=entry.batch_id,
            fencing_token=session.token,
            rows=entry.rows,
            lag_basis=basis,
            values={
                "seconds": time.perf_counter() - started,
                "timestamp": now.timestamp(),
                "lag_seconds": lag,
            },
        )

    def commit_batch(
        self,
        session: LeaseSession,
        entry: JournalEntry,
        release: bool,
        settlement: Settlement | None,
        events: Sequence[RowChange] = (),
        outcome: Outcome | None = None,
    ) -> None:
        """The batch's one write, its record in the durable history (never
        failing the write: see dbtrigger.history.recorder), then what it
        changed, reported: the events' outcomes, each subscriber's, and the
        window's size and overflow."""
        window: leasemod.WindowUpdate = leasemod.KEEP
        if settlement is not None:
            window = dataclasses.replace(settlement.window, bound=self.settings.bound)
        self.commit(session, entry, release, window)
        doc = session.document
        self.history.committed(doc, _recorded(doc, entry), events, outcome)
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
                self.bound.max_events,
                self.bound.max_bytes,
                entry.batch_id,
                settlement.overflow,
                settlement.unremembered,
                batch_id=entry.batch_id,
                unremembered=settlement.unremembered,
                values={"count": settlement.overflow + settlement.unremembered},
            )

    def _lag(self, after: Position, now: dt.datetime) -> tuple[float | None, str | None]:
        """``lag_seconds`` at a commit to ``after`` and its basis; (None, None): not measured.

        Runs after the commit, so nothing it raises may fail the tick: the
        batch is committed, and a tick that raised here would stop ``dbtrigger
        run`` over a number (a NaN cursor made ``decimal`` raise in the
        bookkeeping, a value the driver cannot convert in a ``lag_column``
        made it raise ``ValueError``). A failed measurement leaves the gauge at
        its last value, is counted (``lag_measurement_failures_total``) and
        logged at WARNING once, then at DEBUG until a measurement succeeds.
        """
        try:
            measured = self._measure_lag(after, now)
        except Exception as exc:  # noqa: BLE001 - bookkeeping after a commit, see above
            self.emit(
                "lag_measurement_failed_again" if self._lag_failing else "lag_measurement_failed",
                "measuring lag_seconds after the commit failed (the commit stands; the gauge "
                "keeps its last value; said once until a measurement succeeds): %s: %s",
                type(exc).__name__,
                exc,
                error_type=type(exc).__name__,
            )
            self._lag_failing = True
            return None, None
        if measured[0] is not None:  # (None: not measured this time, proves nothing)
            self._lag_failing = False
        return measured

    def _measure_lag(self, after: Position, now: dt.datetime) -> tuple[float | None, str | None]:
        if self.lag_after is not None:
            reading = self.lag_after(after, now)
            if reading is None or reading.seconds is None:
                return None, None
            return max(0.0, reading.seconds), reading.basis
        if isinstance(after.cursor, dt.datetime) and after.cursor.tzinfo is not None:
            return max(0.0, (now - after.cursor).total_seconds()), CURSOR
        if self.cursor_age is not None:
            age = self.cursor_age(after.cursor, now)
            return (None, None) if age is None else (max(0.0, age), CURSOR)
        return None, None

    def record_failure(
        self,
        session: LeaseSession,
        ctx: BatchContext,
        exc: BaseException,
        events: Sequence[RowChange],
        settled: frozenset[str],
        settlement: Settlement | None = None,
    ) -> None:
        """Count the failed attempt and release the lease, in one write.

        The checkpoint moves over the contiguous settled head of the batch
        (:func:`dbtrigger.state.verdict.advance`); settled rows after it go to
        the failure record and are skipped on redelivery. With a per-event
        window in use, ``settlement`` (:func:`dbtrigger.state.window.settle`)
        says instead where the checkpoint goes, and the settled rows after it
        go to the window.
        """
        s = self.settings
        now = self.clock()
        window: leasemod.WindowUpdate = leasemod.KEEP
        if settlement is None:
            advance = verdictmod.advance(event_ids(events), settled)
            advance_to = position_of(events[advance.head - 1]) if advance.head else None
        else:
            # The batch's own rows the checkpoint passed (a prefix of the batch:
            # the walk may also pass window rows outside it).
            head = sum(1 for e in events if key_of(position_of(e)) in settlement.passed)
            advance = verdictmod.Advance(head, ())
            advance_to = settlement.checkpoint
            window = dataclasses.replace(settlement.window, bound=s.bound)
        entry: JournalEntry | None = None
        if advance_to is not None:
            entry = JournalEntry(
                type=journal.PARTIAL_COMMIT,
                batch_id=ctx.batch_id,
                before=ctx.checkpoint_before,
                after=advance_to,
                rows=advance.head,
                owner_id=s.owner_id,
                fencing_token=session.token,
                committed_at=now,
            )
        try:
            session.update(
                lambda d: leasemod.decide_failure(
                    d,
                    owner=s.owner_id,
                    token=session.token,
                    now=now,
                    error=f"{type(exc).__name__}: {exc}",
                    batch_id=ctx.batch_id,
                    advance_to=advance_to,
                    row_count=advance.head,
                    done=advance.done,
                    journal_entry=entry,
                    journal_limit=s.journal_limit,
                    # What `dbtrigger skip-batch` skips: this batch, from the
                    # record's starting position to its last row.
                    batch_end=position_of(events[-1]),
                    batch_rows=len(events) - advance.head,
                    batch_digest=docmod.digest_event_ids(
                        e.event_id for e in events[advance.head :]
                    ),
                    window=window,
                ),
                what="failure record",
            )
            session.released = True
            if advance_to is not None and entry is not None:
                self.history.committed(session.document, entry, events[: advance.head])
                self.emit(
                    "batch_partially_committed",
                    "committed the first %d of %d rows of batch %s; %d later row(s) "
                    "remembered as done",
                    advance.head,
                    len(events),
                    ctx.batch_id,
                    len(advance.done),
                    batch_id=ctx.batch_id,
                    fencing_token=session.token,
                    rows=advance.head,
                    cursor=docmod.position_to_json(advance_to),
                )
        except LostLeaseError as record_exc:
            # Another owner has the batch now and counts its own attempts.
            self.emit(
                "failure_record_failed", "could not record the failed attempt: %s", record_exc
            )
        except OperatorError as record_exc:
            # Not counting attempts means a poison batch is never set aside and
            # comes back whole on every tick: a person must fix the store.
            raise FailureRecordError(
                f"the failed attempt at batch {ctx.batch_id} ({type(exc).__name__}: {exc}) "
                f"could not be recorded: {record_exc}. Attempts are not counted until this "
                "is fixed, so a poison batch can never be quarantined",
                poller=self.name,
                batch_id=ctx.batch_id,
                fencing_token=session.token,
            ) from record_exc
        except DbTriggerError as record_exc:
            # The store is down for now: this attempt goes uncounted, the next is.
            self.emit(
                "failure_uncounted",
                "could not record the failed attempt at batch %s (it is not counted): %s",
                ctx.batch_id,
                record_exc,
                batch_id=ctx.batch_id,
                error_type=type(record_exc).__name__,
            )

    def release(self, session: LeaseSession) -> None:
        s = self.settings
        now = self.clock()

        def release(doc: StateDocument) -> StateDocument:
            released = leasemod.decide_release(doc, owner=s.owner_id, token=session.token, now=now)
            if released is None:
                # Not ours any more: write nothing (a rewrite of someone else's
                # document would only bump its etag under its owner).
                raise LostLeaseError(
                    "release skipped: the lease is no longer ours",
                    poller=self.name,
                    fencing_token=session.token,
                )
            return released

        try:
            session.update(release, what="release")
            session.released = True
            self.emit("lease_released", "lease released", fencing_token=session.token)
        except LostLeaseError as exc:
            self.emit("lease_release_skipped", "%s", exc, fencing_token=session.token)
        except DbTriggerError as exc:
            self.emit(
                "lease_release_failed",
                "could not release the lease (it expires by itself): %s",
                exc,
                fencing_token=session.token,
            )
