"""How long the MariaDB horizon says a busy table's rows have been held (#26).

With the default ``precision=0`` the timestamp bound is the oldest running
statement's start truncated to the whole second: a steady writer's rows of the
current second wait until the clock passes it, however short its transactions.
The guard reports such a hold as the time into that second (under
:data:`~dbtrigger.runtime.pacing.SHORT_HOLD_SECONDS`), so the runner's next
wait ends about when the second does; a statement running for seconds makes
an old hold, waited for as one. The observations are built by hand: the
decision, no server and no clock.
"""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest

from dbtrigger.cursor import Position
from dbtrigger.runtime.pacing import SHORT_HOLD_SECONDS, held_back_delay
from dbtrigger.sources.visibility.innodb_trx import Observation
from dbtrigger.sources.visibility.mariadb import MariaDbHorizon, _InnoDbActive, _State

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
