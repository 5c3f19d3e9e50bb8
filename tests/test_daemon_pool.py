"""The lanes' daemon pool at shutdown: work not started is cancelled, not run
after the stop, and shutdown never waits on a thread that is inside a call.

Each race is set up with events, not timing: a thread is held at the exact
point (after a call, before it takes the next work) while shutdown looks.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from dbtrigger.errors import DbTriggerError, LostLeaseError
from dbtrigger.runtime.daemon_pool import DaemonPool
from dbtrigger.runtime.lanes import Lanes

BOUND = 10.0  # seconds for what should happen at once


def test_work_queued_at_shutdown_is_cancelled_not_run_after_it() -> None:
    pool = DaemonPool(1, name="t-queued")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> None:
        started.set()
        release.wait(BOUND)

    running = pool.submit(first)
    queued = pool.submit(ran.append, "queued")
    assert started.wait(BOUND)
    (thread,) = pool._threads
    pool.shutdown()  # the only thread is inside a call: not waited for
    release.set()
    thread.join(BOUND)
    assert not thread.is_alive()
    assert running.result(0) is None
    assert queued.cancelled()
    assert ran == []  # before: the queued work ran after the stop
    assert pool.submit(ran.append, "late").cancelled()
    assert ran == []


class _HeldSemaphore:
    """The pool's idle count, holding the first thread that says it is idle until
    ``go`` (it has finished a call and not taken the next work yet)."""

    def __init__(self, idle: Any, between: threading.Event, go: threading.Event) -> None:
        self._idle, self.between, self.go = idle, between, go

    def acquire(self, timeout: float | None = None) -> bool:
        return bool(self._idle.acquire(timeout=timeout))

    def release(self) -> None:
        self._idle.release()
        if not self.between.is_set():
            self.between.set()
            self.go.wait(BOUND)


class _WatchedQueue:
    """The pool's work queue; ``looked`` is set once shutdown puts its first end marker
    (it has decided which threads it waits for)."""

    def __init__(self, looked: threading.Event) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.looked = looked

    def put(self, item: Any) -> None:
        if item is None:
            self.looked.set()
        self._queue.put(item)

    def get(self) -> Any:
        return self._queue.get()

    def get_nowait(self) -> Any:
        return self._queue.get_nowait()


def test_shutdown_does_not_wait_on_a_thread_that_took_work_after_it_looked() -> None:
    """A thread idle when shutdown looked, which then takes queued work that hangs,
    held shutdown's join for ever."""
    pool = DaemonPool(1, name="t-race")
    between, go, never = threading.Event(), threading.Event(), threading.Event()
    pool._idle = _HeldSemaphore(pool._idle, between, go)  # type: ignore[assignment]
    pool._work = _WatchedQueue(go)  # type: ignore[assignment]
    hung: list[str] = []

    def hang() -> None:
        hung.append("started")
        never.wait(60)

    pool.submit(lambda: None)
    assert between.wait(BOUND)  # the thread finished its call and is held there
    queued = pool.submit(hang)
    stopper = threading.Thread(target=pool.shutdown, daemon=True)
    try:
        stopper.start()
        stopper.join(BOUND)
        assert not stopper.is_alive(), "shutdown waits on a thread inside a hung call"
        assert queued.cancelled()
        assert hung == []
    finally:
        never.set()


def test_lanes_closed_under_a_batch_give_its_unstarted_parts_as_a_dbtrigger_error() -> None:
    lanes = Lanes(1, name="t-lanes")
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def part(n: int) -> None:
        if n == 1:
            started.set()
            release.wait(BOUND)
        ran.append(n)

    def meanwhile() -> None:
        assert started.wait(BOUND)
        lanes.close()  # e.g. the trigger closed by a stop while its batch runs
        release.set()

    errors = lanes.each([1, 2], part, meanwhile)
    assert ran == [1]  # before: part 2 ran after the close
    assert errors[0] is None
    assert isinstance(errors[1], LostLeaseError)
    assert isinstance(errors[1], DbTriggerError)
    assert "never started" in str(errors[1])
    lanes.close()
