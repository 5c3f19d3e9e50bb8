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

import contextlib
import datetime as dt
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.events import RowChange
from dbtrigger.quarantine import QuarantineRecord
from dbtrigger.runtime import let_go
from dbtrigger.runtime.async_calls import (
    CANCEL_POLL_SECONDS,
    C,
    Handler,
    Stopped,
    guarded,
    lingering,
    on_loop,
    run_awaitable,
)
from dbtrigger.runtime.lanes import Lanes, split

log = logging.getLogger("dbtrigger.runtime")

#: How long an idle heartbeat thread waits for the next lease or claim before
#: it exits (the next tick usually follows at once).
KEEPALIVE_LINGER_SECONDS = 2.0

__all__ = [
    "CANCEL_POLL_SECONDS",
    "Handler",
    "KeepAlive",
    "Lanes",
    "Stopped",
    "call",
    "dead_letter_records",
    "guarded",
    "lingering",
    "on_loop",
    "run_awaitable",
    "split",
    "wants_context",
]


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
    subscribers: Mapping[str, Mapping[str, str]] | None = None,
) -> list[QuarantineRecord]:
    """One record per event that goes to the dead-letter (quarantine) sink.

    ``attempts`` is an event id -> attempts map, or one number for every
    event; ``checkpoint`` is where the trigger stood (a
    poller's checkpoint, a queue's claim); ``subscribers`` (fan-out): event id ->
    the subscribers that did not take it, each with its reason.
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
            subscribers=subscribers.get(event.event_id) if subscribers is not None else None,
        )
        for event, error in failed
    ]
