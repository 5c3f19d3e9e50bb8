"""The delivery kernel: how dbtrigger calls a handler, for pollers and queues alike.

Every trigger (:class:`~dbtrigger.PollTrigger`, its fan-out subscribers and
partitions, :class:`~dbtrigger.QueueTrigger`) hands events over through this
module, so a handler behaves the same under each:

* **the call shape** - ``handler(events)`` or ``handler(events, ctx)``, chosen
  once per handler by :func:`wants_context`;
* **sync or async** - an awaitable result is run to completion
  (:func:`run_awaitable`), or, under ``tick_async``, on the caller's event
  loop (:func:`on_loop`);
* **cancellation** - while an async handler runs, its context's
  ``cancelled`` flag (a lost lease or claim, a fan-out ack timeout) cancels
  the task *and waits for it to stop* (:func:`guarded`), so no side effect
  runs after the trigger gave the batch up;
* **lanes** - ``max_concurrency > 1`` splits a batch by key and runs the
  parts at once on one pool of daemon threads per trigger, closed with it
  (:class:`Lanes`);
* **the heartbeat thread** - one daemon thread per trigger keeps its lease
  or its claims alive while handlers run (:class:`KeepAlive`); what one beat
  writes is the trigger's business (a lease renewal, a claim extension);
* **dead-letter records** - an event that goes to the dead-letter
  (quarantine) sink is recorded one way (:func:`dead_letter_records`);
  the retry backoff is :class:`dbtrigger.state.backoff.Backoff`.

What becomes of a batch after the call (a checkpoint commit, a fenced claim
settlement) is the trigger's: :mod:`dbtrigger.runtime.delivery` and
:mod:`dbtrigger.queue.driver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import heapq
import inspect
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from dbtrigger.cursor import Position, pk_json
from dbtrigger.errors import ConfigurationError, LostLeaseError, PartialBatchError
from dbtrigger.events import RowChange
from dbtrigger.quarantine import QuarantineRecord
from dbtrigger.runtime import let_go
from dbtrigger.runtime.context import EventContext
from dbtrigger.runtime.daemon_pool import DaemonPool

log = logging.getLogger("dbtrigger.runtime")

#: A batch handler: ``handler(events)`` or ``handler(events, ctx)``, sync or async.
Handler = Callable[..., Any]

#: How often an async handler's guard looks at its context's ``cancelled`` flag.
CANCEL_POLL_SECONDS = 0.05

#: How long an idle heartbeat thread waits for the next lease or claim before
#: it exits (the next tick usually follows at once).
KEEPALIVE_LINGER_SECONDS = 2.0

T = TypeVar("T")


#: A handler's context: a poller's BatchContext or a queue's ClaimContext. Bound
#: to the one protocol both satisfy, so mypy checks each against it here.
C = TypeVar("C", bound=EventContext)

#: What a cancelled async handler leaves behind: the error to raise once its
#: task has stopped, or None to return as if it had returned nothing.
Stopped = Callable[[C], BaseException | None]


# --- the call ------------------------------------------------------------------------


def wants_context(handler: Handler) -> bool:
    """Does ``handler`` take ``(events, ctx)`` rather than ``(events)``?

    The one rule for every handler dbtrigger calls: pollers, fan-out
    subscribers, partitions and claim queues."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) >= 2:
        second = positional[1]
        # A second parameter with a default (``def h(events, retries=3)``) is
        # the handler's own option, not a slot for the context - unless it
        # says it is one by its name or annotation.
        return second.default is inspect.Parameter.empty or _names_context(second)
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def _names_context(param: inspect.Parameter) -> bool:
    annotation = param.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return param.name in ("ctx", "context") or any(
        name in str(text) for name in ("BatchContext", "ClaimContext", "EventContext")
    )


def call(
    handler: Handler, events: list[RowChange], ctx: C, wants_ctx: bool, stopped: Stopped[C]
) -> None:
    """Call ``handler`` on ``events`` in its shape; run an async one to completion.
    A call given up is let go when a stop is asked for (:mod:`dbtrigger.runtime.let_go`)."""

    def once() -> None:
        result = handler(events, ctx) if wants_ctx else handler(events)
        if inspect.isawaitable(result):
            run_awaitable(result, ctx, stopped)

    let_go.run_call(once, ctx, len(events))


async def guarded(awaitable: Awaitable[T], ctx: C, stopped: Stopped[C]) -> T | None:
    """Await an async handler, cancelling it as soon as ``ctx.cancelled``.

    The task is cancelled *and awaited*, so when the trigger reports the batch
    given up the handler has really stopped; then ``stopped(ctx)`` is raised
    (or None returned when it gives no error).
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            if ctx.cancelled:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                error = stopped(ctx)
                if error is not None:
                    raise error
                return None
            await asyncio.wait({task}, timeout=CANCEL_POLL_SECONDS)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def run_awaitable(awaitable: Awaitable[T], ctx: C, stopped: Stopped[C]) -> T | None:
    """Run an async handler's awaitable from a synchronous tick."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(guarded(awaitable, ctx, stopped))
    with contextlib.suppress(Exception):
        close = getattr(awaitable, "close", None)
        if close:
            close()
    raise ConfigurationError(
        "an async handler was called from a running event loop; use `await trigger.tick_async(...)`"
    )


def on_loop(
    handler: Handler, wants_ctx: bool, loop: asyncio.AbstractEventLoop, stopped: Stopped[Any]
) -> Handler:
    """``handler`` as ``tick_async`` runs it: the tick's I/O on a worker thread,
    an async handler on the caller's ``loop`` (guarded as above)."""

    def shim(events: list[RowChange], ctx: Any) -> Any:
        result = handler(events, ctx) if wants_ctx else handler(events)
        if not inspect.isawaitable(result):
            return result
        return asyncio.run_coroutine_threadsafe(guarded(result, ctx, stopped), loop).result()

    return shim


#: How long the lanes' caller waits at a time, so a signal's handler gets to run.
_SIGNAL_SLICE_SECONDS = 0.2


# --- lanes ---------------------------------------------------------------------------


def _key(event: RowChange, pk: Mapping[str, Any] | None = None) -> Hashable:
    """The event's key (or ``pk``) as a dict key: its values (one source, one column
    order), or their canonical JSON when a value is not hashable. The split
    runs before any lane starts, so it must be cheap (the JSON form for every
    event was 5 ms of a 500-row batch)."""
    pk = event.pk if pk is None else pk
    values = tuple(pk.values())
    try:
        hash(values)
    except TypeError:
        return pk_json(pk)
    return values


def _moved_from(event: RowChange) -> Mapping[str, Any] | None:
    """The key an update moved its row away from (a log's ``UPDATE ... SET id = 40
    WHERE id = 4``: ``pk`` is the new key, ``before`` holds the old one), else None."""
    before = event.before
    if event.op != "update" or not before or any(name not in before for name in event.pk):
        return None
    old = {name: before[name] for name in event.pk}
    return None if old == dict(event.pk) else old


def split(events: Sequence[RowChange], lanes: int) -> list[list[RowChange]]:
    """The non-empty lanes of a batch, each in batch (cursor) order.

    All events of one key land in one lane, so one key is never handled by
    two calls at once and its events arrive in order; an update that moved a
    row to another key ties both keys to one lane (the old key's next change,
    a new row under it, must not overtake the update that freed it). Keys are dealt largest
    group first to the least-loaded lane (ties: the lower lane), so lane sizes
    differ by at most the largest key's event count: the batch waits for its
    slowest lane (a hash of the key modulo N leaves the largest of 16 lanes of
    a 500-row batch some 30% above the mean). The split is deterministic.
    """
    if lanes <= 1 or len(events) <= 1:
        return [list(events)] if events else []
    keys = [_key(e) for e in events]
    joined: dict[Hashable, Hashable] = {}  # key -> the key it shares a lane with

    def root(key: Hashable) -> Hashable:
        while key in joined:
            key = joined[key]
        return key

    for event, key in zip(events, keys, strict=True):
        old = _moved_from(event)
        if old is not None and (a := root(key)) != (b := root(_key(event, old))):
            joined[b] = a
    if joined:
        keys = [root(key) for key in keys]
    counts: dict[Hashable, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    loads = [(0, lane) for lane in range(min(lanes, len(counts)))]
    lane_of: dict[Hashable, int] = {}
    # sorted() is stable: equal groups keep their order of first appearance.
    for key, count in sorted(counts.items(), key=lambda item: -item[1]):
        load, lane = heapq.heappop(loads)
        lane_of[key] = lane
        heapq.heappush(loads, (load + count, lane))
    parts: list[list[RowChange]] = [[] for _ in range(len(loads))]
    for event, key in zip(events, keys, strict=True):
        parts[lane_of[key]].append(event)
    return [part for part in parts if part]


class Lanes:
    """The lanes of one trigger: a pool of ``size`` worker threads.

    The pool is started on first use and lives as long as the trigger; the
    trigger's ``close()`` shuts it down (it starts again if the trigger is
    used afterwards), so a trigger that is done holds no idle threads.
    """

    def __init__(self, size: int, *, name: str) -> None:
        self.size = size
        self.name = name
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()

    def _executor(self) -> DaemonPool:
        with self._lock:
            if self._pool is None:  # (daemons: an abandoned call never holds the exit up)
                self._pool = DaemonPool(self.size, name=f"dbtrigger-lane-{self.name}")
            return self._pool

    def each(
        self, parts: Sequence[T], fn: Callable[[T], None], meanwhile: Callable[[], None] | None
    ) -> list[BaseException | None]:
        """Run ``fn`` on every part at once; each part's error (None: it returned).

        ``meanwhile`` runs on the calling thread while the lanes run; the lanes
        are waited for even if it raises (no handler call outlives this).
        """
        fn = let_go.carried(fn)  # (a lane's call is let go as the caller's would be)
        futures: list[Future[None]] = [self._executor().submit(fn, part) for part in parts]
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            # In slices: a signal the kernel hands to a lane's thread does not wake a
            # wait without a timeout, and Python runs its handler on this (main) thread
            # only between slices; SIGTERM went unheard while a lane hung.
            while wait(futures, timeout=_SIGNAL_SLICE_SECONDS).not_done:
                pass
        return [future.exception() for future in futures]

    def run(
        self,
        events: list[RowChange],
        call: Callable[[list[RowChange]], None],
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Call ``call`` on each lane of ``events`` concurrently; wait for all.

        A batch is settled as a whole: a lane that fails makes its rows the
        failed rows of the batch, as if the handler had raised
        :class:`~dbtrigger.errors.PartialBatchError` naming them.

        Raises:
            LostLeaseError: a lane saw the lease lost.
            PartialBatchError: some lanes failed; it names their rows.
            Exception: every lane failed: the first lane's error.
        """
        parts = split(events, self.size)
        if len(parts) <= 1 and meanwhile is None:
            call(events)
            return
        errors = self.each(parts, call, meanwhile)
        failures = [(p, e) for p, e in zip(parts, errors, strict=True) if e is not None]
        if not failures:
            return
        for _, error in failures:
            if isinstance(error, LostLeaseError):
                raise error
        if len(failures) == len(parts) and not any(
            isinstance(e, PartialBatchError) for _, e in failures
        ):
            raise failures[0][1]
        named: list[dict[str, object]] = []
        causes: dict[int, BaseException] = {}
        for part, error in failures:
            if isinstance(error, PartialBatchError):
                for index, pk in enumerate(error.failed_pks):
                    causes[len(named)] = error.causes.get(index, error)
                    named.append(dict(pk))
                continue
            for event in part:
                causes[len(named)] = error
                named.append(dict(event.pk))
        raise PartialBatchError(
            named, f"{len(failures)} of {len(parts)} lanes failed", causes=causes
        ) from failures[0][1]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()


# --- the heartbeat thread ------------------------------------------------------------

#: One beat: renew what it keeps alive; seconds until the next beat, or None
#: to stop beating it (lost, released, given up).
Beat = Callable[[], float | None]


class KeepAlive:
    """One daemon thread per trigger that beats every lease or claim it holds.

    A thread per tick would cost a thread start and join per batch (tens of
    milliseconds on a loaded host); this one sleeps until the next beat is
    due, is told when holds come and go, and exits after
    :data:`KEEPALIVE_LINGER_SECONDS` without any. A new hold wakes it only
    when it falls due before the thread's current sleep ends, so
    back-to-back ticks cost no thread switch.

    :meth:`release` waits for a beat of that hold that is in flight: once it
    returns, nothing writes for the hold any more (a lease renewal can never
    race the tick's own next write for the etag).
    """

    def __init__(self, name: str, *, linger: float = KEEPALIVE_LINGER_SECONDS) -> None:
        self.name = name
        self.linger = linger
        self._wake = threading.Condition(threading.Lock())
        self._due: dict[str, tuple[float, Beat]] = {}
        self._running: str | None = None
        self._sleep_until = -math.inf
        self._closing = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def holding(self, key: str, beat: Beat, *, first_in: float) -> Iterator[None]:
        """Beat ``key`` while the block runs, the first time after ``first_in`` seconds."""
        self.hold(key, beat, first_in=first_in)
        try:
            yield
        finally:
            self.release(key)

    def hold(self, key: str, beat: Beat, *, first_in: float) -> None:
        with self._wake:
            due = time.monotonic() + first_in
            self._due[key] = (due, beat)
            self._closing = False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"dbtrigger-heartbeat-{self.name}", daemon=True
                )
                self._thread.start()
            elif due < self._sleep_until:
                self._wake.notify()

    def release(self, key: str) -> None:
        with self._wake:
            self._due.pop(key, None)
            while self._running == key and threading.current_thread() is not self._thread:
                self._wake.wait()

    def close(self) -> None:
        """Stop the thread now (it starts again on the next hold)."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._closing or (not self._due and not self._sleep(self.linger)):
                    self._thread = None
                    return
                now = time.monotonic()
                key, (at, beat) = min(self._due.items(), key=lambda item: item[1][0])
                if at > now:
                    self._sleep(at - now)
                    continue
                self._running = key
            try:
                after = beat()
            except Exception:  # a beat reports its own failures; this is a bug
                log.exception(
                    "heartbeat of %s failed unexpectedly; it stops beating",
                    key,
                    extra={"event": "heartbeat_crashed", "poller": self.name},
                )
                after = None
            with self._wake:
                self._running = None
                self._wake.notify_all()
                if key in self._due and self._due[key][1] is beat:
                    if after is None:
                        del self._due[key]
                    else:
                        self._due[key] = (time.monotonic() + after, beat)

    def _sleep(self, seconds: float) -> bool:
        """Wait on the condition (lock held) for up to ``seconds``; is anything held?"""
        self._sleep_until = time.monotonic() + seconds
        try:
            self._wake.wait(seconds)
        finally:
            self._sleep_until = -math.inf
        return bool(self._due) and not self._closing


# --- dead-letter records ---------------------------------------------------------------


def dead_letter_records(
    failed: Sequence[tuple[RowChange, BaseException | str]],
    *,
    trigger: str,
    attempts: Mapping[str, int] | int,
    checkpoint: Position | Mapping[str, Any],
    batch_id: str,
    fencing_token: int,
    owner_id: str,
    now: dt.datetime,
) -> list[QuarantineRecord]:
    """One record per event that goes to the dead-letter (quarantine) sink.

    ``attempts`` is an event id -> attempts map, or one number for every
    event; ``checkpoint`` is where the trigger stood (a
    poller's checkpoint, a queue's claim).
    """
    return [
        QuarantineRecord.from_event(
            event,
            poller=trigger,
            error=error,
            attempts=attempts if isinstance(attempts, int) else attempts[event.event_id],
            checkpoint=checkpoint,
            batch_id=batch_id,
            fencing_token=fencing_token,
            owner_id=owner_id,
            now=now,
        )
        for event, error in failed
    ]
