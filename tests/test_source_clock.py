"""``SqlAlchemySource.cursor_age_seconds``: lag in seconds for naive timestamp cursors.

A naive timestamp is the database's wall clock; the test sessions run in a
zone far from UTC (+05:30), so an age computed against UTC would be off by
19,800 seconds.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger.cursor import BEGINNING
from dbtrigger.sources.base import MeasuresCursorAge
from dbtrigger.sources.visibility import NoGuard
from tests.databases import TestDatabase

UTC = dt.timezone.utc
ZONE_OPTIONS: dict[str, dict[str, Any]] = {
    "postgresql": {"connect_args": {"options": "-c timezone=Asia/Kolkata"}},
    "mariadb": {"connect_args": {"init_command": "SET time_zone = '+05:30'"}},
    "sqlite": {},
}
NOW_MINUS_90S = {
    "postgresql": "LOCALTIMESTAMP - INTERVAL '90 seconds'",
    "mariadb": "NOW(6) - INTERVAL 90 SECOND",
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now', '-90 seconds')",
}


def test_naive_cursor_age_uses_the_database_wall_clock(db: TestDatabase) -> None:
    kind = db.kind
    ts = {"postgresql": "timestamp", "mariadb": "DATETIME(6)", "sqlite": "TEXT"}[kind]
    table = db.qualified("ev")
    db.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY, at {ts} NOT NULL)")
    source = SqlAlchemySource(
        url=db.url,
        table="ev",
        schema=db.schema,
        cursor_column="at",
        pk_columns=["id"],
        engine_kwargs=ZONE_OPTIONS[kind],
        # Ageing a cursor is the subject here, not the late-commit guard: MariaDB's
        # horizon is server-wide, so another session's open transaction would hold
        # this row back at random.
        visibility=NoGuard(),
    )
    with source.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (1, {NOW_MINUS_90S[kind]})"))
    assert isinstance(source, MeasuresCursorAge)
    row = source.fetch(BEGINNING, 1)[0]
    age = source.cursor_age_seconds(row["at"], dt.datetime.now(UTC))
    assert age is not None
    assert 85 <= age <= 120, age


def test_aware_and_non_time_cursors(sqlite_db: TestDatabase) -> None:
    source = SqlAlchemySource(url=sqlite_db.url, table="t", cursor_column="c", pk_columns=["id"])
    now = dt.datetime(2024, 1, 1, 12, tzinfo=UTC)
    assert source.cursor_age_seconds(now - dt.timedelta(seconds=30), now) == 30.0
    assert source.cursor_age_seconds(42, now) is None  # an integer has no clock
    assert source.cursor_age_seconds("not a time", now) is None
