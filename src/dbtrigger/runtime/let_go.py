"""A synchronous handler call that was given up, and a worker asked to stop: let it go.

``handler_timeout_seconds`` gives a call up (on the heartbeat thread): the
lease or claim lapses, ``ctx.cancelled`` is set, nothing the call does is
recorded, its rows come again. An async handler's task is cancelled; a
synchronous call cannot be, and the tick's thread used to go on waiting for
it - and so did a stop: the first SIGTERM of ``dbtrigger run`` ("finish the
batch in flight") waited for a call whose batch was no longer in flight, for
ever, until the platform's SIGKILL after its grace period. With lanes, a
second signal did not help either: the interpreter joins a thread pool's
threads at exit.

So while a trigger with a handler timeout ticks under a ``should_stop`` (the
runner's, a partition round's deadline:
:func:`stop_waiting_when`), each synchronous call runs on a daemon thread of
its own and the tick's thread waits for it. Once the call is given up
(``ctx.cancelled``) *and* ``should_stop()`` says so, the tick stops waiting:
the call is left to run on its daemon thread (the interpreter does not wait
for it at exit), a WARNING ``call_abandoned`` names it, and
:class:`~dbtrigger.errors.LostLeaseError` is raised, as for a lost lease
(nothing recorded, the rows are delivered again). A call that was not given
up is waited for as before: a stop finishes the batch in flight, and with a
timeout that wait ends at the timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TypeVar

from dbtrigger.errors import LostLeaseError
from dbtrigger.runtime.context import EventContext

log = logging.getLogger("dbtrigger.runtime")

#: How often the tick's thread looks at ``ctx.cancelled`` and ``should_stop()``.
POLL_SECONDS = 0.05

#: The ``should_stop`` of the tick running on this thread (None: calls run inline).
_STOP: ContextVar[Callable[[], bool] | None] = ContextVar("dbtrigger_let_go", default=None)

T = TypeVar("T")


@contextlib.contextmanager
def stop_waiting_when(should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """While the block runs, a given-up call is let go once ``should_stop()``
    (None: every call runs inline on the caller's thread, as it always did)."""
    token = _STOP.set(should_stop)
    try:
        yield
    finally:
        _STOP.reset(token)


def carried(fn: Callable[[T], None]) -> Callable[[T], None]:
    """``fn`` for another thread (a lane), under the caller's :func:`stop_waiting_when`."""
    should_stop = _STOP.get()
    if should_stop is None:
        return fn

    def run(part: T) -> None:
        with stop_waiting_when(should_stop):
            fn(part)

    return run


def run_call(fn: Callable[[], None], ctx: EventContext, rows: int) -> None:
    """``fn()`` (one handler call on ``rows`` rows), let go as the module says."""
    should_stop = _STOP.get()
    if should_stop is None:
        fn()
        return
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failed.append(exc)
        finally:
            done.set()

    name = f"dbtrigger-call-{ctx.poller_name}-{ctx.batch_id}"
    # A daemon: a call let go must not keep the process alive.
    threading.Thread(target=run, name=name, daemon=True).start()
    while not done.wait(POLL_SECONDS):
        if ctx.cancelled and should_stop():
            raise _let_go(ctx, rows, name)
    if failed:
        raise failed[0]


def _let_go(ctx: EventContext, rows: int, thread: str) -> LostLeaseError:
    text = (
        f"{ctx.poller_name}: stopping without waiting for the handler call on "
        f"{ctx.batch_id} ({rows} row{'' if rows == 1 else 's'}): it was given up "
        "(handler_timeout_seconds, or its lease or claim was lost) and has not returned; "
        f"it is left running on "
        f"daemon thread {thread}, nothing it does is recorded, its rows are delivered again"
    )
    log.warning(
        "%s",
        text,
        extra={
            "event": "call_abandoned",
            "poller": ctx.poller_name,
            "batch_id": ctx.batch_id,
            "rows": rows,
        },
    )
    return LostLeaseError(text, poller=ctx.poller_name, batch_id=ctx.batch_id)


__all__ = ["POLL_SECONDS", "carried", "run_call", "stop_waiting_when"]
