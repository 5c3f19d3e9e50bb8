"""The lanes' worker threads: daemons, so a handler call abandoned in one never
keeps the process alive.

A :class:`concurrent.futures.ThreadPoolExecutor` joins its threads when the
interpreter exits. A lane stuck in a synchronous handler call that never
returns then held ``dbtrigger run`` up after the second SIGTERM had abandoned
its batch ("in-flight batch abandoned", and no exit): only a SIGKILL ended it.
This pool starts its threads as daemons, and :meth:`DaemonPool.shutdown`
waits for none of them inside a call (one still inside an abandoned call ends
on its own once the call returns, or with the process).

Shutdown is a decision taken under the pool's lock: from then on no queued
work starts. Work still queued is cancelled (its future says so, and the
caller that waits on it treats it as not run), and a thread that took work
off the queue but had not started it yet cancels it too instead of running
it: otherwise a thread that looked idle to shutdown could start that work
right after the look and hang in it, holding shutdown's join for ever, and
work queued before a stop ran after it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Work = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]

#: The longest :meth:`DaemonPool.shutdown` waits for its idle threads to exit.
JOIN_SECONDS = 2.0


class DaemonPool:
    """Up to ``size`` daemon threads named ``{name}_{n}``, started as work comes."""

    def __init__(self, size: int, *, name: str) -> None:
        self.size = size
        self.name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._busy: set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; after :meth:`shutdown` the future comes back cancelled."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                _cancel(future)
                return future
            if not self._idle.acquire(timeout=0) and len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._run, name=f"{self.name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._work.put((future, fn, args))
        return future

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            work = self._work.get()
            if work is None:
                return
            future, fn, args = work
            with self._lock:
                if self._closed:  # taken off the queue after shutdown: never started
                    _cancel(future)
                    continue
                self._busy.add(me)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the caller's to see
                    future.set_exception(exc)
            del work, future
            with self._lock:
                self._busy.discard(me)
            self._idle.release()

    def shutdown(self) -> None:
        """Cancel the work not started, end every thread; wait (bounded) for
        those not inside a call, none for those inside one."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
            idle = [t for t in threads if t not in self._busy]
            while True:
                try:
                    work = self._work.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    _cancel(work[0])
            for _ in threads:
                self._work.put(None)
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in idle:
            thread.join(max(0.0, deadline - time.monotonic()))


def _cancel(future: Future[Any]) -> None:
    """Cancel work not started, and say so to whoever waits on it: a future that is
    only ``cancel()``-ed does not count as done for :func:`concurrent.futures.wait`."""
    if future.cancel():
        future.set_running_or_notify_cancel()


__all__ = ["DaemonPool"]
