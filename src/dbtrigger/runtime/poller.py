"""``PollTrigger``: one tick = read state, fetch, hand over, commit.

The order of a tick, and why:

1. **Read** the state document (one store read). A live lease held by someone
   else ends the tick here: returns 0, nothing written.
2. **Fetch** the first batch after the checkpoint *before* taking the lease.
   An idle tick therefore costs one read and no write; taking a lease only to
   learn there is nothing to do would be a paid write per timer firing.
3. **Acquire** the lease with a conditional write on the etag from step 1. If
   it wins, nobody committed since our read, so the rows fetched in step 2 are
   exactly the rows after the committed checkpoint. If it loses, another
   instance got there first: return 0.
4. For each batch: **normalise**, call the **handler**, prefetch the next batch
   (so we know whether this is the last one), then **commit** the checkpoint by
   CAS. The last commit of a tick also releases the lease, so a tick with k
   batches costs 1 read + k + 1 writes.

The checkpoint moves only after the handler returned; a handler failure records
the failed attempt and releases the lease in one write. Errors an operator must
fix (corrupt state, fingerprint mismatch, unusable credentials, broken source
definition) always propagate: they are never reported as "0 rows".

Reliability (see ``docs/reliability.md``):

* While the lease is held a :class:`~dbtrigger.runtime.heartbeat.Heartbeat`
  renews it whenever nothing was written for ``heartbeat_interval_seconds``,
  so a batch slower than the TTL keeps its lease (and a fast one costs no
  extra write). A rejected renewal cancels the batch: no commit.
* Transient store and source failures are retried inside the tick under a
  :class:`~dbtrigger.runtime.retry.RetryPolicy`; handlers never are.
* A handler may raise :class:`~dbtrigger.errors.PartialBatchError`: the
  checkpoint advances over the leading processed rows, and processed rows after
  the first failed one are remembered in the failure record and skipped when
  the batch comes back. With a quarantine sink, a batch that failed
  ``max_attempts`` times is bisected and rows that fail alone are set aside
  (:mod:`dbtrigger.quarantine`) so the poller moves on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger._gc import gc_paused
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    CommitError,
    ConfigurationError,
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
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.names import validate_name
from dbtrigger.quarantine import QuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.delivery import BatchDelivery, Handler, guarded
from dbtrigger.runtime.heartbeat import Heartbeat, default_interval
from dbtrigger.runtime.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.sources.base import SourceAdapter, position_of
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.runtime")


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def default_owner_id() -> str:
    """``host/pid/random``: unique per trigger object, readable in ``status``."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class TickResult:
    """What one tick did. ``more`` is True when it stopped with rows likely pending."""

    rows: int
    batches: int
    outcome: str  # "committed", "idle", "lease_busy", "lost_race"
    more: bool = False


def _wants_context(handler: Handler) -> bool:
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    has_var = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    return has_var or len(positional) >= 2


class PollTrigger(BatchDelivery):
    """Polls ``source`` and delivers batches to a handler, at least once.

    Args:
        name: the poller name: state document key, metric label, event id salt.
        source: a :class:`~dbtrigger.sources.base.SourceAdapter`.
        checkpoint_store: a :class:`~dbtrigger.state.stores.base.CheckpointStore`.
        batch_size: rows per handler call.
        max_batches_per_tick: batches one tick may process before it returns.
        lease_ttl_seconds: how long a lease lives without renewal; must exceed
            the worst batch (fetch + handler + commit).
        metrics: a :class:`~dbtrigger.metrics.MetricsCollector`.
        owner_id: this instance's identity in the lease (default host/pid/random).
        clock: returns the current aware UTC time (tests inject one).
        journal_limit: commits and manual operations kept in the document.
        null_check_interval_seconds: how often to probe for rows whose cursor is
            NULL and which therefore cannot be delivered (0 disables).
        heartbeat_interval_seconds: renew the lease after this many seconds
            without a write while a batch runs; below ``lease_ttl_seconds / 2``
            (default a third of it); 0 disables renewal.
        retry: how transient store/source failures are retried inside a tick
            (default :data:`~dbtrigger.runtime.retry.DEFAULT_RETRY_POLICY`;
            ``RetryPolicy.none()`` leaves retrying to the next tick).
        quarantine: a :class:`~dbtrigger.quarantine.QuarantineSink`; without
            one a failing batch is retried for ever (and logged as poison).
        max_attempts: failed deliveries of one batch before its failing rows
            are isolated and quarantined (with a sink) or reported as poison.
        quarantine_limit: most rows one batch may quarantine; more rows
            failing alone looks like an outage, and nothing is set aside.
    """

    def __init__(
        self,
        *,
        name: str,
        source: SourceAdapter,
        checkpoint_store: CheckpointStore,
        batch_size: int = 100,
        max_batches_per_tick: int = 1,
        lease_ttl_seconds: float = 120,
        metrics: MetricsCollector | None = None,
        owner_id: str | None = None,
        clock: Callable[[], dt.datetime] | None = None,
        journal_limit: int = 20,
        null_check_interval_seconds: float = 300,
        heartbeat_interval_seconds: float | None = None,
        retry: RetryPolicy | None = None,
        quarantine: QuarantineSink | None = None,
        max_attempts: int = 5,
        quarantine_limit: int = 10,
    ) -> None:
        self.name = validate_name(name, "poller name")
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be >= 1, got {batch_size}")
        if max_batches_per_tick < 1:
            raise ConfigurationError(
                f"max_batches_per_tick must be >= 1, got {max_batches_per_tick}"
            )
        if lease_ttl_seconds <= 0:
            raise ConfigurationError(f"lease_ttl_seconds must be > 0, got {lease_ttl_seconds}")
        if heartbeat_interval_seconds is None:
            heartbeat_interval_seconds = default_interval(lease_ttl_seconds)
        if heartbeat_interval_seconds < 0 or heartbeat_interval_seconds >= lease_ttl_seconds / 2:
            raise ConfigurationError(
                "heartbeat_interval_seconds must be below lease_ttl_seconds / 2 "
                f"({lease_ttl_seconds / 2:g}) so a renewal can fail once and still arrive "
                f"in time, or 0 to disable; got {heartbeat_interval_seconds}"
            )
        if max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be >= 1, got {max_attempts}")
        if quarantine_limit < 1:
            raise ConfigurationError(f"quarantine_limit must be >= 1, got {quarantine_limit}")
        self.source = source
        self.store = checkpoint_store
        self.batch_size = batch_size
        self.max_batches_per_tick = max_batches_per_tick
        self.lease_ttl = dt.timedelta(seconds=lease_ttl_seconds)
        self.metrics = SafeMetrics(metrics, self.name)
        self.owner_id = owner_id or default_owner_id()
        self.clock = clock or utc_now
        self.journal_limit = journal_limit
        self.null_check_interval = null_check_interval_seconds
        self._last_null_check = -float("inf")
        self._fingerprint: str | None = None
        self.default_handler: Handler | None = None
        self.heartbeat_interval = heartbeat_interval_seconds
        self.retry = retry or DEFAULT_RETRY_POLICY
        self.quarantine = quarantine
        self.max_attempts = max_attempts
        self.quarantine_limit = quarantine_limit

    # --- public API ----------------------------------------------------------------

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register ``fn`` as the handler ``dbtrigger run`` drives."""
        self.default_handler = fn
        return fn

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.source.fingerprint()
        return self._fingerprint

    def run(self, *, timer: Any = None, handler: Handler) -> int:
        """Run one tick for a timer firing; returns the number of rows committed."""
        del timer  # the schedule is the host's business; the tick is the same
        return self.tick(handler)

    def tick(self, handler: Handler, *, should_stop: Callable[[], bool] | None = None) -> int:
        return self.tick_result(handler, should_stop=should_stop).rows

    def drain(self, handler: Handler, *, max_ticks: int | None = None) -> int:
        """Tick until a tick commits nothing; returns the rows committed."""
        total = 0
        ticks = 0
        while max_ticks is None or ticks < max_ticks:
            result = self.tick_result(handler)
            ticks += 1
            total += result.rows
            if result.rows == 0:
                break
        return total

    async def tick_async(self, handler: Handler) -> int:
        """One tick for async code: I/O runs in a worker thread, an async handler
        runs on the caller's event loop.

        If the lease is lost while the handler runs (a heartbeat was rejected),
        the handler's task is cancelled and awaited until it has really
        stopped, and the tick raises :class:`~dbtrigger.errors.LostLeaseError`
        without committing.
        """
        loop = asyncio.get_running_loop()
        wants_ctx = _wants_context(handler)

        def shim(events: list[RowChange], ctx: BatchContext) -> Any:
            result = handler(events, ctx) if wants_ctx else handler(events)
            if not inspect.isawaitable(result):
                return result
            return asyncio.run_coroutine_threadsafe(guarded(result, ctx), loop).result()

        return await asyncio.to_thread(self.tick, shim)

    def read_state(self) -> StateDocument | None:
        stored = self.store.read(self.name)
        return docmod.loads(stored.data) if stored else None

    # --- the tick -------------------------------------------------------------------

    def _read(self) -> tuple[StateDocument | None, str | None]:
        try:
            stored = self.retry.call(
                lambda: self.store.read(self.name),
                operation="state read",
                kinds=(StoreUnavailableError,),
                on_retry=self._on_retry,
                fields={"poller": self.name},
            )
        except OperatorError:
            raise
        except StoreError as exc:
            self.metrics.increment("failures_total", labels={"error_type": "FetchError"})
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
        leasemod.check_fingerprint(doc, self.fingerprint)
        return doc, stored.etag

    def _fetch(self, position: Position) -> Sequence[Mapping[str, Any]]:
        started = time.perf_counter()
        try:
            rows = self.retry.call(
                lambda: self._fetch_paused(position),
                operation="fetch",
                kinds=(FetchError,),
                on_retry=self._on_retry,
                fields={"poller": self.name},
            )
        except FetchError:
            self.metrics.increment("failures_total", labels={"error_type": "FetchError"})
            raise
        self.metrics.observe("fetch_duration_seconds", time.perf_counter() - started)
        self._report_visibility()
        return rows

    def _fetch_paused(self, position: Position) -> Sequence[Mapping[str, Any]]:
        with gc_paused():  # see dbtrigger._gc: the batch's rows are all still alive
            return self.source.fetch(position, self.batch_size)

    def _report_visibility(self) -> None:
        """Turn the source's visibility-guard report into gauges.

        A guard that holds rows back (a long transaction may still commit an
        older cursor) is correct behaviour, but an operator needs to see it: the
        gauges say for how long, and which backend is blocking.
        """
        info = getattr(self.source, "last_fetch_info", None)
        if info is None:
            return
        self.metrics.set_gauge("visibility_held_back", 1.0 if info.held_back else 0.0)
        self.metrics.set_gauge("visibility_held_back_seconds", float(info.held_back_seconds))
        if info.blocking_pid is not None:
            self.metrics.set_gauge("visibility_blocking_pid", float(info.blocking_pid))

    def tick_result(
        self, handler: Handler, *, should_stop: Callable[[], bool] | None = None
    ) -> TickResult:
        started_at = self.clock()
        self._log(logging.DEBUG, "tick_start", "tick start")
        try:
            doc, etag = self._read()
        except DbTriggerError as exc:
            self._log(logging.ERROR, "state_read_failed", "state read failed: %s", exc)
            raise

        decision = leasemod.decide_acquire(
            doc,
            poller=self.name,
            fingerprint=self.fingerprint,
            owner=self.owner_id,
            now=started_at,
            ttl=self.lease_ttl,
        )
        if isinstance(decision, leasemod.Busy):
            self.metrics.increment("lease_acquire_skipped_total")
            self.metrics.increment("ticks_total", labels={"result": "lease_busy"})
            self._log(
                logging.DEBUG,
                "lease_busy",
                "lease held by %s (token %s), %s; skipping tick",
                decision.holder,
                decision.fencing_token,
                decision.reason,
                holder=decision.holder,
            )
            return TickResult(0, 0, "lease_busy")

        position = doc.position if doc else BEGINNING
        self._report_null_cursors()
        try:
            rows = self._fetch(position)
        except DbTriggerError as exc:
            self._log(logging.ERROR, "fetch_failed", "fetch failed: %s", exc)
            raise
        if not rows:
            self.metrics.increment("ticks_total", labels={"result": "idle"})
            self.metrics.set_gauge("lag_rows", 0)  # caught up: nothing after the checkpoint
            self.metrics.set_gauge("lag_seconds", 0.0)
            self._log(logging.DEBUG, "tick_idle", "nothing after the checkpoint")
            return TickResult(0, 0, "idle")

        try:
            new_etag = self._acquire(decision.document, etag)
        except DbTriggerError as exc:
            self.metrics.increment("failures_total", labels={"error_type": type(exc).__name__})
            self._log(logging.ERROR, "lease_acquire_failed", "lease acquisition failed: %s", exc)
            raise
        if new_etag is None:
            self.metrics.increment("lease_acquire_skipped_total")
            self.metrics.increment("ticks_total", labels={"result": "lost_race"})
            self._log(
                logging.DEBUG,
                "lease_busy",
                "another instance acquired the lease first",
                reason="lost_race",
            )
            return TickResult(0, 0, "lost_race")

        session = LeaseSession(
            self.store,
            self.name,
            decision.document,
            new_etag,
            owner=self.owner_id,
            token=decision.fencing_token,
            retry=self.retry,
            on_retry=self._on_retry,
        )
        lost = threading.Event()
        heartbeat = Heartbeat(
            session,
            interval=self.heartbeat_interval,
            ttl=self.lease_ttl,
            clock=self.clock,
            lost=lost,
            poller=self.name,
            on_renewed=lambda: self.metrics.increment("heartbeats_total"),
        )
        self._log(
            logging.DEBUG,
            "lease_acquired",
            "lease acquired (token %s)",
            decision.fencing_token,
            fencing_token=decision.fencing_token,
        )
        try:
            with heartbeat:
                return self._process(
                    session, handler, rows, position, started_at, doc, should_stop, lost
                )
        finally:
            if not session.released and not session.lost:
                self._release(session)

    def _acquire(self, document: StateDocument, etag: str | None) -> str | None:
        """Write the lease we decided to take; the new etag, or None if we lost the race.

        An ambiguous write (timeout) is resolved by reading back: our bytes
        mean we hold the lease, an unchanged document means the write did not
        land (write again), anything else means somebody else got there.
        """
        data = docmod.dumps(document)
        for _ in range(3):
            try:
                return self.retry.call(
                    lambda: self.store.write(self.name, data, if_match=etag),
                    operation="lease acquire",
                    kinds=(StoreUnavailableError,),
                    on_retry=self._on_retry,
                    fields={"poller": self.name},
                )
            except CasConflictError:
                return None
            except OperatorError:
                raise
            except AmbiguousWriteError:
                try:
                    stored = self.retry.call(
                        lambda: self.store.read(self.name),
                        operation="state re-read",
                        kinds=(StoreUnavailableError,),
                        on_retry=self._on_retry,
                    )
                except OperatorError:
                    raise
                except StoreError as exc:
                    raise FetchError(
                        f"could not tell whether the lease of poller {self.name!r} was "
                        f"acquired: {exc}",
                        poller=self.name,
                    ) from exc
                if stored is not None and stored.data == data:
                    return stored.etag
                if (stored.etag if stored is not None else None) != etag:
                    return None
            except StoreError as exc:
                raise FetchError(
                    f"could not acquire the lease of poller {self.name!r}: {exc}", poller=self.name
                ) from exc
        return None

    def _process(
        self,
        session: LeaseSession,
        handler: Handler,
        rows: Sequence[Mapping[str, Any]],
        position: Position,
        started_at: dt.datetime,
        previous: StateDocument | None,
        should_stop: Callable[[], bool] | None,
        lost: threading.Event,
    ) -> TickResult:
        total = 0
        batches = 0
        wants_ctx = _wants_context(handler)
        failure = leasemod.failure_at(previous, position)
        attempt = failure.attempts + 1 if failure else 1
        if attempt > 1:
            self.metrics.increment("redelivered_batches_total")
        # The loop ends through the last batch's commit, which always releases:
        # either nothing more was fetched, or max_batches_per_tick was reached.
        index = -1
        while True:
            index += 1
            batch_id = self._batch_id(started_at, session.token, index)
            fields = {"batch_id": batch_id, "fencing_token": session.token}
            try:
                with gc_paused():
                    events = self.source.to_events(rows, poller=self.name, batch_id=batch_id)
            except SerializationError as exc:
                self.metrics.increment(
                    "failures_total", labels={"error_type": "SerializationError"}
                )
                self._log(logging.ERROR, "serialization_failed", "%s", exc, **fields)
                raise
            after = position_of(events[-1])
            ctx = BatchContext(
                poller_name=self.name,
                batch_id=batch_id,
                batch_index=index,
                fencing_token=session.token,
                owner_id=self.owner_id,
                source_name=self.source.name,
                checkpoint_before=position,
                checkpoint_after=after,
                tick_started_at=started_at,
                attempt=attempt,
                lease_lost=lost,
            )
            done = frozenset(failure.done) if failure else frozenset()
            quarantined = self._deliver(session, handler, events, done, ctx, wants_ctx)
            failure = None

            # Prefetch so the last commit can release the lease in the same write.
            next_rows: Sequence[Mapping[str, Any]] = []
            deferred: DbTriggerError | None = None
            stopping = should_stop is not None and should_stop()
            if (
                index + 1 < self.max_batches_per_tick
                and len(rows) >= self.batch_size
                and not stopping
            ):
                try:
                    next_rows = self._fetch(after)
                except DbTriggerError as exc:
                    deferred = exc
            release = not next_rows
            self._commit(
                session, position, after, batch_id, len(events), started_at, release, quarantined
            )
            total += len(events)
            batches += 1
            attempt = 1
            position = after
            if deferred is not None:
                self._log(logging.ERROR, "fetch_failed", "fetch failed: %s", deferred, **fields)
                raise deferred
            if release:
                self.metrics.increment("ticks_total", labels={"result": "committed"})
                more = len(rows) >= self.batch_size
                if not more:  # a short batch was the last one: nothing is pending
                    self.metrics.set_gauge("lag_rows", 0)
                return TickResult(total, batches, "committed", more=more)
            rows = next_rows

    def _commit(
        self,
        session: LeaseSession,
        before: Position,
        after: Position,
        batch_id: str,
        rows: int,
        started_at: dt.datetime,
        release: bool,
        quarantined: int = 0,
    ) -> None:
        started = time.perf_counter()
        now = self.clock()
        entry: dict[str, object] = {
            "type": "commit",
            "batch_id": batch_id,
            "from": docmod.position_to_json(before),
            "to": docmod.position_to_json(after),
            "rows": rows,
            "owner_id": self.owner_id,
            "fencing_token": session.token,
            "committed_at": docmod.format_time(now),
            "duration_ms": round((now - started_at).total_seconds() * 1000, 3),
        }
        if quarantined:
            entry["quarantined"] = quarantined
        fields = {"batch_id": batch_id, "fencing_token": session.token, "rows": rows}
        try:
            session.update(
                lambda d: leasemod.decide_commit(
                    d,
                    owner=self.owner_id,
                    token=session.token,
                    position=after,
                    batch_id=batch_id,
                    row_count=rows,
                    now=now,
                    ttl=self.lease_ttl,
                    release=release,
                    journal_entry=entry,
                    journal_limit=self.journal_limit,
                ),
                what="commit",
            )
        except LostLeaseError as exc:
            self.metrics.increment("batches_total", labels={"result": "lost"})
            self.metrics.increment("failures_total", labels={"error_type": "LostLeaseError"})
            self._log(logging.WARNING, "lease_lost", "commit rejected: %s", exc, **fields)
            raise LostLeaseError(
                str(exc), poller=self.name, batch_id=batch_id, fencing_token=session.token
            ) from exc
        except CommitError as exc:
            self.metrics.increment("batches_total", labels={"result": "commit_failed"})
            self.metrics.increment("failures_total", labels={"error_type": type(exc).__name__})
            self._log(logging.ERROR, "commit_failed", "commit failed: %s", exc, **fields)
            raise
        session.released = release
        elapsed = time.perf_counter() - started
        self.metrics.observe("commit_duration_seconds", elapsed)
        self.metrics.observe("batch_size", rows)
        self.metrics.increment("batches_total", labels={"result": "committed"})
        self.metrics.increment("events_total", rows)
        self.metrics.set_gauge("last_success_timestamp", now.timestamp())
        if isinstance(after.cursor, dt.datetime) and after.cursor.tzinfo is not None:
            self.metrics.set_gauge("lag_seconds", max(0.0, (now - after.cursor).total_seconds()))
        self._log(
            logging.INFO,
            "batch_committed",
            "committed %d rows up to %s (batch %s)",
            rows,
            after.cursor,
            batch_id,
            cursor=docmod.position_to_json(after),
            released=release,
            **{k: v for k, v in fields.items() if k != "rows"},
            rows=rows,
        )

    def _release(self, session: LeaseSession) -> None:
        now = self.clock()

        def release(doc: StateDocument) -> StateDocument:
            released = leasemod.decide_release(
                doc, owner=self.owner_id, token=session.token, now=now
            )
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
            self._log(
                logging.DEBUG, "lease_released", "lease released", fencing_token=session.token
            )
        except LostLeaseError as exc:
            self._log(
                logging.DEBUG, "lease_release_skipped", "%s", exc, fencing_token=session.token
            )
        except DbTriggerError as exc:
            self._log(
                logging.WARNING,
                "lease_release_failed",
                "could not release the lease (it expires by itself): %s",
                exc,
                fencing_token=session.token,
            )

    @staticmethod
    def _batch_id(started_at: dt.datetime, token: int, index: int) -> str:
        return f"batch_{started_at:%Y%m%d_%H%M%S}_{token}_{index + 1:04d}"

    def _report_null_cursors(self) -> None:
        """Warn about rows the source cannot deliver because their cursor is NULL.

        Runs on the first tick and then at most every ``null_check_interval``.
        """
        finder = getattr(self.source, "null_cursor_keys", None)
        if finder is None or self.null_check_interval <= 0:
            return
        now = time.monotonic()
        if now - self._last_null_check < self.null_check_interval:
            return
        self._last_null_check = now
        try:
            keys = finder()
        except DbTriggerError as exc:
            self._log(logging.WARNING, "null_check_failed", "NULL-cursor probe failed: %s", exc)
            return
        self.metrics.set_gauge("null_cursor_rows", len(keys))
        if keys:
            self._log(
                logging.WARNING,
                "null_cursor_rows",
                "%d%s row(s) have a NULL %s and cannot be delivered until it is set, e.g. %s",
                len(keys),
                "+" if len(keys) >= 10 else "",
                getattr(self.source, "cursor_column", "cursor"),
                keys[:5],
                keys=keys[:10],
            )
