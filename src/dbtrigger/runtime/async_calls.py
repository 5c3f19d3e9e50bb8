"""Async handlers: run to completion from a synchronous tick, or on the caller's
loop under ``tick_async``, and cancelled as soon as their context is.

Part of the delivery kernel (:mod:`dbtrigger.runtime.kernel`, which re-exports
what is here).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dbtrigger.errors import ConfigurationError
from dbtrigger.events import RowChange
from dbtrigger.runtime.context import EventContext

#: A batch handler: ``handler(events)`` or ``handler(events, ctx)``, sync or async.
Handler = Callable[..., Any]

#: How often an async handler's guard looks at its context's ``cancelled`` flag.
CANCEL_POLL_SECONDS = 0.05

T = TypeVar("T")

#: A handler's context: a poller's BatchContext or a queue's ClaimContext.
C = TypeVar("C", bound=EventContext)

#: What a cancelled async handler leaves behind: the error to raise once its
#: task has stopped, or None to return as if it had returned nothing.
Stopped = Callable[[C], BaseException | None]


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


__all__ = ["CANCEL_POLL_SECONDS", "guarded", "on_loop", "run_awaitable"]
