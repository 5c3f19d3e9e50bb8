"""A horizon guard says how long rows have been held back, and that age is true.

The snapshot horizon measured a hold from when the snapshot's ``xmin`` last
moved; the MariaDB horizon from when its bound's data was current. Neither
moves while nothing runs, so the first held-back fetch after an idle sleep
reported the whole sleep as the hold's age: "held back for 300s" of a writer's
transaction a moment old, in ``status``, the ``visibility_held_back_seconds``
metric, a false held-back WARNING (past ``warn_after_seconds``) and the
runner's held-back waits (:func:`~dbtrigger.runtime.pacing.held_back_delay`).
A hold began after the last report that found nothing held back, and no
earlier than the transaction that causes it (:func:`hold_age`).

The transaction horizon (``pg_stat_activity``) measures from the first probe
that saw a withheld value, taken at the observation, and every pending probe
is younger than the oldest open transaction: it had no such error.
"""

from __future__ import annotations

import logging
import time
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest

from dbtrigger import SqlAlchemySource
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.sources.visibility import SnapshotHorizon, install_visibility_trigger
from dbtrigger.sources.visibility import held_back as held_back_module
from dbtrigger.sources.visibility import horizons as horizons_module
from dbtrigger.sources.visibility.held_back import hold_age
from dbtrigger.sources.visibility.innodb_trx import Observation, Writer
from dbtrigger.sources.visibility.mariadb import MariaDbHorizon, _InnoDbActive
from tests.databases import TestDatabase

IDLE = 300.0


class GuardClock:
    """The guards' ``time``: real sleeps, a monotonic clock the test moves on."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.sleep = time.sleep

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> GuardClock:
    fake = GuardClock()
    for module in (held_back_module, horizons_module):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.mark.parametrize(
    ("staleness", "since_clear", "blocker_age", "expected"),
    [
        (300.0, 300.0, 0.4, 0.4),  # the idle sleep; the writer's transaction is young
        (300.0, 2.0, None, 2.0),  # nothing held at the report 2 s ago
        (3.0, 300.0, 50.0, 3.0),  # the guard's own measure, when it is the least
        (5.0, 9.0, -0.01, 0.0),  # clocks a hair apart: never negative
    ],
)
def test_a_hold_is_no_older_than_the_last_clear_report_or_its_blocker(
    staleness: float, since_clear: float, blocker_age: float | None, expected: float
) -> None:
    assert hold_age(staleness, since_clear, blocker_age) == pytest.approx(expected)


@pytest.fixture
def events(pg: TestDatabase) -> TestDatabase:
    pg.execute(f"CREATE TABLE {pg.qualified('events')} (id bigserial PRIMARY KEY, v int)")
    install_visibility_trigger(pg.engine, "events", schema=pg.schema, index_columns=["id"])
    return pg


def snapshot_xmin(db: TestDatabase) -> int:
    return int(str(db.scalar("SELECT pg_snapshot_xmin(pg_current_snapshot())")))


@pytest.mark.postgresql
@pytest.mark.xdist_group("shared-horizons")  # it holds a writer open (the xid horizon)
def test_the_snapshot_horizons_first_hold_after_an_idle_sleep_is_as_old_as_its_writer(
    events: TestDatabase, clock: GuardClock, caplog: pytest.LogCaptureFixture
) -> None:
    db = events
    table = db.qualified("events")
    db.execute(f"INSERT INTO {table} (v) VALUES (1)")
    source = SqlAlchemySource(
        url=db.url,
        table="events",
        schema=db.schema,
        cursor_column="dbtrigger_xid",
        pk_columns=["id"],
        visibility=SnapshotHorizon(warn_after_seconds=60),
    )
    writer = db.engine.connect()
    try:
        # A writer's transaction, open: the cluster's snapshot xmin stays at its
        # id, as it stays at the next id while nothing runs at all.
        writer.begin()
        writer.exec_driver_sql(f"INSERT INTO {table} (v) VALUES (2)")
        pid = writer.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        xid = int(writer.exec_driver_sql("SELECT pg_current_xact_id()::text").scalar_one())
        deadline = time.monotonic() + 30  # another test's older transaction: bounded wait
        while snapshot_xmin(db) != xid:
            assert time.monotonic() < deadline, "another transaction stayed older than ours"
            time.sleep(0.05)
        [row] = source.fetch(BEGINNING, 10)
        info = source.last_fetch_info
        assert info is not None
        assert not info.held_back  # the writer's own row is not committed: nothing held
        at_row = Position(cursor=row["dbtrigger_xid"], pk={"id": row["id"]})

        clock.offset += IDLE  # the worker's idle sleep; the xmin did not move
        db.execute(f"INSERT INTO {table} (v) VALUES (3)")  # committed behind the writer
        with caplog.at_level(logging.WARNING, logger="dbtrigger.sources"):
            assert source.fetch(at_row, 10) == []
        info = source.last_fetch_info
        assert info is not None
        assert info.held_back
        assert info.horizon == xid
        assert info.blocking_pid == pid
        assert info.blocking_xact_age_seconds is not None
        # Was IDLE and more: the time since the xmin last moved.
        assert info.held_back_seconds <= info.blocking_xact_age_seconds, info
        warned = [r for r in caplog.records if getattr(r, "event", "") == "visibility_held_back"]
        assert warned == []  # no false "held rows back for 300s" past warn_after_seconds
    finally:
        writer.rollback()
        writer.close()
        source.close()


# --- MariaDB: the decision, observations built by hand ------------------------------

T0 = Decimal(1_795_785_000)
AFTER = Position(cursor=None, pk={})


def mariadb_guard(*, timestamp: bool) -> _InnoDbActive:
    target: Any = SimpleNamespace(source_name="events", dialect="mariadb")
    return _InnoDbActive(MariaDbHorizon(), target, timestamp=timestamp)


def observation(
    at: Decimal, newest: Any, writers: dict[tuple[int, str], Writer] | None = None
) -> Observation:
    epoch = newest if isinstance(newest, Decimal) else None
    value = None if isinstance(newest, Decimal) else newest
    return Observation(at, at, {}, writers or {}, value, epoch)


def report(active: _InnoDbActive, seen: Observation) -> Any:
    with active._lock:
        active._advance(active._state, seen)
        info = active._info(active._state, AFTER)
    return active._reported(info)


def test_mariadbs_first_hold_after_an_idle_sleep_is_as_old_as_its_writer(
    clock: GuardClock,
) -> None:
    """A timestamp cursor: a writer new since the last observation may have read the
    clock any time after it, so the bound stays there; the hold is as old as the
    writer's transaction, not as the sleep."""
    active = mariadb_guard(timestamp=True)
    first = report(active, observation(T0, T0 - 5))  # idle: nothing held
    assert not first.held_back
    clock.offset += IDLE
    later = T0 + Decimal(IDLE)
    writer = Writer("421", 17, started=later - 1, lower=None, state="RUNNING")
    held = report(active, observation(later, later - Decimal("0.2"), {(17, "421"): writer}))
    assert held.held_back
    assert held.blocking_pid == 17
    assert held.blocking_xact_age_seconds == pytest.approx(1.0)
    assert held.held_back_seconds <= held.blocking_xact_age_seconds  # was 300


def test_mariadbs_auto_increment_rows_after_an_idle_sleep_wait_for_no_transaction(
    clock: GuardClock,
) -> None:
    """An AUTO_INCREMENT cursor's bound is the newest sample older than every open
    writer: after an idle sleep that is the sample before it, and the rows committed
    meanwhile wait for the next observation, held by no transaction. Their hold began
    with the observation that saw them, not with the sleep."""
    active = mariadb_guard(timestamp=False)
    report(active, observation(T0, 10))  # the first sample: no bound yet
    assert not report(active, observation(T0 + 1, 10)).held_back  # the bound is 10
    clock.offset += IDLE
    later = T0 + 1 + Decimal(IDLE)
    held = report(active, observation(later, 25))  # rows 11-25 committed during the sleep
    assert held.held_back
    assert held.blocking_pid is None
    assert held.held_back_seconds == pytest.approx(0.0)  # was 300
    nothing_open = report(active, observation(later + Decimal("0.11"), 25))
    assert not nothing_open.held_back  # the next observation releases them
