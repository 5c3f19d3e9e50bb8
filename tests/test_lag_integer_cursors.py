"""``lag_seconds`` for integer cursors, on SQLite, PostgreSQL and MariaDB.

An integer cursor carries no time. With a declared time column (``lag_column=``
or a ``SafetyWindow``'s ``time_column``) the lag is that column's age on the
oldest undelivered row; without one it is *observed*: the seconds since the
poller first saw the oldest undelivered row pending. The basis is reported
with the number: a ``lag_basis`` gauge label, the commit's log field, the
health report and the worker's banner.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.health import check_health, measure_lag
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.sources import lag as lagmod
from dbtrigger.sources.clock import _WALL_CLOCK, _naive
from dbtrigger.sources.visibility import SafetyWindow
from tests.databases import TestDatabase
from tests.test_cli_worker import run_cli
from tests.test_source_sqlalchemy import make_table, precise_datetime


@pytest.fixture(autouse=True)
def _measure_every_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker measures at most once a second; these tests look at every commit."""
    monkeypatch.setattr(lagmod, "MEASURE_INTERVAL_SECONDS", 0.0)


def events_table(db: TestDatabase) -> sa.Table:
    return make_table(
        db,
        "events",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("created_at", precise_datetime(timezone=False), nullable=True),
        index=("seq", "id"),
    )


def database_wall_clock(db: TestDatabase) -> dt.datetime:
    """The database's own wall clock: what a naive DEFAULT now() column would hold."""
    with db.engine.connect() as conn:
        value = _naive(conn.execute(sa.text(_WALL_CLOCK[db.engine.dialect.name])).scalar())
    assert value is not None
    return value


def source_on(db: TestDatabase, **options: Any) -> SqlAlchemySource:
    options.setdefault("visibility", "none")  # other sessions must not hold rows back
    return SqlAlchemySource(
        url=db.url,
        table="events",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        **options,
    )


def trigger_on(source: SqlAlchemySource, metrics: InMemoryMetrics, **options: Any) -> PollTrigger:
    return PollTrigger(
        name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        metrics=metrics,
        batch_size=2,
        max_batches_per_tick=1,
        **options,
    )


def ignore(events: Any) -> None:
    del events


def test_the_lag_column_ages_the_oldest_undelivered_row(db: TestDatabase) -> None:
    table = events_table(db)
    wall = database_wall_clock(db)
    # Row i was written (700 - 100 i) seconds ago: row 3, the first one left
    # after a batch of two, is 400 s old.
    rows = [
        {"id": i, "seq": 10 * i, "created_at": wall - dt.timedelta(seconds=700 - 100 * i)}
        for i in range(1, 7)
    ]
    with db.engine.begin() as conn:
        conn.execute(table.insert(), rows)
    metrics = InMemoryMetrics()
    source = source_on(db, lag_column="created_at")
    trigger = trigger_on(source, metrics)
    try:
        assert source.lag_basis() == "column:created_at"
        assert trigger.tick(ignore) == 2
        lag = metrics.gauge("lag_seconds", poller="events")
        assert lag is not None
        assert 390 < lag < 460  # row 3's age, give or take the test's own run time
        assert metrics.gauge("lag_basis", poller="events", lag_basis="column:created_at") == 1

        now = dt.datetime.now(dt.timezone.utc)
        measured = measure_lag(source, trigger.read_state().position, now)  # type: ignore[union-attr]
        assert measured.rows == 4
        assert measured.basis == "column:created_at"
        assert measured.seconds is not None
        assert 390 < measured.seconds < 460
        report = check_health(trigger.store, "events", source=source, now=now)
        assert report.lag_basis == "column:created_at"
        assert report.to_dict()["lag_basis"] == "column:created_at"

        trigger.tick(ignore)
        trigger.tick(ignore)  # rows 5 and 6: nothing is left
        assert metrics.gauge("lag_seconds", poller="events") == 0.0
    finally:
        source.close()


def test_a_safety_windows_time_column_is_the_lag_column(db: TestDatabase) -> None:
    table = events_table(db)
    wall = database_wall_clock(db)
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [
                {"id": i, "seq": i, "created_at": wall - dt.timedelta(seconds=300 - i)}
                for i in range(1, 4)
            ],
        )
    metrics = InMemoryMetrics()
    source = source_on(db, visibility=SafetyWindow(1.0, time_column="created_at"))
    trigger = trigger_on(source, metrics)
    try:
        assert source.lag_basis() == "column:created_at"
        assert trigger.tick(ignore) == 2
        lag = metrics.gauge("lag_seconds", poller="events")
        assert lag is not None
        assert 290 < lag < 360  # row 3 was written 297 s ago
    finally:
        source.close()


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def test_without_a_time_column_the_lag_is_observed(db: TestDatabase) -> None:
    table = events_table(db)
    with db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "seq": i} for i in range(1, 7)])
    metrics = InMemoryMetrics()
    clock = Clock()
    source = source_on(db)
    trigger = trigger_on(source, metrics, clock=clock)

    def lag() -> float | None:
        return metrics.gauge("lag_seconds", poller="events")

    try:
        assert source.lag_basis(resolve=True) == "observed"
        trigger.tick(ignore)  # rows 1-2; rows 3-6 are now seen pending
        assert lag() == 0.0
        assert metrics.gauge("lag_basis", poller="events", lag_basis="observed") == 1
        clock.advance(30)
        trigger.tick(ignore)  # rows 3-4; row 5 has been seen pending for 30 s
        assert lag() == pytest.approx(30.0)
        with db.engine.begin() as conn:
            conn.execute(table.insert(), [{"id": 7, "seq": 7}])
        clock.advance(20)
        trigger.tick(ignore)  # rows 5-6; row 7 is seen for the first time
        assert lag() == 0.0
        clock.advance(15)
        trigger.tick(ignore)  # row 7: caught up
        assert lag() == 0.0

        # A stateless probe cannot observe: it says what to declare instead.
        with db.engine.begin() as conn:
            conn.execute(table.insert(), [{"id": 8, "seq": 8}])
        measured = measure_lag(source, trigger.read_state().position, clock.now)  # type: ignore[union-attr]
        assert (measured.rows, measured.seconds, measured.basis) == (1, None, "observed")
        assert "declare lag_column=" in measured.note
    finally:
        source.close()


def test_a_timestamp_cursor_keeps_its_own_basis(sqlite_db: TestDatabase) -> None:
    table = make_table(
        sqlite_db,
        "events",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", precise_datetime(timezone=False), nullable=False),
    )
    wall = database_wall_clock(sqlite_db)
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "updated_at": wall - dt.timedelta(hours=1)}])
    metrics = InMemoryMetrics()
    source = SqlAlchemySource(
        url=sqlite_db.url,
        table="events",
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
    )
    try:
        assert source.lag_basis(resolve=True) == "cursor"
        trigger_on(source, metrics).tick(ignore)
        lag = metrics.gauge("lag_seconds", poller="events")
        assert lag is not None
        assert 3500 < lag < 3700
        assert metrics.gauge("lag_basis", poller="events", lag_basis="cursor") == 1
    finally:
        source.close()


def test_the_worker_banner_says_how_lag_is_measured(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    events_table(sqlite_db)
    for name, option, expected in (
        ("plain_app", "", "lag         observed: seconds since this worker first saw"),
        (
            "column_app",
            'lag_column="created_at",',
            "lag         the age of created_at on the oldest undelivered row",
        ),
    ):
        (tmp_path / f"{name}.py").write_text(
            "from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource\n"
            f"events = PollTrigger(name='events', checkpoint_store=InMemoryCheckpointStore(),\n"
            f"    source=SqlAlchemySource(url={sqlite_db.url!r}, table='events',\n"
            f"        cursor_column='seq', pk_columns=['id'], {option}))\n"
            "@events.handler\n"
            "def handle(events):\n"
            "    pass\n"
        )
        done = run_cli(["run", f"{name}:events", "--max-ticks", "1"], tmp_path)
        assert done.returncode == 0, done.stderr
        assert expected in done.stderr, done.stderr
