"""``QueueTrigger``: claim a batch, hand it over, record each row's outcome.

One tick:

1. **Claim** up to ``batch_size`` claimable rows with a fresh claim token
   (one statement or transaction, see :mod:`dbtrigger.queue.statements`). The
   claim counts an attempt and hides the rows for
   ``visibility_timeout_seconds``. The rows of a claim that expired without
   an outcome (its worker died) are claimed again in halves
   (:mod:`dbtrigger.queue.pick`); a row isolated that way that has had
   ``max_attempts`` attempts goes dead here, without a handler call.
2. While the handler works, a **heartbeat** thread pushes the claim's expiry on
   every ``heartbeat_interval_seconds``. If it finds the claim holds no row any
   more (it expired and others took them), ``ctx.cancelled`` turns true and an
   async handler is cancelled.
3. **Settle**: :func:`~dbtrigger.queue.outcome.decide` turns the handler's
   result and marks into done / retry / dead; dead rows are written to the
   ``dead_letter`` sink first (durably), then every outcome is recorded in one
   transaction fenced by the claim token. A row whose claim was lost is
   reported (``claims_lost`` in the result, WARNING ``claim_lost``, metric
   ``queue_rows_total{result="lost"}``), never overwritten.

There is no lease and no state document: any number of triggers (threads,
processes, Function instances) claim disjoint rows at once. With
``max_concurrency > 1`` the claimed batch is split into that many lanes that
run at the same time (threads for a sync handler, tasks on one loop for an
async one), each settled as soon as it finishes.

Delivery is at least once: a worker that dies after its handler's side effect
but before the settlement leaves the row to expire and be delivered again.
Handlers should be idempotent (the event id is stable for a row).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dbtrigger import options as opt
from dbtrigger.errors import (
    CommitError,
    ConfigurationError,
    DbTriggerError,
    QuarantineError,
)
from dbtrigger.events import EventIds, RowChange
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.names import validate_name
from dbtrigger.quarantine import (
    QuarantineRecord,
    QuarantineSink,
    encode_json_value,
    put_records,
)
from dbtrigger.queue.context import ClaimContext
from dbtrigger.queue.layout import ClaimedRow
from dbtrigger.queue.notify import Listener, check_channel
from dbtrigger.queue.operations import QueueCounts
from dbtrigger.queue.outcome import EXPIRED_ERROR, Backoff, Plan, decide, expired_too_often
from dbtrigger.queue.schema import WORKER_ID_LIMIT
from dbtrigger.queue.source import ClaimSource
from dbtrigger.queue.statements import DeadItem, Key, Settled
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.runtime.tick import wants_context

log = logging.getLogger("dbtrigger.queue")

Handler = Callable[..., Any]

#: How long the heartbeat thread waits for a new claim before it exits.
_HEARTBEAT_IDLE_EXIT_SECONDS = 2.0

#: How often an async handler's guard looks at the claim-lost flag.
_CANCEL_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class QueueTickResult:
    """What one tick did; ``rows``/``batches``/``outcome``/``more`` as for a poller's tick.

    ``rows`` counts rows completed (done); ``more`` is True when the claim came
    back full or left claimable rows behind (rows of an expired claim are not
    mixed with others), so the runner claims again at once instead of sleeping.
    """

    rows: int
    batches: int
    outcome: str  # "settled" or "idle"
    more: bool = False
    claimed: int = 0
    retried: int = 0
    dead: int = 0
    claims_lost: int = 0
    token: str | None = None
    settled: tuple[tuple[Key, str], ...] = field(default=(), repr=False)


def default_worker_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"[:WORKER_ID_LIMIT]


class QueueTrigger:
    """Competing-worker delivery from a :class:`~dbtrigger.queue.source.ClaimSource`.

    Args:
        name: the queue's name (metric label, event id salt, dead-letter records).
        source: the :class:`ClaimSource`.
        batch_size: rows claimed per tick.
        max_concurrency: lanes a claimed batch is split into and run at once.
        visibility_timeout_seconds: how long a claim hides its rows; a claim not
            extended for this long expires and the rows become claimable again
            (counting an attempt).
        heartbeat_interval_seconds: how often a running claim is extended;
            below half the visibility timeout (default a third of it).
        max_attempts: attempts (claims) before a failing row is dead.
        dead_letter: a :class:`~dbtrigger.quarantine.QuarantineSink` that
            receives every row that goes dead (it also stays in the table as
            ``dead`` in columns mode).
        metrics: a :class:`~dbtrigger.metrics.MetricsCollector`.
        retry_backoff_seconds / retry_backoff_max_seconds: the exponential
            backoff of a failed row (first delay ~ base, doubling, capped).
        worker_id: this worker's name in ``dbt_claimed_by`` (default host/pid/random).
        seed: seed for the backoff jitter (tests).
        notify_channel: PostgreSQL only, off by default: also ``LISTEN`` on this
            channel while idle in worker mode, so a producer's ``NOTIFY`` wakes
            the worker at once. A hint on top of the interval poll, never
            instead of it (:mod:`dbtrigger.queue.notify`).
    """

    def __init__(
        self,
        *,
        name: str,
        source: ClaimSource,
        batch_size: int = 100,
        max_concurrency: int = 1,
        visibility_timeout_seconds: float = 60,
        heartbeat_interval_seconds: float | None = None,
        max_attempts: int = 5,
        dead_letter: QuarantineSink | None = None,
        metrics: MetricsCollector | None = None,
        retry_backoff_seconds: float = 1.0,
        retry_backoff_max_seconds: float = 300.0,
        worker_id: str | None = None,
        seed: int | None = None,
        notify_channel: str | None = None,
    ) -> None:
        self.name = validate_name(name, "queue name")
        if not isinstance(source, ClaimSource):
            raise ConfigurationError(
                f"QueueTrigger needs a ClaimSource, got {type(source).__name__}; "
                "a keyset source is driven by PollTrigger"
            )
        batch_size, max_concurrency, max_attempts = (
            opt.whole("batch_size", batch_size),
            opt.whole("max_concurrency", max_concurrency),
            opt.whole("max_attempts", max_attempts),
        )
        visibility_timeout_seconds = opt.seconds(
            "visibility_timeout_seconds", visibility_timeout_seconds
        )
        heartbeat_interval_seconds = opt.optional_seconds(
            "heartbeat_interval_seconds", heartbeat_interval_seconds
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
        self.max_concurrency = max_concurrency
        self.visibility_timeout = float(visibility_timeout_seconds)
        self.heartbeat_interval = float(heartbeat_interval_seconds)
        self.max_attempts = max_attempts
        self.dead_letter = dead_letter
        self.metrics = SafeMetrics(metrics, self.name)
        self.telemetry = Telemetry(self.name, self.metrics, logger=log)
        self.notify_channel = check_channel(source, notify_channel) if notify_channel else None
        self._listener = (
            Listener(source, self.notify_channel, self.telemetry) if self.notify_channel else None
        )
        self.backoff = Backoff(
            opt.seconds("retry_backoff_seconds", retry_backoff_seconds, inclusive=True),
            opt.seconds("retry_backoff_max_seconds", retry_backoff_max_seconds, inclusive=True),
        )
        self.worker_id = (worker_id or default_worker_id())[:WORKER_ID_LIMIT]
        self._rng = random.Random(seed)  # noqa: S311 - jitter, not security
        self._ids = EventIds(self.name, source.pk_columns)
        self.default_handler: Handler | None = None
        self._beats = _Heartbeats()

    # --- public API -----------------------------------------------------------------

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register ``fn`` as the handler ``dbtrigger run`` drives."""
        self.default_handler = fn
        return fn

    def run(self, *, timer: Any = None, handler: Handler) -> int:
        """One tick for a timer firing: claims until a claim comes back short.

        A timer firing drains what is ready now (bounded by what a claim
        finds), the way ``drain`` does, because the next firing may be minutes
        away; returns the rows completed.
        """
        del timer
        return self.drain(handler)

    def tick(self, handler: Handler, *, should_stop: Callable[[], bool] | None = None) -> int:
        return self.tick_result(handler, should_stop=should_stop).rows

    def drain(self, handler: Handler, *, max_ticks: int | None = None) -> int:
        """Tick until a claim comes back short of a full batch; rows completed."""
        total = 0
        ticks = 0
        while max_ticks is None or ticks < max_ticks:
            result = self.tick_result(handler)
            ticks += 1
            total += result.rows
            if not result.more:
                break
        return total

    async def tick_async(self, handler: Handler) -> int:
        """One tick for async code: the SQL runs in a worker thread, an async
        handler runs on the caller's event loop (cancelled if the claim is lost)."""
        return (await self.tick_result_async(handler)).rows

    async def tick_result_async(self, handler: Handler) -> QueueTickResult:
        """:meth:`tick_async` with the whole :class:`QueueTickResult`."""
        loop = asyncio.get_running_loop()
        takes_ctx = wants_context(handler)

        def shim(events: list[RowChange], ctx: ClaimContext) -> Any:
            result = handler(events, ctx) if takes_ctx else handler(events)
            if not asyncio.iscoroutine(result) and not isinstance(result, Awaitable):
                return result
            return asyncio.run_coroutine_threadsafe(_guarded(result, ctx), loop).result()

        return await asyncio.to_thread(self.tick_result, shim)

    def status(self) -> QueueCounts:
        return self.source.counts()

    # --- worker mode ----------------------------------------------------------------

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        """The runner's idle sleep: up to ``seconds``, ended early by ``stop``, or by a
        ``NOTIFY`` on ``notify_channel`` when the hint is on (then True)."""
        if self._listener is None:
            stop.wait(seconds)
            return False
        return self._listener.wait(seconds, stop)

    def stop_listening(self) -> None:
        """Stop the wake-up listener, if any (the runner calls this when it stops)."""
        if self._listener is not None:
            self._listener.stop()

    # --- the tick -------------------------------------------------------------------

    def tick_result(
        self, handler: Handler, *, should_stop: Callable[[], bool] | None = None
    ) -> QueueTickResult:
        """Claim one batch, deliver it, settle it (see the module doc)."""
        del should_stop  # a tick handles one claim; the runner checks between ticks
        token = uuid.uuid4().hex
        started = time.perf_counter()
        claim = self.source.claim_batch(
            limit=self.batch_size,
            token=token,
            worker=self.worker_id,
            visibility=self.visibility_timeout,
        )
        claimed = claim.rows
        seconds = time.perf_counter() - started
        if not claimed:
            self.telemetry.emit("queue_idle", values={"seconds": seconds})
            return QueueTickResult(0, 0, "idle", token=token)
        self.telemetry.emit(
            "queue_claimed",
            "queue %s: claimed %d row(s) as %s",
            self.name,
            len(claimed),
            token,
            batch_id=token,
            rows=len(claimed),
            values={"seconds": seconds},
        )
        if claim.bisected is not None:
            self.telemetry.emit(
                "queue_claim_bisected",
                "queue %s: a claim of %d row(s) expired without an outcome (its worker "
                "crashed or hung); claiming %d of them as %s and the rest next, halving "
                "again until the row that kills its worker is alone",
                self.name,
                claim.bisected[0],
                claim.bisected[1],
                token,
                batch_id=token,
                rows=claim.bisected[1],
            )
        tally = _Tally(token)
        max_attempts = self.max_attempts
        expired = [
            r for r in claimed if expired_too_often(r.attempt, max_attempts, isolated=r.isolated)
        ]
        live = [
            r
            for r in claimed
            if not expired_too_often(r.attempt, max_attempts, isolated=r.isolated)
        ]
        errors: list[DbTriggerError] = []
        if expired:
            dead_plan = Plan(
                dead=[DeadItem(r.key, EXPIRED_ERROR.format(expired=r.attempt - 1)) for r in expired]
            )
            self._perform(token, expired, dead_plan, tally, errors)
        if live:
            lost = threading.Event()
            with self._heartbeat(token, lost):
                lanes = _split(live, self.max_concurrency)
                if len(lanes) == 1:
                    self._lane(handler, token, lanes[0], lost, tally, errors)
                else:
                    with ThreadPoolExecutor(len(lanes), thread_name_prefix="dbt-lane") as pool:
                        futures = [
                            pool.submit(self._lane, handler, token, lane, lost, tally, errors)
                            for lane in lanes
                        ]
                        for future in futures:
                            future.result()
        self.telemetry.emit(
            "queue_settled",
            "queue %s: claim %s settled: %d done, %d retried, %d dead, %d lost",
            self.name,
            token,
            tally.done,
            tally.retried,
            tally.dead,
            tally.lost,
            batch_id=token,
        )
        if errors:
            raise errors[0]
        return QueueTickResult(
            rows=tally.done,
            batches=1,
            outcome="settled",
            more=claim.more,
            claimed=len(claimed),
            retried=tally.retried,
            dead=tally.dead,
            claims_lost=tally.lost,
            token=token,
            settled=tuple(tally.settled),
        )

    def _events(self, token: str, rows: Sequence[ClaimedRow]) -> list[RowChange]:
        """One event per claimed row. ``pk`` and ``values`` of a :class:`ClaimedRow`
        are dicts built for that row alone, so they are frozen without a copy."""
        source = self.source.name
        ids = self._ids
        events = []
        for r in rows:
            events.append(
                RowChange._unchecked(
                    ids(r.pk, r.cursor),
                    "upsert" if r.values is not None else "delete",
                    source,
                    r.cursor,
                    MappingProxyType(r.pk),
                    None,
                    None if r.values is None else MappingProxyType(r.values),
                    MappingProxyType(
                        {"queue": self.name, "claim_token": token, "attempt": r.attempt}
                    ),
                )
            )
        return events

    def _lane(
        self,
        handler: Handler,
        token: str,
        rows: list[ClaimedRow],
        lost: threading.Event,
        tally: _Tally,
        errors: list[DbTriggerError],
    ) -> None:
        events = self._events(token, rows)
        ctx = ClaimContext(
            queue_name=self.name,
            claim_token=token,
            worker_id=self.worker_id,
            claimed_at=dt.datetime.now(dt.timezone.utc),
            keys={e.event_id: r.key for e, r in zip(events, rows, strict=True)},
            attempts={e.event_id: r.attempt for e, r in zip(events, rows, strict=True)},
            lost=lost,
        )
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            result = handler(events, ctx) if wants_context(handler) else handler(events)
            if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
                _run_awaitable(result, ctx)
        except ConfigurationError:
            ctx.close()
            raise
        except Exception as exc:  # noqa: BLE001 - a handler failure is an outcome, sorted below
            failure = exc
        marks = ctx.close()
        self.telemetry.emit(
            "queue_handler_returned", values={"seconds": time.perf_counter() - started}
        )
        if failure is not None:
            self.telemetry.emit(
                "queue_handler_failed",
                "queue %s: handler failed on %d row(s) of claim %s: %s: %s",
                self.name,
                len(rows),
                token,
                type(failure).__name__,
                failure,
                batch_id=token,
                rows=len(rows),
                error=type(failure).__name__,
            )
        plan = decide(
            [(r.key, r.attempt) for r in rows],
            pks={r.key: r.pk for r in rows},
            marks=marks,
            failure=failure,
            max_attempts=self.max_attempts,
            backoff=self.backoff,
            rng=self._rng,
        )
        self._perform(token, rows, plan, tally, errors)

    def _perform(
        self,
        token: str,
        rows: Sequence[ClaimedRow],
        plan: Plan,
        tally: _Tally,
        errors: list[DbTriggerError],
    ) -> None:
        """Dead-letter first, then one fenced settlement; account for every row."""
        dead = plan.dead
        if dead and self.dead_letter is not None:
            try:
                self._dead_letter(token, rows, dead)
            except QuarantineError as exc:
                self.telemetry.emit(
                    "queue_dead_letter_failed",
                    "queue %s: %d dead row(s) could not be written to %s (%s); they stay "
                    "claimed, expire and are dead-lettered again",
                    self.name,
                    len(dead),
                    self.dead_letter.describe(),
                    exc,
                    batch_id=token,
                )
                errors.append(exc)
                dead = []
        try:
            settled = self.source.settle(token=token, done=plan.done, retry=plan.retry, dead=dead)
        except CommitError as exc:
            self.telemetry.emit(
                "queue_settle_failed",
                "queue %s: recording the outcomes of %d row(s) of claim %s failed: %s",
                self.name,
                len(rows),
                token,
                exc,
                batch_id=token,
            )
            errors.append(exc)
            return
        tally.add(self, token, plan, dead, settled)

    def _extend(self, token: str, beats: _Heartbeats) -> None:
        """One heartbeat of claim ``token`` (called on the heartbeat thread)."""
        try:
            held = self.source.extend(token=token, visibility=self.visibility_timeout)
        except DbTriggerError as exc:
            self.telemetry.emit(
                "queue_claim_extend_failed",
                "queue %s: extending claim %s failed (%s); retrying in %.1fs",
                self.name,
                token,
                exc,
                self.heartbeat_interval,
                batch_id=token,
            )
            return
        self.telemetry.emit("queue_claim_extended")
        lost = beats.still_held(token)
        if held == 0 and lost is not None and not lost.is_set():
            lost.set()
            self.telemetry.emit(
                "queue_claim_lost",
                "queue %s: claim %s holds no row any more (it expired); "
                "the handler's results will not be recorded",
                self.name,
                token,
                batch_id=token,
            )

    def _dead_letter(
        self, token: str, rows: Sequence[ClaimedRow], dead: Sequence[DeadItem]
    ) -> None:
        sink = self.dead_letter
        assert sink is not None  # noqa: S101 - checked by the caller
        by_key = {r.key: r for r in rows}
        now = dt.datetime.now(dt.timezone.utc)
        records = []
        for item in dead:
            row = by_key[item.key]
            records.append(
                QuarantineRecord(
                    poller=self.name,
                    event_id=self._ids(row.pk, row.cursor),
                    source=self.source.name,
                    pk=encode_json_value(dict(row.pk)),
                    cursor=encode_json_value(row.cursor),
                    row=encode_json_value(dict(row.values)) if row.values is not None else None,
                    error=item.error,
                    attempts=row.attempt,
                    checkpoint={"claim_token": token},
                    batch_id=token,
                    fencing_token=0,
                    owner_id=self.worker_id,
                    quarantined_at=now,
                )
            )
        put_records(sink, records)

    @contextlib.contextmanager
    def _heartbeat(self, token: str, lost: threading.Event) -> Iterator[None]:
        """Keep claim ``token`` extended while the block runs (see :class:`_Heartbeats`)."""
        with self._beats.lock:
            if self._beats.thread is None:
                self._beats.start(self)
        self._beats.hold(token, lost, interval=self.heartbeat_interval)
        try:
            yield
        finally:
            self._beats.release(token)


class _Tally:
    """Counts of one tick's outcomes, shared by its lanes."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.done = self.retried = self.dead = self.lost = 0
        self.settled: list[tuple[Key, str]] = []
        self._lock = threading.Lock()

    def add(
        self,
        trigger: QueueTrigger,
        token: str,
        plan: Plan,
        dead: Sequence[DeadItem],
        settled: Settled,
    ) -> None:
        wanted = [*plan.done, *(r.key for r in plan.retry), *(d.key for d in dead)]
        applied = settled.done | settled.retried | settled.dead
        lost = [k for k in wanted if k not in applied]
        with self._lock:
            self.done += len(settled.done)
            self.retried += len(settled.retried)
            self.dead += len(settled.dead)
            self.lost += len(lost)
            self.settled += [(k, "done") for k in settled.done]
            self.settled += [(k, "retry") for k in settled.retried]
            self.settled += [(k, "dead") for k in settled.dead]
            self.settled += [(k, "lost") for k in lost]
        telemetry = trigger.telemetry
        telemetry.emit(
            "queue_rows_settled",
            values={
                "done": len(settled.done),
                "retried": len(settled.retried),
                "dead": len(settled.dead),
                "lost": len(lost),
            },
        )
        if lost:
            telemetry.emit(
                "queue_rows_lost",
                "queue %s: %d row(s) of claim %s were no longer held by it (the claim "
                "expired); their outcome here was not recorded: %s",
                trigger.name,
                len(lost),
                token,
                lost[:10],
                batch_id=token,
                rows=len(lost),
            )
        for item in dead:
            if item.key in settled.dead:
                telemetry.emit(
                    "queue_row_dead",
                    "queue %s: row %s is dead: %s",
                    trigger.name,
                    item.key,
                    item.error,
                    batch_id=token,
                )


class _Heartbeats:
    """One daemon thread per trigger that extends every claim it currently holds.

    A thread per tick would cost a thread start and join per batch (tens of
    milliseconds on a loaded host); this one sleeps until the next claim is
    due and is told when claims come and go.

    A new claim wakes the thread only when it falls due before the thread's
    current sleep ends (``_sleep_until``; -inf while the thread is not asleep,
    since it then rescans the claims under the lock before it sleeps again).
    With the default intervals a claim is due long after the idle linger, so
    back-to-back ticks cost no thread switch.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._due: dict[str, tuple[float, threading.Event]] = {}
        self._sleep_until = -math.inf
        self.thread: threading.Thread | None = None

    def start(self, trigger: QueueTrigger) -> None:
        """Start the thread (called with :attr:`lock` held)."""
        self.thread = threading.Thread(
            target=self._run, args=(trigger,), name=f"dbt-heartbeat-{trigger.name}", daemon=True
        )
        self.thread.start()

    def hold(self, token: str, lost: threading.Event, *, interval: float | None = None) -> None:
        with self._wake:
            due = time.monotonic() + (interval or 0)
            self._due[token] = (due, lost)
            if due < self._sleep_until:
                self._wake.notify()

    def release(self, token: str) -> None:
        with self._wake:
            self._due.pop(token, None)

    def _run(self, trigger: QueueTrigger) -> None:
        while True:
            with self._wake:
                if not self._due:
                    # Idle: linger a little (the next tick usually follows), then exit,
                    # so a trigger that stopped claiming holds no thread.
                    self._sleep(_HEARTBEAT_IDLE_EXIT_SECONDS)
                    if not self._due:
                        self.thread = None
                        return
                    continue
                now = time.monotonic()
                due = [t for t, (at, _) in self._due.items() if at <= now]
                if not due:
                    soonest = min(at for at, _ in self._due.values())
                    self._sleep(max(0.0, soonest - now))
                    continue
                for token in due:
                    lost = self._due[token][1]
                    self._due[token] = (now + trigger.heartbeat_interval, lost)
            for token in due:
                trigger._extend(token, self)

    def _sleep(self, seconds: float) -> None:
        """Wait on the condition (lock held) for up to ``seconds``."""
        self._sleep_until = time.monotonic() + seconds
        try:
            self._wake.wait(seconds)
        finally:
            self._sleep_until = -math.inf

    def still_held(self, token: str) -> threading.Event | None:
        with self.lock:
            entry = self._due.get(token)
            return entry[1] if entry is not None else None


def _split(rows: list[ClaimedRow], lanes: int) -> list[list[ClaimedRow]]:
    """Contiguous, near-equal lanes (fewer when there are fewer rows)."""
    count = max(1, min(lanes, len(rows)))
    size, extra = divmod(len(rows), count)
    out: list[list[ClaimedRow]] = []
    start = 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(rows[start:end])
        start = end
    return out


async def _guarded(awaitable: Awaitable[Any], ctx: ClaimContext) -> Any:
    """Await an async handler, cancelling it (and waiting until it stopped) when
    the claim is lost."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            if ctx.lost.is_set():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return None
            await asyncio.wait({task}, timeout=_CANCEL_POLL_SECONDS)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def _run_awaitable(awaitable: Awaitable[Any], ctx: ClaimContext) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_guarded(awaitable, ctx))
    close = getattr(awaitable, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()
    raise ConfigurationError(
        "an async handler was called from a running event loop; use `await queue.tick_async(...)`"
    )
