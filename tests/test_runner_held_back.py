"""A tick whose rows the visibility guard held back is followed by a short wait.

The rows are committed and wait only for transactions open at the guard's
probe (a writer's own, usually ending within milliseconds); sleeping the
whole interval made them wait that long again (on a busy MariaDB table, a
third of the rows did). The runner waits from 50 ms, doubling up to the
interval while the hold lasts, and the ordinary interval once nothing is held.
The waits are read from the runner's own requests (no clock involved).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

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


def test_held_back_ticks_wait_briefly_doubling_up_to_the_interval() -> None:
    first = HELD_BACK_FIRST_SECONDS
    waits = run([HELD] * 9 + [IDLE])
    assert waits == [min(5.0, first * 2**i) for i in range(9)] + [5.0]
    assert waits[-2] == 5.0  # a long hold ends up at the ordinary interval


def test_rows_delivered_reset_the_held_back_wait() -> None:
    # After rows, ticking again at once (no wait); a new hold starts short again.
    assert run([HELD, HELD, ROWS, HELD, IDLE]) == [
        HELD_BACK_FIRST_SECONDS,
        2 * HELD_BACK_FIRST_SECONDS,
        HELD_BACK_FIRST_SECONDS,
        5.0,
    ]


@pytest.mark.parametrize(
    ("ticks", "interval", "expected"), [(1, 5, 0.05), (3, 5, 0.2), (40, 5, 5), (1, 0.01, 0.01)]
)
def test_held_back_delay(ticks: int, interval: float, expected: float) -> None:
    assert held_back_delay(ticks, interval) == pytest.approx(expected)
