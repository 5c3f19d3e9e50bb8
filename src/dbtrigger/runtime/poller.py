"""``PollTrigger``: the public face of a poller.

It validates the configuration (each option as
:mod:`dbtrigger.runtime.poll_options` checks it), registers the handler
(``@trigger.handler``) and runs ticks: :meth:`PollTrigger.tick`,
:meth:`~PollTrigger.tick_result`, :meth:`~PollTrigger.drain`,
:meth:`~PollTrigger.run` (a timer firing) and :meth:`~PollTrigger.tick_async`.
What a tick does, in order, is in :mod:`dbtrigger.runtime.tick`; what becomes
of a batch in :mod:`dbtrigger.runtime.delivery`, and how the handler is called
(the same for every trigger) in :mod:`dbtrigger.runtime.kernel`; every write to the
state document goes through :class:`~dbtrigger.runtime.session.LeaseSession`;
what is logged and counted is declared in :mod:`dbtrigger.runtime.telemetry`.

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
  the batch comes back. With a quarantine sink, a batch that failed ``max_attempts``
  times is bisected, rows that fail alone set aside: the poller moves on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dbtrigger import options as opt
from dbtrigger.history.positions import StartFrom, warn_if_recorded
from dbtrigger.history.store import HistoryStore
from dbtrigger.history.wiring import recorder_for
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.names import command_target, import_path_of, validate_name
from dbtrigger.quarantine import QuarantineSink
from dbtrigger.runtime import deprecated, kernel
from dbtrigger.runtime import drain as draining
from dbtrigger.runtime.bulk import bulk_reads_for
from dbtrigger.runtime.delivery import DeliveryOptions, cancelled_error
from dbtrigger.runtime.kernel import Handler, KeepAlive
from dbtrigger.runtime.null_probe import NullCursorProbe
from dbtrigger.runtime.poll_options import PollOptions, check_ports
from dbtrigger.runtime.quiet import QuietCadence
from dbtrigger.runtime.readahead import ReadAhead
from dbtrigger.runtime.reading import BatchReader, TickSettings
from dbtrigger.runtime.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from dbtrigger.runtime.subscriber_options import (
    SubscriberCall,
    check_fan_out,
    handler_for,
    refuse_registration,
)
from dbtrigger.runtime.subscribers import delivery_for
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.runtime.tick import TickDriver
from dbtrigger.runtime.trigger import (
    DEFAULT_MAX_BATCHES_PER_TICK,
    ClosesOnExit,
    TickResult,
    default_owner_id,
    utc_now,
)
from dbtrigger.sources.base import BindsToPoller, CountsAfter, SourceAdapter
from dbtrigger.state.document import DEFAULT_JOURNAL_LIMIT, StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.unreadable import load_state
from dbtrigger.state.window import Bound

#: The tick's one INFO line when a timer drives the poller (run(), a Functions
#: invocation); ``dbtrigger run`` logs its own on dbtrigger.runner.
tick_log = logging.getLogger("dbtrigger.runtime")

__all__ = [
    "DEFAULT_MAX_BATCHES_PER_TICK",
    "PollTrigger",
    "TickResult",
    "default_owner_id",
    "utc_now",
]


class PollTrigger(ClosesOnExit):
    """Polls ``source`` and delivers batches to a handler, at least once.

    Args:
        name: the poller name: state document key, metric label, event id salt.
        source: a :class:`~dbtrigger.sources.base.SourceAdapter`.
        checkpoint_store: a :class:`~dbtrigger.state.stores.base.CheckpointStore`.
        batch_size: rows per handler call.
        max_batches_per_tick: batches one tick may process before it returns
            (default :data:`DEFAULT_MAX_BATCHES_PER_TICK`).
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
        partitions, balance_interval_seconds, member_ttl_seconds: deprecated:
            build a :class:`~dbtrigger.partitions.PartitionedPoller` (same
            options) instead; with ``partitions`` this trigger delegates every
            tick to one (``docs/scale-out.md``).
        retry_delay_seconds: backoff before an event marked ``ctx.retry`` is
            delivered again; doubles per attempt (with jitter).
        retry_delay_max_seconds: the cap of that backoff.
        window_max_events, window_max_bytes: bound of the settled window above
            the checkpoint (events settled while an earlier one waits for a
            retry); at 75% of either the poller hands out no new rows.
        max_concurrency: lanes per batch (per subscriber with ``subscribers``).
        subscribers: fan-out: ``{name: handler}``; one read, every subscriber
            gets every event, and an event settles once each accepted it (or
            one rejected it and it was dead-lettered); a retry goes to the
            subscribers that asked for it only. ``tick()``, ``drain()`` and
            ``run()`` then take no handler. See :mod:`dbtrigger.runtime.subscribers`.
        ack_timeout_seconds: fan-out only: a subscriber call that takes longer
            fails its events for that subscriber alone (default 300).
        handler_timeout_seconds: a handler call still running after this long is
            given up as on a lost lease: no longer renewed, cancelled, never
            committed; another worker delivers the batch again (default: never).
        history / start_from: the durable history beside the store (default) or
            ``False``; where a new poller starts: ``"beginning"``, ``"now"``, a
            cursor value or a ``Position`` (see :mod:`dbtrigger.history`).
        read_ahead: read the next batch on a background thread while the
            handler and the commit of this one run, for sources that can be
            read from another thread (``SqlAlchemySource`` off SQLite). The
            default (``True``) does it only while the reads wait long enough
            (a database across a network) and reads in turn when they are
            fast (localhost), measuring again now and then; ``"always"``
            reads ahead after every batch; ``False`` reads each batch after
            the last one's commit. See :mod:`dbtrigger.runtime.readahead`.
        bulk_reads: catch up reading up to 10 batches a query (:mod:`dbtrigger.runtime.bulk`).
    """

    def __init__(
        self,
        *,
        name: str,
        source: SourceAdapter,
        checkpoint_store: CheckpointStore,
        batch_size: int = 100,
        max_batches_per_tick: int = DEFAULT_MAX_BATCHES_PER_TICK,
        lease_ttl_seconds: float = 120,
        metrics: MetricsCollector | None = None,
        owner_id: str | None = None,
        clock: Callable[[], dt.datetime] | None = None,
        journal_limit: int = DEFAULT_JOURNAL_LIMIT,
        null_check_interval_seconds: float = 300,
        heartbeat_interval_seconds: float | None = None,
        retry: RetryPolicy | None = None,
        quarantine: QuarantineSink | None = None,
        max_attempts: int = 5,
        quarantine_limit: int = 10,
        partitions: int | None = None,
        balance_interval_seconds: float | None = None,
        member_ttl_seconds: float | None = None,
        retry_delay_seconds: float = 5.0,
        retry_delay_max_seconds: float = 300.0,
        window_max_events: int = 1000,
        window_max_bytes: int = 48 * 1024,
        max_concurrency: int = 1,
        subscribers: Mapping[str, Handler] | Iterable[tuple[str, Handler]] | None = None,
        ack_timeout_seconds: float | None = None,
        handler_timeout_seconds: float | None = None,
        history: HistoryStore | bool | None = None,
        start_from: object = None,
        read_ahead: bool | str = True,
        bulk_reads: bool = True,
    ) -> None:
        #: The arguments as given: ``dbtrigger backfill`` derives its trigger from them.
        self.options = options = {k: v for k, v in locals().items() if k != "self"}
        self.name = validate_name(name, "poller name")
        # Every numeric option's type and range, then how they relate (poll_options).
        checked = PollOptions.check(options)
        check_ports(source, checkpoint_store)
        partitions = checked.partitions
        #: Fan-out (see dbtrigger.runtime.subscribers): name -> handler, or None.
        self.subscribers, self.ack_timeout = check_fan_out(
            subscribers, ack_timeout=checked.ack_timeout_seconds
        )
        self.source = source
        self.store = checkpoint_store
        self.batch_size = checked.batch_size
        self.max_batches_per_tick = checked.max_batches_per_tick
        self.lease_ttl = dt.timedelta(seconds=checked.lease_ttl_seconds)
        self.metrics = SafeMetrics(metrics, self.name)
        self.owner_id = owner_id or default_owner_id()
        self.clock = clock or utc_now
        self.journal_limit = checked.journal_limit
        self.null_check_interval = checked.null_check_interval_seconds
        self._fingerprint: str | None = None
        self._quiet = QuietCadence()  # report()'s: a timer-fired idle poller says so once
        self.default_handler: Handler | None = None
        self.heartbeat_interval = checked.heartbeat_interval_seconds
        self.retry = retry or DEFAULT_RETRY_POLICY
        self.quarantine = quarantine
        self.max_attempts = checked.max_attempts
        self.quarantine_limit = checked.quarantine_limit
        self.max_concurrency = checked.max_concurrency
        self.telemetry = Telemetry(self.name, self.metrics)
        if isinstance(source, BindsToPoller):
            source.bind_poller(self.name, self.metrics)  # e.g. a slot named after the poller
        self.null_probe = NullCursorProbe(checked.null_check_interval_seconds)
        #: The last tick's result; a tick that raised leaves one with outcome
        #: ``"failed"`` (and what it committed before failing) for the log line
        #: a worker writes per tick.
        self.last_result: TickResult | None = None
        #: How an operator names this poller to the CLI (``--source MODULE:ATTR``);
        #: set by the CLI and by ``DbBindings`` so log lines can print exact commands.
        self.cli_source: str | None = None
        #: The heartbeat thread that renews this trigger's lease while a batch runs.
        self._keepalive = KeepAlive(self.name)
        reader = BatchReader(
            TickSettings(
                name=self.name,
                owner_id=self.owner_id,
                batch_size=checked.batch_size,
                max_batches_per_tick=checked.max_batches_per_tick,
                lease_ttl=self.lease_ttl,
                journal_limit=checked.journal_limit,
                heartbeat_interval=checked.heartbeat_interval_seconds,
                null_check_interval=checked.null_check_interval_seconds,
                retry=self.retry,
                bound=Bound(checked.window_max_events, checked.window_max_bytes),
                retry_delay=checked.retry_delay_seconds,
                retry_delay_max=checked.retry_delay_max_seconds,
            ),
            source=source,
            store=checkpoint_store,
            clock=self.clock,
            fingerprint=lambda: self.fingerprint,
            telemetry=self.telemetry,
            delivery=delivery_for(
                DeliveryOptions(
                    poller=self.name,
                    owner_id=self.owner_id,
                    clock=self.clock,
                    telemetry=self.telemetry,
                    retry=self.retry,
                    quarantine=quarantine,
                    max_attempts=checked.max_attempts,
                    quarantine_limit=checked.quarantine_limit,
                    max_concurrency=checked.max_concurrency,
                    cli_target=self.cli_target,
                ),
                subscribers=self.subscribers,
                ack_timeout=self.ack_timeout,
            ),
            null_probe=self.null_probe,
            cli_source=self.operator_spec,
        )
        read_ahead = opt.flag_or("read_ahead", read_ahead, "always")
        if read_ahead:
            reader.read_ahead = ReadAhead(
                source.fetch, name=self.name, always=read_ahead == "always"
            )
        reader.bulk = bulk_reads_for(source, checked, opt.flag("bulk_reads", bulk_reads))
        self._driver = TickDriver(
            reader, keepalive=self._keepalive, handler_timeout=checked.handler_timeout_seconds
        )
        #: The durable history beside the state document (None: kept nowhere), and
        #: ``start_from``, applied before this process's first tick.
        self.history, self._driver.writer.history = recorder_for(history, self)
        self._start = StartFrom.of(start_from, source, partitioned=partitions is not None)
        reader.missing = lambda: warn_if_recorded(self)  # a deleted document, said
        #: Deprecated ``partitions=``: the PartitionedPoller every tick is delegated to.
        self.partitioned: Any = None
        if partitions is not None:
            self.partitioned = deprecated.delegate_partitions(
                {**options, "name": self.name}, partitions=partitions, owner_id=self.owner_id
            )

    def _handler_for(self, handler: Handler | None) -> Handler:
        return handler_for(self.name, self.subscribers, handler, self.default_handler)

    # --- public API ----------------------------------------------------------------

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register ``fn`` as the handler ``dbtrigger run`` drives."""
        refuse_registration(self.name, self.subscribers)
        self.default_handler = fn
        return fn

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.source.fingerprint()
        return self._fingerprint

    def run(self, *, timer: Any = None, handler: Handler | None = None) -> int:
        """Run one tick for a timer firing; returns the number of rows committed.

        Logs the tick's one INFO line (:meth:`report`): a timer firing is the
        driver of the tick, as ``dbtrigger run`` is for a worker.
        """
        if timer is not None and self.options["ack_timeout_seconds"] is None:
            self._driver.reader.delivery.under_timer()  # (fan-out: a Functions budget)
        try:
            return self.report(self.tick_result(handler)).rows
        finally:
            self.flush_history()  # a Functions host may freeze the process on return

    def report(self, result: TickResult) -> TickResult:
        """Log ``result`` as the tick's one line (``event=tick``): rows, batches,
        the checkpoint and when it was committed. Per-batch records are DEBUG, so a
        timer-driven poller (a Functions invocation) says one line per firing; a
        quiet state (idle, held back, the lease elsewhere) is INFO when it begins,
        DEBUG while it repeats and INFO again every 5 minutes as ``still ...``."""
        level, text, fields = self._quiet.line(result, None)
        tick_log.log(
            level,
            "%s: %s",
            self.name,
            text,
            extra={"event": "tick", "outcome": result.outcome, "poller": self.name, **fields},
        )
        return result

    def tick(
        self, handler: Handler | None = None, *, should_stop: Callable[[], bool] | None = None
    ) -> int:
        """One tick; the rows committed. Returns with the tick's history written
        (:meth:`flush_history`), unlike :meth:`tick_result`, the runner's call."""
        try:
            return self.tick_result(handler, should_stop=should_stop).rows
        finally:
            self.flush_history()

    def flush_history(self) -> bool:
        """Wait (boundedly) until the history records of the commits so far are
        written; whether they all are (see :mod:`dbtrigger.history.recorder`:
        the appender thread writes them, off the tick). Never raises."""
        written = self._driver.writer.history.flush()
        if self.partitioned is not None:
            written = self.partitioned.flush_history() and written
        return written

    def tick_result(
        self, handler: Handler | None = None, *, should_stop: Callable[[], bool] | None = None
    ) -> TickResult:
        """One tick (see :mod:`dbtrigger.runtime.tick`); what it did.

        Its history records may still be on their way when it returns (the
        runner and :meth:`drain` tick on, and flush when they stop):
        :meth:`tick` and :meth:`flush_history` wait for them.

        Partitioned: one tick of every partition this member owns. With
        ``subscribers=`` no handler is passed (passing one is a
        :class:`~dbtrigger.errors.ConfigurationError`, as is passing none
        without subscribers).
        """
        handler = self._handler_for(handler)
        if self.partitioned is not None:
            self.last_result = self.partitioned.tick_result(handler, should_stop=should_stop)
            return self.last_result
        try:
            if self._start is not None and not self._start.done:
                self._start.apply(self)  # a new poller's start position (dbtrigger.history)
            result = self._driver.run(handler, should_stop)
        except BaseException as exc:
            rows, batches = self._driver.committed
            self.last_result = TickResult(rows, batches, "failed", error=type(exc).__name__)
            raise
        self.last_result = result
        return result

    def operator_spec(self) -> str | None:
        """``module:attribute`` an operator's command names this poller by, if known.

        Set by the CLI and ``DbBindings``; otherwise found among the globals of
        the imported modules (a trigger built in a script run as ``__main__``
        has none).
        """
        return self.cli_source or import_path_of(self)

    def cli_target(self) -> str:
        """``POLLER --source MODULE:ATTR`` (or ``--store ...``) for a pasteable command."""
        return command_target(self.name, self.operator_spec(), self.store.describe())

    def drain(
        self,
        handler: Handler | None = None,
        *,
        max_ticks: int | None = None,
        progress: Callable[[int, TickResult], None] | None = None,
        lease_wait_seconds: float = 0.0,
        held_wait_seconds: float = draining.DEFAULT_HELD_WAIT_SECONDS,
        retry_wait_seconds: float = draining.DEFAULT_RETRY_WAIT_SECONDS,
        stop: threading.Event | None = None,
    ) -> int:
        """Tick until nothing is left to deliver; the rows committed (see
        :mod:`dbtrigger.runtime.drain`). On return no row after the checkpoint
        waits, held back or for a retry. It waits for a lease held elsewhere (up to
        ``lease_wait_seconds``; a partitioned member's rounds have no lease of their
        own), a hold (``held_wait_seconds``) and a retry due within
        ``retry_wait_seconds`` of the last row, and raises LeaseAcquireError /
        FetchError / HandlerError past them (nothing skipped); ``stop`` ends a wait
        and the drain; ``progress(rows_so_far, result)`` is called after every tick."""
        try:
            return draining.drain(
                self,
                self._handler_for(handler),
                max_ticks=max_ticks,
                progress=progress,
                lease_wait_seconds=lease_wait_seconds if self.partitioned is None else None,
                held_wait_seconds=held_wait_seconds,
                retry_wait_seconds=retry_wait_seconds,
                stop=stop,
            )
        finally:
            self.flush_history()

    async def run_async(self, *, timer: Any = None, handler: Handler | None = None) -> int:
        """:meth:`run` for async code (a Functions ``async def`` timer function)."""
        if timer is not None and self.options["ack_timeout_seconds"] is None:
            self._driver.reader.delivery.under_timer()
        rows = await self.tick_async(handler)  # (flushed: a host may freeze on return)
        if self.last_result is not None:
            self.report(self.last_result)
        return rows

    async def tick_async(self, handler: Handler | None = None) -> int:
        """One tick for async code: I/O runs in a worker thread, an async handler
        runs on the caller's event loop.

        If the lease is lost while the handler runs (a heartbeat was rejected),
        the handler's task is cancelled and awaited until it has really
        stopped, and the tick raises :class:`~dbtrigger.errors.LostLeaseError`
        without committing.
        """
        loop = asyncio.get_running_loop()

        def on_loop(fn: Handler, wants_ctx: bool) -> Handler:
            return kernel.on_loop(fn, wants_ctx, loop, cancelled_error)

        chosen = self._handler_for(handler)
        if isinstance(chosen, SubscriberCall):
            # Fan-out: each async subscriber runs on the caller's loop too.
            return await asyncio.to_thread(self.tick, SubscriberCall(on_loop))
        # (tick(), not tick_result(): it returns with the history written)
        return await asyncio.to_thread(self.tick, on_loop(chosen, kernel.wants_context(chosen)))

    def read_state(self) -> StateDocument | None:
        stored = self.store.read(self.name)
        return load_state(self.store, self.name, stored) if stored else None

    def rows_behind(self) -> int | None:
        """Rows after the committed checkpoint, if the source can count them."""
        if not isinstance(self.source, CountsAfter):
            return None
        doc = self.read_state()
        return int(self.source.count_after(doc.position)) if doc is not None else None

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        """The worker's idle sleep: up to ``seconds``, ended early by ``stop``; a
        deprecated ``partitions=`` member's also when it gains partitions."""
        if self.partitioned is not None:
            return bool(self.partitioned.wait_for_work(seconds, stop))
        stop.wait(seconds)
        return False

    def close(self) -> None:
        """Write what the history has queued (a bounded wait), stop the heartbeat and
        history threads and shut the lane pool down (all start again if the trigger
        ticks afterwards); a deprecated ``partitions=`` member's too."""
        self._driver.writer.history.close()
        if self._driver.reader.read_ahead is not None:
            self._driver.reader.read_ahead.close()
        self._keepalive.close()
        self._driver.delivery.close()
        if self.partitioned is not None:
            self.partitioned.close()
