"""How long the MariaDB horizon says a busy table's rows have been held (#26).

With the default ``precision=0`` the timestamp bound is the oldest running
statement's start truncated to the whole second: a steady writer's rows of the
current second wait until the clock passes it, however short its transactions.
The guard reports such a hold as the time into that second (under
:data:`~dbtrigger.runtime.pacing.SHORT_HOLD_SECONDS`), so the runner's next
wait ends about when the second does; a statement running for seconds makes
an old hold, waited for as one. Near the end of such a second a fetch that
comes a few milliseconds before InnoDB's cache may be read fresh again waits
for it instead of keeping the old bound for one more wait. The observations
are built by hand: the decision, no server and no clock.
"""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest

from dbtrigger.cursor import Position
from dbtrigger.runtime.pacing import SHORT_HOLD_SECONDS, held_back_delay
from dbtrigger.sources.visibility import mariadb
from dbtrigger.sources.visibility.innodb_trx import CACHE_SECONDS, Observation, Observed
from dbtrigger.sources.visibility.mariadb import (
    WAIT_OUT_SECONDS,
    MariaDbHorizon,
    _InnoDbActive,
    _State,
)

SECOND = Decimal(1_795_785_778)
AFTER = Position(cursor=None, pk={})


def guard(precision: int = 0) -> _InnoDbActive:
    target: Any = SimpleNamespace(source_name="events", dialect="mariadb")
    return _InnoDbActive(MariaDbHorizon(precision=precision), target, timestamp=True)


def observed(at: Decimal, newest: Decimal, statements: dict[int, Decimal]) -> Observation:
    return Observation(at, at, statements, {}, None, newest)


def held_for(active: _InnoDbActive, *observations: Observation) -> tuple[Any, float]:
    state = _State()
    for observation in observations:
        active._advance(state, observation)
    info = active._info(state, AFTER)
    assert info.held_back
    return state.bound, info.held_back_seconds


@pytest.mark.parametrize("into", ["0.05", "0.4", "0.8", "0.999"])
def test_a_steady_writers_rows_are_held_until_their_second_ends(into: str) -> None:
    # Nothing running at the observation (the writer's statements take
    # milliseconds); the newest row is of this second.
    at = SECOND + Decimal(into)
    bound, seconds = held_for(guard(), observed(at, at - Decimal("0.002"), {}))
    assert bound == SECOND  # truncated: a NOW() writer may still write SECOND.000000
    assert seconds == pytest.approx(float(into))
    assert seconds < SHORT_HOLD_SECONDS
    # The runner's wait after the 5th held tick ends with the second (0.8 s before).
    left = 1 - float(into)
    assert held_back_delay(5, 5.0, seconds) == pytest.approx(max(0.05, min(0.8, left)))


def test_a_statement_running_for_seconds_is_an_old_hold() -> None:
    at = SECOND + Decimal("0.5")
    statement = {7: at - Decimal("11.6")}
    bound, seconds = held_for(guard(), observed(at, at, statement))
    assert bound == SECOND - 12
    assert seconds == pytest.approx(12.5)
    assert held_back_delay(8, 5.0, seconds) == 5.0


def test_precision_six_holds_only_behind_the_oldest_statement() -> None:
    at = SECOND + Decimal("0.4")
    running = {3: at - Decimal("0.003")}
    bound, seconds = held_for(guard(6), observed(at, at, running))
    assert bound == at - Decimal("0.003")
    assert seconds == pytest.approx(0.003)


class Clock:
    """The guard's ``time``: a monotonic clock that only sleeps move."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize(
    ("left", "observes"), [(0.02, True), (0.05, True), (0.09, False), (0.0, True)]
)
def test_a_fetch_just_before_the_cache_may_be_read_again_waits_for_it(
    monkeypatch: pytest.MonkeyPatch, left: float, observes: bool
) -> None:
    # The runner woke when the held second ended, 20 ms before InnoDB refreshes
    # its cache again: the guard waits those 20 ms and observes the new second
    # (it kept the old bound, for one more wait); 50 ms: the 50 ms wait after
    # the fetch that follows a delivery. 90 ms away: kept, no wait.
    clock = Clock()
    monkeypatch.setattr(mariadb, "time", clock)
    active = guard()
    at = SECOND + Decimal("0.9")
    active._state.last = observed(at, at, {})
    active._state.bound = active._state.bound_at = SECOND
    active._state.last_attempt = clock.now - CACHE_SECONDS + left
    active._state.last_fresh = clock.now
    seen: list[Any] = []

    def observe(conn: Any, previous: Any, read_max: Any) -> Observed:
        del conn, read_max
        seen.append(previous)
        now = SECOND + 1 + Decimal("0.005")
        return Observed(observed(now, now, {}), 0, True)

    monkeypatch.setattr(mariadb, "observe", observe)
    assert active._refresh(None) is observes  # type: ignore[arg-type]
    assert len(seen) == int(observes)
    assert active._state.bound == (SECOND + 1 if observes else SECOND)
    assert clock.slept == ([pytest.approx(left)] if observes and left else [])
    assert all(s <= WAIT_OUT_SECONDS for s in clock.slept)
