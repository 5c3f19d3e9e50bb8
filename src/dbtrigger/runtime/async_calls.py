"""Async handlers: run to completion from a synchronous tick, or on the caller's
loop under ``tick_async``, and cancelled as soon as their context is.

Part of the delivery kernel (:mod:`dbtrigger.runtime.kernel`, which re-exports
what is here).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

from dbtrigger.errors import ConfigurationError
from dbtrigger.events import RowChange
from dbtrigger.runtime.context import EventContext

#: A batch handler: ``handler(events)`` or ``handler(events, ctx)``, sync or async.
Handler = Callable[..., Any]

#: How often an async handler's guard looks at its context's ``cancelled`` flag.
CANCEL_POLL_SECONDS = 0.05

#: How long a cancelled async handler is waited for before it is let go.
CANCEL_GRACE_SECONDS = 5.0

#: Tasks let go by :func:`guarded` (not cancelled, nor waited for, again at the end).
_ABANDONED: weakref.WeakSet[asyncio.Future[Any]] = weakref.WeakSet()

#: Set by :func:`lingering`.
_LINGER: ContextVar[bool] = ContextVar("dbtrigger_linger", default=False)

log = logging.getLogger("dbtrigger.runtime")

T = TypeVar("T")
P = ParamSpec("P")

#: A handler's context: a poller's BatchContext or a queue's ClaimContext.
C = TypeVar("C", bound=EventContext)

#: What a cancelled async handler leaves behind: the error to raise once its
#: task has stopped, or None to return as if it had returned nothing.
Stopped = Callable[[C], BaseException | None]


async def guarded(
    awaitable: Awaitable[T],
    ctx: C,
    stopped: Stopped[C],
    on_let_go: Callable[[asyncio.Future[Any]], None] | None = None,
) -> T | None:
    """Await an async handler, cancelling it as soon as ``ctx.cancelled``.

    The task is cancelled *and awaited*, up to :data:`CANCEL_GRACE_SECONDS`, so
    when the trigger reports the batch given up the handler has really stopped;
    then ``stopped(ctx)`` is raised (or None returned when it gives no error).
    A handler that swallows its cancellation (``except CancelledError:`` and
    carries on) is let go after that grace, with an ERROR
    (``handler_ignored_cancel``), and the batch given up all the same: waiting
    for it held the tick (and a stop) for ever. ``on_let_go`` is told of a task
    let go (:func:`on_loop`: a fan-out subscriber's thread then waits for it,
    so the subscriber stays busy).
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            if ctx.cancelled:
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_GRACE_SECONDS)
                if task.done():
                    if not task.cancelled():
                        task.exception()  # (retrieved: no "never retrieved" report)
                else:
                    _let_go(task, ctx)
                    if on_let_go is not None:
                        on_let_go(task)
                error = stopped(ctx)
                if error is not None:
                    raise error
                return None
            await asyncio.wait({task}, timeout=CANCEL_POLL_SECONDS)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def _let_go(task: asyncio.Future[Any], ctx: EventContext) -> None:
    _ABANDONED.add(task)
    subscriber = getattr(ctx, "subscriber", None)
    who = f" of subscriber {subscriber!r}" if subscriber is not None else ""
    log.error(
        "%s: the async handler call%s on %s ignored its cancellation: it still runs "
        "%g s after it was cancelled (the batch was given up: handler_timeout_seconds, "
        "a lost lease or claim, an ack timeout, a stop); it is let go, left running on "
        "its event loop, nothing it does is recorded and its rows are delivered again%s. "
        "Let asyncio.CancelledError propagate out of the handler (re-raise it after "
        "any cleanup)",
        ctx.poller_name,
        who,
        ctx.batch_id,
        CANCEL_GRACE_SECONDS,
        " (to that subscriber once the call ends: until then it is busy, handed nothing new)"
        if subscriber is not None
        else "",
        extra={
            "event": "handler_ignored_cancel",
            "poller": ctx.poller_name,
            "batch_id": ctx.batch_id,
            **({"subscriber": subscriber} if subscriber is not None else {}),
        },
    )


def run_awaitable(awaitable: Awaitable[T], ctx: C, stopped: Stopped[C]) -> T | None:
    """Run an async handler's awaitable from a synchronous tick."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(guarded(awaitable, ctx, stopped))
    with contextlib.suppress(Exception):
        close = getattr(awaitable, "close", None)
        if close:
            close()
    raise ConfigurationError(
        "an async handler was called from a running event loop; use `await trigger.tick_async(...)`"
    )


def _run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, except that tasks still running at the end are waited
    for a bounded time only: ``asyncio.run`` cancels them and waits for ever, so
    one that ignores its cancellation (the handler let go by :func:`guarded`, a
    task it started and left behind) held the thread for good."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # (as asyncio.run: for this thread, while it runs)
    try:
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        _close(loop)


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what still runs on ``loop``, wait up to the grace, close it; what
    outlives that is left to finish on a daemon thread of its own (or on this
    thread, under :func:`lingering`)."""
    left = {t for t in asyncio.all_tasks(loop) if not t.done()}
    fresh = {t for t in left if t not in _ABANDONED}
    for task in fresh:
        task.cancel()
    if fresh:
        loop.run_until_complete(asyncio.wait(fresh, timeout=CANCEL_GRACE_SECONDS))
    left = {t for t in left if not t.done()}
    if left and not _LINGER.get():
        if fresh & left:
            log.error(
                "%d asyncio task(s) of an async handler ignored their cancellation when "
                "its call ended; they are left running on a daemon thread",
                len(fresh & left),
                extra={"event": "handler_ignored_cancel"},
            )
        name = f"dbtrigger-abandoned-loop-{id(loop):x}"
        threading.Thread(target=_finish, args=(loop, left), name=name, daemon=True).start()
        return
    _finish(loop, left)


def _finish(loop: asyncio.AbstractEventLoop, left: set[asyncio.Task[Any]]) -> None:
    try:
        if left:
            loop.run_until_complete(asyncio.wait(left))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


def lingering(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn``, during which an async handler let go on its thread keeps the thread
    until the handler ends (a fan-out subscriber's thread: it stays busy, handed
    nothing new, as a hung synchronous subscriber does)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        token = _LINGER.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _LINGER.reset(token)

    return run


def on_loop(
    handler: Handler, wants_ctx: bool, loop: asyncio.AbstractEventLoop, stopped: Stopped[Any]
) -> Handler:
    """``handler`` as ``tick_async`` runs it: the tick's I/O on a worker thread,
    an async handler on the caller's ``loop`` (guarded as above)."""

    def shim(events: list[RowChange], ctx: Any) -> Any:
        result = handler(events, ctx) if wants_ctx else handler(events)
        if not inspect.isawaitable(result):
            return result
        let_go: list[asyncio.Future[Any]] = []
        keep = let_go.append if _LINGER.get() else None
        try:
            return asyncio.run_coroutine_threadsafe(
                guarded(result, ctx, stopped, keep), loop
            ).result()
        finally:
            for task in let_go:
                _outlive(task, loop)

    return shim


#: How often a thread waiting for a task let go looks whether its loop closed.
_OUTLIVE_POLL_SECONDS = 1.0


def _outlive(task: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
    """Hold this thread until ``task``, let go on ``loop``, ends (or the loop
    closes: it never runs again). Under :func:`lingering` - a fan-out
    subscriber's thread - this keeps the subscriber busy while its call still
    runs on the caller's loop, as :func:`_close` does for a call on a loop of
    its own; otherwise it is handed its events again while the call it was
    let go from still works on them."""
    ended = threading.Event()
    try:
        loop.call_soon_threadsafe(task.add_done_callback, lambda _task: ended.set())
    except RuntimeError:  # the loop is closed
        return
    while not ended.wait(_OUTLIVE_POLL_SECONDS):
        if loop.is_closed():
            return


__all__ = [
    "CANCEL_GRACE_SECONDS",
    "CANCEL_POLL_SECONDS",
    "guarded",
    "lingering",
    "on_loop",
    "run_awaitable",
]
