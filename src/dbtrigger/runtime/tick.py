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
4. For each batch (:mod:`dbtrigger.runtime.batches`): **normalise**,
   **deliver** (:class:`Delivery` calls the handler and returns a typed
   outcome), prefetch the next batch (so we know whether this is the last
   one), then **commit** by CAS. The last commit of
   a tick also releases the lease: a tick with k batches costs 1 read + k + 1
   writes. A batch that did not settle is recorded as a failed attempt, in
   one write that also releases the lease.

   With read-ahead (the default, for sources that can be read from another
   thread: :mod:`dbtrigger.runtime.readahead`) the next batch is read on a
   thread of its own *while* this batch is handed over and committed, after
   where this batch leaves the checkpoint and window if all of it is
   accepted; it is taken after the commit, which then releases the lease
   only when the tick ends whatever comes back (else one more write releases
   it when the read came back empty). Without it, with lanes
   (``max_concurrency > 1``), the next batch is read on the tick's thread
   while the lanes run (:class:`Prefetch`). Either read is used only if the
   batch did leave the checkpoint and window exactly there; otherwise (a
   retry moved the window, the batch failed, the lease was lost, the tick
   stops) it is dropped and, if needed, read again: a read has nothing to
   undo, and the rows are handed out only after this batch's commit
   succeeded under the same lease.

What to write is always decided by a pure function of :mod:`dbtrigger.state`
(``lease.decide_*``, ``verdict.advance``, ``journal.JournalEntry``); what is
reported is declared once in :mod:`dbtrigger.runtime.telemetry`. Errors an
operator must fix (corrupt state, fingerprint mismatch, unusable credentials,
a broken source definition) always propagate.
"""

from __future__ import annotations

import datetime as dt
import shlex
import threading
import time
from collections.abc import Callable

from dbtrigger import _process
from dbtrigger._gc import older_objects_frozen
from dbtrigger._paste import pasteable
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import DbTriggerError
from dbtrigger.health import held_past_ttl
from dbtrigger.names import name_trigger
from dbtrigger.runtime import crash_loop, let_go
from dbtrigger.runtime.batches import BatchSequence
from dbtrigger.runtime.heartbeat import Heartbeat
from dbtrigger.runtime.kernel import Handler, KeepAlive, wants_context
from dbtrigger.runtime.lease_clocks import LeaseClocks
from dbtrigger.runtime.readahead import CARRY_SECONDS
from dbtrigger.runtime.reading import BatchReader, TickSettings
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.runtime.set_report import SetReport
from dbtrigger.runtime.subscribers import FanOut
from dbtrigger.runtime.trigger import TickResult, gone_holder
from dbtrigger.runtime.writes import StateWriter
from dbtrigger.sources.base import (
    AcknowledgesCheckpoints,
    MeasuresCursorAge,
    MeasuresLag,
)
from dbtrigger.state import lease as leasemod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.window import Window

__all__ = ["TickDriver", "TickResult", "TickSettings", "wants_context"]


class TickDriver(BatchSequence):
    """Performs ticks for one trigger; holds no state between them except the
    NULL-cursor probe's timer (owned by the trigger). Its reads are the
    :class:`~dbtrigger.runtime.reading.BatchReader`'s, its writes the
    :class:`~dbtrigger.runtime.writes.StateWriter`'s."""

    def __init__(
        self, reader: BatchReader, *, keepalive: KeepAlive, handler_timeout: float | None = None
    ) -> None:
        settings, source = reader.settings, reader.source
        self.settings = settings
        #: Every read of the tick: the state document, the rows of each batch. Its
        #: ports (source, store, clock, telemetry, delivery) are the driver's too.
        self.reader = reader
        self.name = settings.name
        self.source = source
        self.store = reader.store
        self.clock = clock = reader.clock
        self.fingerprint = reader.fingerprint
        self.telemetry = telemetry = reader.telemetry
        self.emit = telemetry.emit
        self.delivery = delivery = reader.delivery
        #: Fan-out: says once who joined or left since the document's last run.
        self.set_report = (
            SetReport(
                telemetry,
                poller=self.name,
                subscribers=delivery.subscribers,
                cli_target=delivery.cli_target,
                source=source,
            )
            if isinstance(delivery, FanOut)
            else None
        )
        #: The source holds data until told it is checkpointed (a replication slot).
        self.acknowledges = isinstance(source, AcknowledgesCheckpoints)
        self.writer = StateWriter(
            settings,
            clock=clock,
            telemetry=telemetry,
            cursor_age=source.cursor_age_seconds if isinstance(source, MeasuresCursorAge) else None,
            lag_after=source.lag_after if isinstance(source, MeasuresLag) else None,
        )
        #: The trigger's heartbeat thread (the lease is renewed on it).
        self.keepalive = keepalive
        #: ``handler_timeout_seconds``: a handler call is given up after it (None: never).
        self.handler_timeout = handler_timeout
        #: Rows and batches the current (or last) tick committed so far: what a
        #: tick that fails half way did get done.
        self.committed = (0, 0)
        #: How long a lease has stood unchanged, for leases written by a clock
        #: running ahead (see dbtrigger.state.lease.believed_expiry).
        self.lease_clocks = LeaseClocks(telemetry)
        #: time.monotonic() when the last tick ended: ticks that follow each other
        #: at once (``dbtrigger run`` while batches are full) carry a read-ahead.
        self._last_end = -float("inf")

    # --- the tick, top-down -------------------------------------------------------------

    def run(self, handler: Handler, should_stop: Callable[[], bool] | None = None) -> TickResult:
        # A call given up at the handler timeout is not waited for once should_stop().
        stop = should_stop if self.handler_timeout is not None else None
        try:
            with let_go.stop_waiting_when(stop):
                return self._run(handler, should_stop)
        except BaseException as exc:
            read_ahead = self.reader.read_ahead
            if read_ahead is not None:
                if isinstance(exc, Exception):
                    read_ahead.drop()
                else:  # an interrupt (a second Ctrl-C, SystemExit) does not wait for a read
                    read_ahead.abandon()
            raise
        finally:
            self._last_end = time.monotonic()
            if self.reader.bulk is not None:
                self.reader.bulk.drop()  # (kept rows serve this tick's lease only)

    def _run(self, handler: Handler, should_stop: Callable[[], bool] | None) -> TickResult:
        s = self.settings
        # A read-ahead carried from the last tick is this tick's first read only
        # if the document is the one that tick's last commit wrote (its etag).
        follows = time.monotonic() - self._last_end <= CARRY_SECONDS
        started_at = self.clock()
        self.reader.visibility = None
        self.committed = (0, 0)
        self.emit("tick_start", "tick start")
        doc, etag = self._read_state()
        # A holder of this host whose process provably died (killed mid-batch,
        # restarted by a supervisor) leaves a lease nobody can renew: taken at once.
        gone = _process.gone(doc.lease if doc is not None else None)

        decision = leasemod.decide_acquire(
            doc,
            poller=self.name,
            fingerprint=self.fingerprint(),
            owner=s.owner_id,
            now=started_at,
            ttl=s.lease_ttl,
            first_seen=self.lease_clocks.first_seen(etag, started_at),
            definition=self.reader.definition(),
            subscribers=self.delivery.fan_out_set(),
            count_deaths=True,
            holder_gone=gone is not None,
            process=_process.this_process(),
        )
        if isinstance(decision, leasemod.Busy):
            if self.reader.read_ahead is not None:
                self.reader.read_ahead.drop()
            self.lease_clocks.busy(decision, etag)
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
                0,
                0,
                "lease_busy",
                holder=decision.holder,
                lease_until=decision.free_at,
                release_command=self.release_command(decision.holder),
                own_tick=decision.holder == s.owner_id,
                not_renewed_seconds=not_renewed(doc, started_at),
                held_past_ttl_seconds=held_past_ttl(doc, started_at) if doc else None,
            )

        if self.set_report is not None:
            self.set_report(doc)  # (by the instance that hands the events out)
        position = doc.position if doc else BEGINNING
        window = (doc.window if doc is not None else None) or Window()
        try:
            selection = self.reader.next_batch(
                position, window, tag=("etag", etag), max_age=CARRY_SECONDS, full_only=True
            )
        except DbTriggerError as exc:
            name_trigger(exc, self.reader.cli_source())  # its commands ready to paste
            self.emit("fetch_failed", "fetch failed: %s", exc)
            raise
        # After the fetch: a source that cannot be read is reported once, by the fetch.
        self.reader.null_probe.run(self.source, self.telemetry)
        if selection is None:
            self.emit("tick_idle", "nothing after the checkpoint")
            self.acknowledge(position)  # the stored checkpoint is durable: nothing after it
            self.writer.history.idle(doc)  # a record a crash cut off after its commit
            return self.result(0, 0, "idle", document=doc)

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
            self.emit("lease_acquire_failed", "lease acquisition failed: %s", exc)
            raise
        if session is None:
            self.emit(
                "lease_busy",
                "another instance acquired the lease first",
                reason="lost_race",
                values={"result": "lost_race"},
            )
            return self.result(0, 0, "lost_race")

        if self.reader.bulk is not None:
            # Nothing was committed between the read and the lease taken on its etag.
            self.reader.bulk.retag(("etag", etag), ("lease", session.token))
        lost = threading.Event()
        heartbeat = Heartbeat(
            session,
            interval=s.heartbeat_interval,
            ttl=s.lease_ttl,
            clock=self.clock,
            lost=lost,
            telemetry=self.telemetry,
            keepalive=self.keepalive,
            timeout=self.handler_timeout,
        )
        self.heartbeat = heartbeat  # its watch on each handler call: hand_over()
        self.emit(
            "lease_acquired",
            "lease acquired (token %s)",
            decision.fencing_token,
            fencing_token=decision.fencing_token,
        )
        self._say_taken_over(decision, gone, position)
        try:
            # See dbtrigger._gc: full collections during the tick skip older objects.
            with older_objects_frozen(), heartbeat:
                return self.batches(
                    session,
                    handler,
                    selection,
                    position,
                    started_at,
                    decision.document,  # (with the attempt a dead holder's lease counted)
                    should_stop,
                    lost,
                    carry=follows,
                )
        finally:
            if not session.released and not session.lost:
                self.writer.release(session)

    def _say_taken_over(
        self, decision: leasemod.Acquired, gone: str | None, position: Position
    ) -> None:
        """Name the holder whose lease was taken over early (its process gone) and
        count a death (a lease left neither released nor renewed)."""
        if decision.taken_early is not None:
            crash_loop.say_gone(self.emit, decision.taken_early, gone or "", decision.fencing_token)
        if decision.abandoned is not None:  # its holder died mid-batch: one attempt more
            crash_loop.say_died(
                self.emit,
                decision.abandoned,
                decision.document.failure,
                position,
                self.delivery.max_attempts,
                early=decision.taken_early is not None,
            )

    # --- the I/O steps ----------------------------------------------------------------

    def _read_state(self) -> tuple[StateDocument | None, str | None]:
        """The state document and its etag, with the subscribers declared
        ``renamed(formerly=)`` under their new names (committed with the first write)."""
        try:
            doc, etag = self.reader.read()
        except DbTriggerError as exc:
            self.emit("state_read_failed", "state read failed: %s", exc)
            raise
        if self.set_report is not None:
            doc = self.set_report.renaming(doc)
        return doc, etag

    def acknowledge(self, position: Position) -> None:
        """Tell a source that holds data until it is checkpointed that ``position`` is durable.

        Called once a write that moved the checkpoint landed, and on an idle
        tick with the stored checkpoint (:class:`AcknowledgesCheckpoints`). A
        failure to release is the source's to retry: the checkpoint stands.
        """
        if not self.acknowledges:
            return
        if self.reader.read_ahead is not None:
            self.reader.read_ahead.quiet()
        try:
            self.source.acknowledge(position)  # type: ignore[attr-defined]
        except DbTriggerError as exc:
            self.emit(
                "acknowledge_failed",
                "the source could not release what it holds up to %s: %s",
                position.cursor,
                exc,
            )

    def release_command(self, holder: str | None) -> str | None:
        """The ``dbtrigger release-lease`` that frees ``holder``'s lease, when it is a
        process of this host that no longer runs (ready to paste: poller, where its
        store is, and ``--force``, as the lease has not expired yet)."""
        if not gone_holder(holder):
            return None
        spec = self.reader.cli_source()
        where = f"--source {spec}" if spec else f"--store {self.store.describe()}"
        prefix, _, value = where.partition(" ")
        return pasteable(
            f"dbtrigger release-lease {shlex.quote(self.name)} {prefix} {shlex.quote(value)} "
            "--force --reason 'its worker stopped without releasing it' --yes"
        )


def not_renewed(doc: StateDocument | None, now: dt.datetime) -> float | None:
    """Seconds since the lease in ``doc`` was last renewed, when its holder has
    missed a renewal (:func:`dbtrigger.state.lease.lease_state`), else None."""
    lease = doc.lease if doc is not None else None
    if lease is None:
        return None
    state, age = leasemod.lease_state(lease, now)
    return age if state in ("not_renewed", "expired") else None
