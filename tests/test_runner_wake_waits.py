"""How the runner applies a wake-up hint's shorter wait (#26).

``AdaptivePolling`` used to sleep by itself, in place of the trigger's own
``wait_for_work``: whatever ends that wait early (a queue's ``LISTEN``, a
partition member gaining partitions or waiting out a handover) was skipped,
so ``--wake adaptive`` made such a worker slower than no hint. The runner now
asks the hint how long and sleeps through the trigger's wait. The waits are
read from what the trigger was asked (no clock, no sleeping).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dbtrigger.runtime import pacing
from dbtrigger.runtime.runner import Runner
from dbtrigger.runtime.trigger import TickResult
from dbtrigger.wakeup import AdaptivePolling
from tests.test_runner_held_back import HELD, IDLE, ROWS, ScriptedTrigger


class SleepRecordingTrigger(ScriptedTrigger):
    """Records each idle sleep it is asked for, and returns at once (as if woken)."""

    def __init__(self, results: list[TickResult]) -> None:
        super().__init__(results)
        self.sleeps: list[float] = []

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        del stop
        self.sleeps.append(seconds)
        return True


def sleeps(results: list[TickResult], wake: Any = None, interval: float = 5.0) -> list[float]:
    trigger = SleepRecordingTrigger(results)
    runner = Runner(
        trigger, lambda events: None, interval_seconds=interval, progress=None, wake=wake
    )
    runner.run(max_ticks=len(results), install_signals=False)
    return trigger.sleeps


def test_adaptive_polling_shortens_the_triggers_own_wait() -> None:
    waits = sleeps([ROWS, IDLE, IDLE, HELD, ROWS, IDLE], AdaptivePolling(0.05))
    # After rows: 0.05, then doubling; a held tick waits the shorter of the two
    # rules (held back first: 0.05 < 0.2); rows start the schedule again.
    assert waits == [0.05, 0.1, pacing.HELD_BACK_FIRST_SECONDS, 0.05]


@pytest.mark.parametrize(
    "script",
    [
        [IDLE, IDLE, ROWS, IDLE, IDLE, IDLE, IDLE, IDLE, IDLE, IDLE, IDLE, IDLE],
        [ROWS, HELD, HELD, HELD, HELD, IDLE, IDLE, ROWS, HELD, IDLE],
        [HELD, HELD, ROWS, IDLE, HELD, HELD, HELD, HELD, HELD, HELD, HELD, IDLE],
    ],
)
def test_the_adaptive_waits_are_never_longer_than_polling_alone(
    script: list[TickResult],
) -> None:
    alone = sleeps(list(script))
    adaptive = sleeps(list(script), AdaptivePolling(0.05))
    assert len(adaptive) == len(alone)  # the same ticks slept, through the trigger
    assert all(a <= b for a, b in zip(adaptive, alone, strict=True)), (adaptive, alone)
    assert adaptive != alone  # and some shorter


class Careless:
    """A hint whose delay ignores its bound."""

    def __init__(self, answer: float) -> None:
        self.answer = answer

    def attach(self, trigger: Any) -> None:
        del trigger

    def delay(self, seconds: float, idle_ticks: int | None) -> float:
        del seconds, idle_ticks
        return self.answer

    def wait(self, seconds: float, stop: threading.Event, *, idle_ticks: int | None) -> bool:
        raise AssertionError("the runner asks delay() of a hint that has it")

    def close(self) -> None:
        return None


@pytest.mark.parametrize(("answer", "expected"), [(60.0, 5.0), (-1.0, 0.0), (0.3, 0.3)])
def test_a_hint_may_only_shorten_the_wait(answer: float, expected: float) -> None:
    assert sleeps([IDLE], Careless(answer)) == [expected]
    assert pacing.shortened(Careless(answer), 5.0, 1) == expected


class Notifying:
    """A hint that notifies (as NotifyHint does): the runner ends the trigger's own
    wait on its event, and never asks it to sleep by itself."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def attach(self, trigger: Any) -> None:
        del trigger

    def woken(self) -> threading.Event:
        return self.event

    def wait(self, seconds: float, stop: threading.Event, *, idle_ticks: int | None) -> bool:
        raise AssertionError("the runner ends the trigger's wait on woken() instead")

    def close(self) -> None:
        return None


class StopRecordingTrigger(SleepRecordingTrigger):
    """Records whether the stop it was given was set when its wait began."""

    def __init__(self, results: list[TickResult]) -> None:
        super().__init__(results)
        self.stopped: list[bool] = []

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        self.stopped.append(stop.is_set())
        return super().wait_for_work(seconds, stop)


def test_a_notifying_hint_ends_the_triggers_own_wait() -> None:
    hint, trigger = Notifying(), StopRecordingTrigger([IDLE, IDLE])
    hint.event.set()  # a notification came while the first tick ran
    Runner(trigger, lambda events: None, progress=None, wake=hint).run(
        max_ticks=2, install_signals=False
    )
    # The trigger's own wait, for the whole interval, ended by the notification
    # the first time; the notification spent, the second wait is not.
    assert trigger.sleeps == [5.0, 5.0]
    assert trigger.stopped == [True, False]
    assert not hint.event.is_set()


def test_stop_or_woken() -> None:
    stop, woken = threading.Event(), threading.Event()
    either = pacing.StopOrWoken(stop, woken)
    assert not either.is_set()
    assert either.wait(0) is False
    woken.set()
    assert either.is_set()
    assert either.wait(60) is True  # at once: blocked on the hint's event
    woken.clear()
    either.set()  # setting it is a stop
    assert stop.is_set()
    assert either.wait(60) is True
