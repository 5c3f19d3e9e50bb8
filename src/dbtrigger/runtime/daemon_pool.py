"""The lanes' worker threads: daemons, so a handler call abandoned in one never
keeps the process alive.

A :class:`concurrent.futures.ThreadPoolExecutor` joins its threads when the
interpreter exits. A lane stuck in a synchronous handler call that never
returns then held ``dbtrigger run`` up after the second SIGTERM had abandoned
its batch ("in-flight batch abandoned", and no exit): only a SIGKILL ended it.
This pool starts its threads as daemons and :meth:`DaemonPool.shutdown` joins
only the threads that are not inside a call (one still inside an abandoned call
ends on its own once the call returns, or with the process).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Work = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


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

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
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
        """End every thread; wait for those not inside a call."""
        with self._lock:
            threads, self._threads = self._threads, []
            idle = [t for t in threads if t not in self._busy]
        for _ in threads:
            self._work.put(None)
        for thread in idle:
            thread.join()


__all__ = ["DaemonPool"]
