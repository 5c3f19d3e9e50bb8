"""A drain does not stop at events that wait for a retry.

``ctx.retry(event, reason, delay_seconds=...)`` (or a subscriber's retry, on
the backoff) leaves the event in the settled window, due later; the ticks
before it comes due deliver nothing. ``drain()`` took such a tick for "nothing
left" and returned with the event unsettled and the checkpoint pinned below
it. Now it waits for a retry due within ``retry_wait_seconds`` and delivers
it, and raises a ``HandlerError`` saying how many events wait, until when, and
that nothing was skipped when the next one is further off; a stop ends its
waits at once. The same for a partitioned member's drain, ``dbtrigger
backfill`` and a claim queue's drain.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.cli import backfill
from dbtrigger.cli.common import Console
from dbtrigger.errors import HandlerError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.runtime import drain as drain_module
from dbtrigger.runtime.drain import DrainWait, drain
from dbtrigger.runtime.trigger import TickResult
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table, source_for


def test_drain_delivers_a_retry_that_comes_due_and_settles_every_row(db: TestDatabase) -> None:
    table = orders_table(db)
    insert(db, table, [{"id": i, "updated_at": naive(i)} for i in (1, 2, 3)])
    trigger = PollTrigger(
        name="orders", source=source_for(db), checkpoint_store=InMemoryCheckpointStore()
    )
    delivered: list[tuple[int, int]] = []

    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            delivered.append((int(e.pk["id"]), ctx.attempts(e)))
            if e.pk["id"] == 2 and ctx.attempts(e) == 1:
                ctx.retry(e, "429 from billing", delay_seconds=0.3)

    try:
        assert trigger.drain(handle) == 4
    finally:
        trigger.close()
    assert delivered == [(1, 1), (2, 1), (3, 1), (2, 2)]
    state = trigger.read_state()
    assert state is not None
    assert state.window is None or not state.window.pending
    assert state.position.pk == {"id": 3}


T0 = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.timezone.utc)
ROWS = TickResult(5, 1, "committed")
IDLE = TickResult(0, 0, "idle")


def waiting(seconds: float, events: int = 2) -> TickResult:
    """An idle tick with ``events`` waiting for a retry, the next due ``seconds`` after T0."""
    return TickResult(
        0, 0, "idle", waiting_retries=events, next_retry_at=T0 + dt.timedelta(seconds=seconds)
    )


class Scripted:
    """Ticks that report what a script says (the last one repeats), on a clock
    that moves only when the drain pauses."""

    name = "scripted"

    def __init__(self, results: Sequence[TickResult], now: list[float]) -> None:
        self.results = list(results)
        self.now = now
        self.ticks = 0

    def clock(self) -> dt.datetime:
        return T0 + dt.timedelta(seconds=self.now[0])

    def tick_result(
        self, handler: Any = None, should_stop: Callable[[], bool] | None = None
    ) -> TickResult:
        del handler, should_stop
        self.ticks += 1
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Seconds since T0 on the drain's clocks; its pauses advance it (no real sleeping)."""
    clock = [0.0]

    def pause(self: DrainWait, seconds: float) -> bool:
        del self
        clock[0] += seconds
        return True

    monkeypatch.setattr(DrainWait, "pause", pause)
    monkeypatch.setattr(drain_module.time, "monotonic", lambda: 1000.0 + clock[0])
    return clock


def run(trigger: Scripted, **options: Any) -> int:
    return drain(
        trigger, lambda events: None, max_ticks=None, progress=None, lease_wait_seconds=0, **options
    )


def test_a_drain_sleeps_until_a_retry_is_due_and_delivers_it(now: list[float]) -> None:
    """Before: the idle tick with two events waiting ended the drain at 5 rows."""
    trigger = Scripted([ROWS, waiting(2.0), ROWS, IDLE], now)
    assert run(trigger) == 10
    assert trigger.ticks == 4
    assert now[0] == pytest.approx(2.0 + drain_module._PAST_DUE_SECONDS)


def test_a_retry_due_past_the_budget_raises_saying_what_waits(now: list[float]) -> None:
    trigger = Scripted([ROWS, waiting(90.0, events=3)], now)
    with pytest.raises(HandlerError) as raised:
        run(trigger, retry_wait_seconds=60)
    text = str(raised.value)
    assert "stopped after 5 row(s)" in text
    assert "3 event(s) wait for a retry" in text
    assert "2026-11-27T12:01:30" in text
    assert "Nothing was skipped" in text
    assert raised.value.fields == {
        "rows": 5,
        "waiting_retries": 3,
        "next_retry_at": "2026-11-27T12:01:30+00:00",
    }
    assert now[0] == 0.0  # raised without waiting


def test_the_budget_counts_from_the_last_row_delivered(now: list[float]) -> None:
    """A retry that comes due but is not delivered (nothing moves) is not waited for
    without end: the quiet time since the last row counts against the budget."""
    trigger = Scripted([ROWS, waiting(1.0)], now)  # due at 1 s, and never delivered
    with pytest.raises(HandlerError, match="wait for a retry"):
        run(trigger, retry_wait_seconds=10)
    assert 10 <= now[0] <= 10 + 2 * drain_module._PAST_DUE_SECONDS


def test_a_frozen_clock_raises_after_one_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test's clock that does not move while the drain sleeps never brings the
    retry due: the drain raises after one wait instead of spending its budget."""
    pauses: list[float] = []
    monkeypatch.setattr(DrainWait, "pause", lambda self, seconds: pauses.append(seconds) or True)
    trigger = Scripted([ROWS, waiting(3.0)], [0.0])
    with pytest.raises(HandlerError, match="wait for a retry"):
        run(trigger)
    assert len(pauses) == 1


def test_a_stop_ends_a_retry_wait_at_once() -> None:
    """Bounded outcome: the drain sleeps toward a retry an hour off (within its
    budget); setting ``stop`` makes it return what it committed."""
    stop = threading.Event()
    ticked = threading.Event()

    class Signalling(Scripted):
        def tick_result(self, handler: Any = None, should_stop: Any = None) -> TickResult:
            result = super().tick_result(handler)
            if not result.rows:
                ticked.set()
            return result

    clock = [0.0]
    trigger = Signalling([ROWS, waiting(3600.0)], clock)
    outcome: list[Any] = []

    def go() -> None:
        try:
            outcome.append(run(trigger, retry_wait_seconds=7200, stop=stop))
        except Exception as exc:
            outcome.append(exc)

    drainer = threading.Thread(target=go, daemon=True)
    drainer.start()
    assert ticked.wait(30)
    stop.set()
    drainer.join(30)
    assert not drainer.is_alive(), "the stop did not end the wait"
    assert outcome == [5]
    assert trigger.ticks == 2


def test_a_stop_ends_a_held_back_wait_at_once() -> None:
    """The visibility guard's waits are the stop's too (they were time.sleep)."""
    stop = threading.Event()
    stop.set()
    waits = DrainWait("p", stop=stop)
    held = TickResult(0, 0, "idle", held_back=True, held_back_seconds=5.0)
    done: list[bool] = []
    waiter = threading.Thread(target=lambda: done.append(waits.pause(3600.0)), daemon=True)
    waiter.start()
    waiter.join(30)
    assert done == [False]
    assert waits.wait_after(held, 0) is False


def test_a_partitioned_drain_waits_for_a_retry(now: list[float]) -> None:
    """PartitionedPoller.drain goes through the same waits (its round's result
    carries the earliest retry of its partitions)."""
    trigger = Scripted([ROWS, waiting(4.0), ROWS, IDLE], now)
    poller = PartitionedPoller.__new__(PartitionedPoller)
    poller.name, poller.clock = "orders", trigger.clock  # type: ignore[misc]
    poller._handler_for = lambda handler: handler  # type: ignore[method-assign]
    poller.tick_result = trigger.tick_result  # type: ignore[method-assign]
    poller.flush_history = lambda: True  # type: ignore[method-assign]
    assert poller.drain(lambda events: None) == 10
    assert trigger.ticks == 4


def test_backfill_is_not_caught_up_while_a_retry_waits(now: list[float]) -> None:
    """``dbtrigger backfill`` said "caught up" at the first idle tick, retries waiting."""
    worker = Scripted([ROWS, waiting(3.0), ROWS, IDLE], now)
    progress = backfill.Progress(io.StringIO(), None, tty=False)
    args = argparse.Namespace(max_retries=3, retry_delay=0.0)
    console = Console(io.StringIO(), io.StringIO())
    assert backfill._drain(args, worker, lambda events: None, progress, console)  # type: ignore[arg-type]
    assert progress.done == 10
    assert worker.ticks == 4


def test_backfill_raises_when_the_retry_is_past_its_wait(now: list[float]) -> None:
    worker = Scripted([ROWS, waiting(600.0)], now)
    progress = backfill.Progress(io.StringIO(), None, tty=False)
    args = argparse.Namespace(max_retries=3, retry_delay=0.0)
    console = Console(io.StringIO(), io.StringIO())
    with pytest.raises(HandlerError, match="Nothing was skipped"):
        backfill._drain(args, worker, lambda events: None, progress, console)  # type: ignore[arg-type]
