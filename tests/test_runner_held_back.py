"""A tick whose rows the visibility guard held back is followed by a short wait.

The rows are committed and wait only for transactions open at the guard's
probe (a writer's own, usually ending within milliseconds); sleeping the
whole interval made them wait that long again (on a busy MariaDB table, a
third of the rows did). The runner waits from 50 ms, doubling up to the
interval while the hold lasts, and the ordinary interval once nothing is held.
A hold younger than a second (a steady writer's rows behind the MariaDB
horizon's bound truncated to the second) is not waited past that second.
The waits are read from the runner's own requests (no clock involved).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from dbtrigger.runtime.pacing import SHORT_HOLD_SECONDS
from dbtrigger.runtime.runner import HELD_BACK_FIRST_SECONDS, Runner, held_back_delay
from dbtrigger.runtime.trigger import TickResult


class ScriptedTrigger:
    """A trigger whose ticks report what a script says."""

    name = "scripted"

    def __init__(self, results: Sequence[TickResult]) -> None:
        self.results = list(results)

    def tick_result(
        self, handler: Callable[[Sequence[Any]], None], should_stop: Callable[[], bool]
    ) -> TickResult:
        del handler, should_stop
        return self.results.pop(0)

    def tick(self, handler: Callable[[Sequence[Any]], None]) -> int:
        return self.tick_result(handler, lambda: False).rows

    def wait_for_work(self, seconds: float, stop: Any) -> None:
        del seconds, stop

    def close(self) -> None:
        return None


class RecordingRunner(Runner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits: list[float] = []

    def _idle(self, seconds: float) -> None:
        self.waits.append(seconds)


HELD = TickResult(0, 0, "idle", held_back=True, held_back_seconds=0.0)
IDLE = TickResult(0, 0, "idle")
ROWS = TickResult(5, 1, "committed")


def run(results: Sequence[TickResult], interval: float = 5.0) -> list[float]:
    runner = RecordingRunner(
        ScriptedTrigger(results), lambda events: None, interval_seconds=interval, progress=None
    )
    runner.run(max_ticks=len(results), install_signals=False)
    return runner.waits


class HoldingTrigger(ScriptedTrigger):
    """Every tick held back, for as long as the runner has waited since the first
    (a transaction that stays open): the report's age is the runner's own waits."""

    def __init__(self, ticks: int, waits: list[float]) -> None:
        super().__init__([])
        self.ticks, self.waits = ticks, waits

    def tick_result(
        self, handler: Callable[[Sequence[Any]], None], should_stop: Callable[[], bool]
    ) -> TickResult:
        del handler, should_stop
        self.ticks -= 1
        if self.ticks < 0:
            return IDLE
        return TickResult(0, 0, "idle", held_back=True, held_back_seconds=sum(self.waits))


def test_a_long_hold_waits_briefly_doubling_up_to_the_interval() -> None:
    trigger = HoldingTrigger(16, [])
    runner = RecordingRunner(trigger, lambda events: None, interval_seconds=5.0, progress=None)
    trigger.waits = runner.waits
    runner.run(max_ticks=17, install_signals=False)
    # Doubling from 50 ms, not past the hold's first second (0.75 s old: 0.25 s
    # left); from there as long as it has lasted beyond that second, from 50 ms.
    first = [0.05, 0.1, 0.2, 0.4, 0.25]
    later = [0.05, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0]
    assert runner.waits == pytest.approx(first + later)
    assert sum(first) == pytest.approx(SHORT_HOLD_SECONDS)


def test_a_steady_writers_hold_is_not_waited_past_its_second() -> None:
    # A busy MariaDB table: the rows of the second the horizon's bound is
    # truncated to arrive once the clock passes it. Delivered as the bound
    # moved on, then held while the second ages (0.75 s: 0.25 s left). The
    # doubling waited 0.8 s here, the rows of that second 0.55 s past it.
    held = [
        TickResult(0, 0, "idle", held_back=True, held_back_seconds=s)
        for s in (0.0, 0.05, 0.15, 0.35, 0.75)
    ]
    assert run([ROWS, *held, ROWS, IDLE]) == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.25, 5.0])


def test_a_hold_first_seen_after_an_idle_sleep_starts_short() -> None:
    # The guard's bound last moved at its observation before the worker's idle
    # sleep, so the first held tick after it reports the whole sleep (5.15 s):
    # the writer's transaction seen open is milliseconds old. Taken for an old
    # hold, the next wait was 4.15 s.
    held = [TickResult(0, 0, "idle", held_back=True, held_back_seconds=s) for s in (5.15, 5.2)]
    assert run([IDLE, *held, IDLE]) == pytest.approx([5.0, 0.05, 0.1, 5.0])


def test_rows_delivered_reset_the_held_back_wait() -> None:
    # After rows, ticking again at once (no wait); a new hold starts short again.
    assert run([HELD, HELD, ROWS, HELD, IDLE]) == [
        HELD_BACK_FIRST_SECONDS,
        2 * HELD_BACK_FIRST_SECONDS,
        HELD_BACK_FIRST_SECONDS,
        5.0,
    ]


@pytest.mark.parametrize(
    ("ticks", "interval", "held_for", "expected"),
    [
        (1, 5, None, 0.05),
        (3, 5, None, 0.2),
        (40, 5, None, 5),
        (1, 0.01, None, 0.01),
        (1, 5, 0.0, 0.05),
        (4, 5, 0.1, 0.4),
        (5, 5, 0.75, 0.25),  # not past the hold's first second
        (6, 5, 0.99, 0.05),  # at least the first wait
        (1, 5, 5.15, 0.05),  # the first held tick after an idle sleep: no old hold
        (2, 5, 3.0, 0.1),
        (7, 5, 1.0, 0.05),  # an older hold: from the first wait again ...
        (7, 5, 2.6, 1.6),  # ... as long as it has lasted beyond its first second
        (30, 5, 60.0, 5),
        (30, 0.01, 60.0, 0.01),
    ],
)
def test_held_back_delay(
    ticks: int, interval: float, held_for: float | None, expected: float
) -> None:
    assert held_back_delay(ticks, interval, held_for) == pytest.approx(expected)
