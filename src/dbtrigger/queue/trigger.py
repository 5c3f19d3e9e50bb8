"""``QueueTrigger``: competing workers over a claim queue table.

The face: it validates the configuration, registers the handler
(``@queue.handler``) and runs ticks - :meth:`~QueueTrigger.tick`,
:meth:`~QueueTrigger.tick_result`, :meth:`~QueueTrigger.drain`,
:meth:`~QueueTrigger.run` (a timer firing) and
:meth:`~QueueTrigger.tick_async` - named and behaving as a
:class:`~dbtrigger.PollTrigger`'s. One tick is up to ``max_batches_per_tick``
claims, each run by the claim driver (:mod:`dbtrigger.queue.driver`); the
handler call, lanes, the heartbeat thread and dead-letter records are the
delivery kernel's (:mod:`dbtrigger.runtime.kernel`), shared with the poller.

There is no lease and no state document: any number of triggers (threads,
processes, Function instances) claim disjoint rows at once. Delivery is at
least once: a worker that dies after its handler's side effect but before the
settlement leaves the row to expire and be delivered again. Handlers should
be idempotent (the event id is stable for a row).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dbtrigger import options as opt
from dbtrigger._deprecation import DeprecatedAlias
from dbtrigger._driver_errors import failed_as
from dbtrigger.errors import ConfigurationError, FetchError
from dbtrigger.health import HealthReport
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.names import validate_name
from dbtrigger.quarantine import QuarantineSink
from dbtrigger.queue import operations
from dbtrigger.queue.driver import ClaimDriver, ClaimSettings, QueueTickResult
from dbtrigger.queue.health import claims_health
from dbtrigger.queue.lock_waits import reads
from dbtrigger.queue.notify import Listener, check_channel, idle_wait
from dbtrigger.queue.operations import QueueCounts
from dbtrigger.queue.schema import WORKER_ID_LIMIT
from dbtrigger.queue.source import ClaimSource
from dbtrigger.runtime import kernel, let_go
from dbtrigger.runtime.drain import DEFAULT_RETRY_WAIT_SECONDS, DrainWait, tick_until_drained
from dbtrigger.runtime.kernel import Handler, KeepAlive, Lanes
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.runtime.trigger import (
    DEFAULT_MAX_BATCHES_PER_TICK,
    ClosesOnExit,
    default_owner_id,
    utc_now,
)
from dbtrigger.state.backoff import Backoff

__all__ = ["QueueTickResult", "QueueTrigger", "default_worker_id"]

log = logging.getLogger("dbtrigger.queue")


def default_worker_id() -> str:
    """The default ``owner_id`` of a queue: ``host/pid/random``, cut to its column."""
    return default_owner_id()[:WORKER_ID_LIMIT]


def _renamed(old: str, new: str, value: Any, current: Any, default: Any) -> Any:
    """A deprecated keyword's value, warned about; refused next to its new name."""
    if value is None:
        return current
    if current != default:
        raise ConfigurationError(f"QueueTrigger got both {old}= and {new}=; pass {new}= only")
    warnings.warn(
        f"QueueTrigger({old}=...) is deprecated: use {new}=..., as on PollTrigger",
        DeprecationWarning,
        stacklevel=3,
    )
    return value


class QueueTrigger(ClosesOnExit):
    """Competing-worker delivery from a :class:`~dbtrigger.queue.source.ClaimSource`.

    Args:
        name: the queue's name (metric label, event id salt, dead-letter records).
        source: the :class:`ClaimSource`.
        batch_size: rows claimed per claim.
        max_batches_per_tick: claims one tick may make; it stops early when a
            claim comes back short (default 1, as for a poller).
        max_concurrency: lanes a claimed batch is split into and run at once.
        visibility_timeout_seconds: how long a claim hides its rows; a claim not
            extended for this long expires and the rows become claimable again
            (counting an attempt).
        heartbeat_interval_seconds: how often a running claim is extended;
            below half the visibility timeout (default a third of it).
        max_attempts: attempts (claims) before a failing row is dead.
        quarantine: a :class:`~dbtrigger.quarantine.QuarantineSink` that
            receives every row that goes dead (it also stays in the table as
            ``dead`` in columns mode); the dead-letter sink.
        metrics: a :class:`~dbtrigger.metrics.MetricsCollector`.
        retry_delay_seconds / retry_delay_max_seconds: the exponential
            backoff of a failed row (first delay ~ base, doubling, capped).
        owner_id: this worker's name in ``dbt_claimed_by`` (default host/pid/random).
        seed: seed for the backoff jitter (tests).
        notify_channel: PostgreSQL only, off by default: also ``LISTEN`` on this
            channel while idle in worker mode, so a producer's ``NOTIFY`` wakes
            the worker at once. A hint on top of the interval poll, never
            instead of it (:mod:`dbtrigger.queue.notify`).
        handler_timeout_seconds: a handler call still running after this long
            is given up: its claim is no longer extended (the rows become
            claimable again and another worker delivers them), ``ctx.cancelled``
            is set and nothing it returns is recorded. Off by default; a call
            running past ``visibility_timeout_seconds`` is reported either way
            (``handler_slow``, then ``handler_stuck``).
        dead_letter, retry_backoff_seconds, retry_backoff_max_seconds, worker_id:
            deprecated spellings of ``quarantine``, ``retry_delay_seconds``,
            ``retry_delay_max_seconds`` and ``owner_id``.
    """

    def __init__(
        self,
        *,
        name: str,
        source: ClaimSource,
        batch_size: int = 100,
        max_batches_per_tick: int = DEFAULT_MAX_BATCHES_PER_TICK,
        max_concurrency: int = 1,
        visibility_timeout_seconds: float = 60,
        heartbeat_interval_seconds: float | None = None,
        max_attempts: int = 5,
        quarantine: QuarantineSink | None = None,
        metrics: MetricsCollector | None = None,
        retry_delay_seconds: float = 1.0,
        retry_delay_max_seconds: float = 300.0,
        owner_id: str | None = None,
        seed: int | None = None,
        notify_channel: str | None = None,
        handler_timeout_seconds: float | None = None,
        dead_letter: QuarantineSink | None = None,
        retry_backoff_seconds: float | None = None,
        retry_backoff_max_seconds: float | None = None,
        worker_id: str | None = None,
    ) -> None:
        quarantine = _renamed("dead_letter", "quarantine", dead_letter, quarantine, None)
        retry_delay_seconds = _renamed(
            "retry_backoff_seconds",
            "retry_delay_seconds",
            retry_backoff_seconds,
            retry_delay_seconds,
            1.0,
        )
        retry_delay_max_seconds = _renamed(
            "retry_backoff_max_seconds",
            "retry_delay_max_seconds",
            retry_backoff_max_seconds,
            retry_delay_max_seconds,
            300.0,
        )
        owner_id = _renamed("worker_id", "owner_id", worker_id, owner_id, None)
        self.name = validate_name(name, "queue name")
        if not isinstance(source, ClaimSource):
            raise ConfigurationError(
                f"QueueTrigger needs a ClaimSource, got {type(source).__name__}; "
                "a keyset source is driven by PollTrigger"
            )
        # Every numeric option's type and range (dbtrigger.options), then how they relate.
        batch_size, max_batches_per_tick, max_concurrency, max_attempts = (
            opt.whole("batch_size", batch_size),
            opt.whole("max_batches_per_tick", max_batches_per_tick),
            opt.whole("max_concurrency", max_concurrency),
            opt.whole("max_attempts", max_attempts),
        )
        visibility_timeout_seconds = opt.seconds(
            "visibility_timeout_seconds", visibility_timeout_seconds
        )
        heartbeat_interval_seconds = opt.optional_seconds(
            "heartbeat_interval_seconds", heartbeat_interval_seconds
        )
        retry_delay_seconds = opt.seconds(
            "retry_delay_seconds", retry_delay_seconds, inclusive=True
        )
        retry_delay_max_seconds = opt.seconds(
            "retry_delay_max_seconds", retry_delay_max_seconds, inclusive=True
        )
        handler_timeout_seconds = opt.optional_seconds(
            "handler_timeout_seconds", handler_timeout_seconds
        )
        if seed is not None:
            seed = opt.whole("seed", seed, minimum=-(2**63))
        if heartbeat_interval_seconds is None:
            heartbeat_interval_seconds = visibility_timeout_seconds / 3
        if not heartbeat_interval_seconds < visibility_timeout_seconds / 2:
            raise ConfigurationError(
                f"visibility_timeout_seconds ({visibility_timeout_seconds:g}) must be more than "
                f"twice heartbeat_interval_seconds ({heartbeat_interval_seconds:g}), so one "
                "extension can fail and the next still lands before the claim expires"
            )
        self.source = source
        self.batch_size = batch_size
        self.max_batches_per_tick = max_batches_per_tick
        self.max_concurrency = max_concurrency
        self.visibility_timeout = float(visibility_timeout_seconds)
        self.heartbeat_interval = float(heartbeat_interval_seconds)
        self.max_attempts = max_attempts
        self.handler_timeout = handler_timeout_seconds
        self.quarantine = quarantine
        self.metrics = SafeMetrics(metrics, self.name)
        self.telemetry = Telemetry(self.name, self.metrics, logger=log)
        self.notify_channel = check_channel(source, notify_channel) if notify_channel else None
        self._listener = (
            Listener(source, self.notify_channel, self.telemetry) if self.notify_channel else None
        )
        self.backoff = Backoff(retry_delay_seconds, retry_delay_max_seconds)
        self.owner_id = (owner_id or default_owner_id())[:WORKER_ID_LIMIT]
        self.default_handler: Handler | None = None
        #: The last tick's result; a tick that raised leaves one with outcome
        #: ``"failed"`` counting the rows its earlier claims completed.
        self.last_result: QueueTickResult | None = None
        #: Whether a tick that leaves nothing claimable counts the retries waiting.
        self._count_retries = True
        self._keepalive = KeepAlive(self.name)
        self._lanes = Lanes(max_concurrency, name=self.name) if max_concurrency > 1 else None
        self._driver = ClaimDriver(
            ClaimSettings(
                name=self.name,
                owner_id=self.owner_id,
                batch_size=batch_size,
                visibility_timeout=self.visibility_timeout,
                heartbeat_interval=self.heartbeat_interval,
                max_attempts=max_attempts,
                backoff=self.backoff,
                quarantine=quarantine,
                handler_timeout=handler_timeout_seconds,
            ),
            source=source,
            telemetry=self.telemetry,
            keepalive=self._keepalive,
            lanes=self._lanes,
            seed=seed,
        )

    dead_letter: DeprecatedAlias[QuarantineSink | None] = DeprecatedAlias(
        "quarantine", "QueueTrigger.dead_letter is deprecated: use .quarantine, as on PollTrigger"
    )
    worker_id: DeprecatedAlias[str] = DeprecatedAlias(
        "owner_id", "QueueTrigger.worker_id is deprecated: use .owner_id, as on PollTrigger"
    )

    # --- public API -----------------------------------------------------------------

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register ``fn`` as the handler ``dbtrigger run`` drives."""
        self.default_handler = fn
        return fn

    def run(self, *, timer: Any = None, handler: Handler) -> int:
        """One tick for a timer firing (up to ``max_batches_per_tick`` claims);
        returns the rows completed."""
        del timer  # the schedule is the host's business; the tick is the same
        return self.tick(handler)

    def tick(self, handler: Handler, *, should_stop: Callable[[], bool] | None = None) -> int:
        return self.tick_result(handler, should_stop=should_stop).rows

    def tick_result(
        self, handler: Handler, *, should_stop: Callable[[], bool] | None = None
    ) -> QueueTickResult:
        """Up to ``max_batches_per_tick`` claims, each delivered and settled; stops
        when a claim comes back short or ``should_stop()`` says so.

        A tick that leaves nothing claimable counts the rows waiting for a retry
        (one query), so its result says whether a drain is over (``caught_up``):
        on this trigger's first such tick, after any tick that claimed rows, and
        while rows wait. An idle worker that found none waiting does not count
        again until it claims (a million rows scheduled for later would make
        every idle tick read them).
        """
        result: QueueTickResult | None = None
        # A call given up at the handler timeout is not waited for once should_stop().
        stop = should_stop if self.handler_timeout is not None else None
        try:
            with let_go.stop_waiting_when(stop):
                for _ in range(self.max_batches_per_tick):
                    claim = self._driver.claim(handler)
                    result = claim if result is None else result.then(claim)
                    if not claim.more or (should_stop is not None and should_stop()):
                        break
            assert result is not None  # noqa: S101 - max_batches_per_tick >= 1
            self._count_retries = self._count_retries or result.claimed > 0
            if not result.more and self._count_retries:
                waiting, due_in, held, expires_in = self._retries_waiting()
                self._count_retries = waiting > 0
                if waiting:
                    due = utc_now() + dt.timedelta(seconds=due_in or 0.0)
                    result = replace(result, waiting_retries=waiting, next_retry_at=due)
                if held:  # (a worker killed mid-claim holds them until its claim expires)
                    expires = utc_now() + dt.timedelta(seconds=expires_in or 0.0)
                    result = replace(result, claimed_elsewhere=held, claim_expires_at=expires)
        except BaseException:
            rows = result.rows if result is not None else 0
            self.last_result = QueueTickResult(rows, 0, "failed")
            raise
        self.last_result = result
        return result

    def drain(
        self,
        handler: Handler,
        *,
        max_ticks: int | None = None,
        retry_wait_seconds: float = DEFAULT_RETRY_WAIT_SECONDS,
        stop: threading.Event | None = None,
    ) -> int:
        """Tick until nothing is claimable and no row waits for a retry; rows completed.

        A row a handler (this worker's or another's) retried is ``ready`` but not
        due: the drain sleeps until the first is due and claims it, as long as
        that is within ``retry_wait_seconds`` of the last claim, and otherwise
        raises :class:`~dbtrigger.errors.HandlerError` saying how many wait and
        until when (nothing was skipped). Not waited for: rows another worker
        holds a live claim on (it settles them; if it dies they are claimable
        when the claim expires) and rows enqueued to run later. ``stop`` ends a
        wait at once, and the drain after the claim in flight.
        """
        waits = DrainWait(
            self.name,
            retry_seconds=retry_wait_seconds,
            stop=stop,
            where="they stay ready in the table, claimable when due",
        )
        self._count_retries = True  # every tick that leaves nothing claimable counts them
        return tick_until_drained(
            lambda: self.tick_result(handler, should_stop=waits.stop.is_set),
            waits,
            max_ticks=max_ticks,
            delivered=lambda result: result.claimed > 0,
            again=lambda result: result.more,
        )

    def _retries_waiting(self) -> tuple[int, float | None, int, float | None]:
        """Rows waiting for a retry and when the first is due, rows under a live
        claim and when the first claim expires."""
        target = self.source.target
        what = f"retries waiting in {self.source.name}"
        with failed_as(FetchError, f"{what}: read failed"), reads(self.source, what) as conn:
            return (
                *operations.retries_waiting(target, conn),
                *operations.claims_held(target, conn),
            )

    async def tick_async(self, handler: Handler) -> int:
        """One tick for async code: the SQL runs in a worker thread, an async
        handler runs on the caller's event loop (cancelled if the claim is lost)."""
        return (await self.tick_result_async(handler)).rows

    async def tick_result_async(self, handler: Handler) -> QueueTickResult:
        """:meth:`tick_async` with the whole :class:`QueueTickResult`."""
        loop = asyncio.get_running_loop()
        shim = kernel.on_loop(handler, kernel.wants_context(handler), loop, lambda ctx: None)
        return await asyncio.to_thread(self.tick_result, shim)

    def status(self) -> QueueCounts:
        return self.source.counts()

    def health(
        self, *, stale_after_seconds: float = 600.0, now: dt.datetime | None = None
    ) -> HealthReport:
        """This worker's claims in flight: **stale** when one has been held (its
        handler call running, the heartbeat extending it) longer than
        ``stale_after_seconds``; see :mod:`dbtrigger.queue.health`. Reads nothing."""
        return claims_health(
            self.name,
            dict(self._driver.in_flight),
            visibility_timeout=self.visibility_timeout,
            stale_after_seconds=stale_after_seconds,
            now=now or self._driver.clock(),
        )

    def rows_behind(self) -> int | None:
        """Not counted for a queue (its progress line counts what was done)."""
        return None

    # --- worker mode ----------------------------------------------------------------

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        """The runner's idle sleep: up to ``seconds``, ended early by ``stop``, or by a
        ``NOTIFY`` on ``notify_channel`` when the hint is on (then True)."""
        return idle_wait(self._listener, seconds, stop)

    def stop_listening(self) -> None:
        """Stop the wake-up listener, if any."""
        if self._listener is not None:
            self._listener.stop()

    def close(self) -> None:
        """Stop the listener, the heartbeat thread and the lane pool (all start
        again if the trigger is used afterwards)."""
        self.stop_listening()
        self._keepalive.close()
        if self._lanes is not None:
            self._lanes.close()
