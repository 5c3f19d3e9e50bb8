"""A drain does not stop at rows the visibility guard held back.

``drain()`` ticks until a tick finds nothing to do. A tick whose rows the
guard withheld (committed, but behind a transaction open since before them)
delivered nothing although rows wait after the checkpoint: the drain once
returned there, telling its caller "drained" (a script, a backfill, a test
asserting the count) with the rows still to come. Now it ticks again while
the hold lasts, and raises a FetchError naming the blocker when one hold
outlasts ``held_wait_seconds``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cli import backfill
from dbtrigger.cli.common import Console
from dbtrigger.errors import FetchError
from dbtrigger.runtime import drain as drain_module
from dbtrigger.runtime.drain import drain
from dbtrigger.runtime.pacing import HELD_BACK_FIRST_SECONDS
from dbtrigger.runtime.trigger import TickResult
from tests.databases import TestDatabase
from tests.test_readahead_real import events_table

HELD = TickResult(0, 0, "idle", held_back=True, held_back_seconds=75.0, blocking_pid=4711)
IDLE = TickResult(0, 0, "idle")
ROWS = TickResult(5, 1, "committed")


class ScriptedTrigger:
    """Ticks that report what a script says (the last one repeats)."""

    name = "scripted"

    def __init__(self, results: Sequence[TickResult]) -> None:
        self.results = list(results)
        self.ticks = 0

    def clock(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)

    def tick_result(self, handler: Callable[[Sequence[Any]], None] | None = None) -> TickResult:
        del handler
        self.ticks += 1
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The drain's pauses, taken on a clock of their own (no real sleeping)."""
    pauses: list[float] = []
    now = [1000.0]

    def pause(self: drain_module.DrainWait, seconds: float) -> bool:
        del self
        pauses.append(seconds)
        now[0] += seconds
        return True

    monkeypatch.setattr(drain_module.DrainWait, "pause", pause)
    monkeypatch.setattr(drain_module.time, "monotonic", lambda: now[0])
    return pauses


def test_a_held_back_tick_is_ticked_again_until_the_rows_come(slept: list[float]) -> None:
    trigger = ScriptedTrigger([HELD, HELD, ROWS, IDLE])
    assert (
        drain(trigger, lambda events: None, max_ticks=None, progress=None, lease_wait_seconds=0)
        == 5
    )
    assert trigger.ticks == 4
    assert slept == [HELD_BACK_FIRST_SECONDS, 2 * HELD_BACK_FIRST_SECONDS]


def test_rows_delivered_start_a_new_hold(slept: list[float]) -> None:
    trigger = ScriptedTrigger([HELD, HELD, HELD, ROWS, HELD, IDLE])
    drain(trigger, lambda events: None, max_ticks=None, progress=None, lease_wait_seconds=0)
    first = HELD_BACK_FIRST_SECONDS
    assert slept == [first, 2 * first, 4 * first, first]


def test_a_hold_that_outlasts_the_wait_raises_naming_the_blocker(slept: list[float]) -> None:
    trigger = ScriptedTrigger([ROWS, HELD])
    with pytest.raises(FetchError) as raised:
        drain(
            trigger,
            lambda events: None,
            max_ticks=None,
            progress=None,
            lease_wait_seconds=0,
            held_wait_seconds=10,
        )
    text = str(raised.value)
    assert "stopped after 5 row(s)" in text
    assert "session 4711" in text
    assert "for 75s" in text
    assert "nothing was skipped" in text
    assert 10 <= sum(slept) <= 11  # waited the budget (waits of at most a second), then raised
    assert max(slept) == 1.0


def test_a_young_hold_is_waited_for_no_longer_than_its_second(slept: list[float]) -> None:
    """As the runner: a hold 0.9 s into its second (MariaDB's whole-second bound)
    ends at the second's end, so the drain does not sleep the doubling past it."""
    young = TickResult(0, 0, "idle", held_back=True, held_back_seconds=0.9)
    trigger = ScriptedTrigger([HELD, HELD, HELD, HELD, young, ROWS, IDLE])
    drain(trigger, lambda events: None, max_ticks=None, progress=None, lease_wait_seconds=0)
    first = HELD_BACK_FIRST_SECONDS
    assert slept[:4] == [first, 2 * first, 4 * first, 8 * first]
    assert slept[4] == pytest.approx(0.1)  # not 16 * first: the rest of the second


def test_an_idle_tick_without_a_hold_still_ends_the_drain(slept: list[float]) -> None:
    trigger = ScriptedTrigger([ROWS, ROWS, IDLE, ROWS])
    assert (
        drain(trigger, lambda events: None, max_ticks=None, progress=None, lease_wait_seconds=0)
        == 10
    )
    assert slept == []


def test_drain_waits_out_an_open_transaction_and_delivers_every_row(
    server_db: TestDatabase,
) -> None:
    """Real guard, real hold: a writer's transaction open across the drain's start
    holds the committed row back; the drain keeps ticking and returns both rows
    once the writer commits (before: it returned 0 at once)."""
    _, insert = events_table(server_db)
    source = SqlAlchemySource(
        url=server_db.url,
        table="events",
        schema=server_db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
    )
    trigger = PollTrigger(name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen: list[int] = []
    held = threading.Event()
    outcome: list[Any] = []
    blocker = server_db.engine.connect()
    try:
        blocker.begin()
        blocker.execute(sa.text(insert), {"note": "late"})
        server_db.execute(insert, {"note": "early"})

        def run() -> None:
            try:
                outcome.append(
                    trigger.drain(
                        lambda events: seen.extend(int(e.pk["id"]) for e in events),
                        progress=lambda rows, result: held.set() if result.held_back else None,
                        held_wait_seconds=120,
                    )
                )
            except Exception as exc:
                outcome.append(exc)

        drainer = threading.Thread(target=run, daemon=True)
        drainer.start()
        assert held.wait(60), "the guard never held the committed row back"
        assert drainer.is_alive(), f"the drain returned while rows were held back: {outcome}"
        blocker.commit()
        drainer.join(120)
        assert not drainer.is_alive()
    finally:
        blocker.close()
        source.close()
    assert outcome == [2]
    assert sorted(seen) == [1, 2]


class ScriptedWorker(ScriptedTrigger):
    """What ``dbtrigger backfill`` ticks: ``tick_result(handler, should_stop=...)``."""

    def tick_result(  # type: ignore[override]
        self,
        handler: Callable[[Sequence[Any]], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> TickResult:
        del should_stop
        return super().tick_result(handler)


def test_backfill_is_not_caught_up_while_rows_are_held_back(slept: list[float]) -> None:
    """``dbtrigger backfill`` printed "caught up" at the first idle tick, held or not."""
    worker = ScriptedWorker([ROWS, HELD, HELD, ROWS, IDLE])
    progress = backfill.Progress(io.StringIO(), None, tty=False)
    args = argparse.Namespace(max_retries=3, retry_delay=0.0)
    finished = backfill._drain(
        args, worker, lambda events: None, progress, Console(io.StringIO(), io.StringIO())
    )
    assert finished
    assert progress.done == 10
    assert worker.ticks == 5
    assert slept == [HELD_BACK_FIRST_SECONDS, 2 * HELD_BACK_FIRST_SECONDS]
