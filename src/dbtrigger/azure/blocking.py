"""The blocking reads and writes of bindings in an ``async def`` function, on threads of
their own (internal).

An async trigger's tick runs in the event loop's default executor
(``asyncio.to_thread``) and waits there while the handler runs on the loop.
``@db.output``'s write and ``@db.input``'s read, awaited inside the handler,
used that same executor: with as many ticks at once as it has threads
(``min(32, cpu_count + 4)``: 5 on one core; two Function App functions on one
schedule fill a small one) every thread held a tick waiting for a handler
waiting for a thread, and all of them hung until the host's timeout. Binding
I/O waits on nothing but its database, so a pool of its own always drains.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: Threads for binding I/O; more calls at once wait their turn (none waits on another).
MAX_THREADS = 32

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 - one pool per process, made at the first use
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="dbtrigger-binding-io")
        return _pool


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a binding I/O thread (with the caller's context variables, as
    ``asyncio.to_thread``), awaited without holding a thread of the loop's executor."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)


__all__ = ["off_loop"]
