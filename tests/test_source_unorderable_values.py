"""Cursor values with no place in the order, and bookkeeping that must not fail a tick.

* A NaN cursor (PostgreSQL ``numeric`` and ``double precision``) is refused
  when the poller reaches its row, as an operator error naming the row's key
  and the column; every row before it is delivered. Before, a numeric NaN made
  the observed-lag bookkeeping raise ``decimal.InvalidOperation`` after the
  first commit (``dbtrigger run`` died hundreds of rows early), and a float
  NaN was delivered and checkpointed, after which every later row was behind
  the checkpoint. Infinities are ordered values: delivered and checkpointed.
* A MariaDB/MySQL zero date (``0000-00-00``, or a zero month or day) in a
  ``DATE``, ``DATETIME`` or ``TIMESTAMP`` cursor comes back from pymysql as
  text. It is refused, naming the zero date and the key, before anything of its
  batch is delivered; before, it became a text checkpoint that the next tick
  refused as a "type change", stopping the poller on its own checkpoint.
* A lag measurement that fails after a commit (a value the driver cannot
  convert in the ``lag_column``, a custom source's bug) never fails the tick:
  it is counted and said once at WARNING.
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SerializationError, SqlAlchemySource
from dbtrigger.cursor import Position
from dbtrigger.health import check_health
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.sources import lag as lagmod
from dbtrigger.sources.lag import LagReading
from tests.databases import TestDatabase


@pytest.fixture(autouse=True)
def _measure_every_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker measures lag at most once a second; these tests look at every commit."""
    monkeypatch.setattr(lagmod, "MEASURE_INTERVAL_SECONDS", 0.0)


class Recorder:
    def __init__(self) -> None:
        self.keys: list[Any] = []

    def __call__(self, events: Any) -> None:
        self.keys.extend(e.pk["id"] for e in events)


def poller(
    db: TestDatabase,
    table: str,
    cursor: str,
    metrics: InMemoryMetrics | None = None,
    *,
    batch_size: int = 100,
    **kw: Any,
) -> PollTrigger:
    source = SqlAlchemySource(
        url=db.url,
        table=table,
        schema=db.schema,
        cursor_column=cursor,
        pk_columns=["id"],
        visibility="none",  # other sessions must not hold rows back
        **kw,
    )
    return PollTrigger(
        name=table,
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        metrics=metrics,
        batch_size=batch_size,
    )


def tick_until_refused(trigger: PollTrigger, handle: Recorder, ticks: int = 20) -> Exception:
    """Tick until a tick raises (bounded by ``ticks``); the exception it raised."""
    for _ in range(ticks):
        try:
            trigger.tick(handle)
        except Exception as exc:  # the test looks at what came out
            return exc
    raise AssertionError(f"no tick refused anything; delivered {len(handle.keys)} rows")


# --- NaN and infinities (PostgreSQL numeric and double precision) ---------------------------


@pytest.mark.postgresql
@pytest.mark.parametrize("column_type", ["numeric", "double precision"])
def test_a_nan_cursor_is_refused_when_reached_and_every_row_before_it_is_delivered(
    pg: TestDatabase, column_type: str
) -> None:
    table = pg.qualified("measures")
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n {column_type} NOT NULL)")
    pg.execute(f"CREATE INDEX ON {table} (n, id)")
    pg.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 300) AS g")
    pg.execute(f"INSERT INTO {table} VALUES (301, 'NaN')")  # sorts after every number
    metrics = InMemoryMetrics()
    trigger = poller(pg, "measures", "n", metrics)
    handle = Recorder()
    try:
        error = tick_until_refused(trigger, handle)
        # The observed-lag bookkeeping after each commit did not fail a tick
        # (before: decimal.InvalidOperation after the first batch of 100).
        assert sorted(handle.keys) == list(range(1, 301))
        assert isinstance(error, SerializationError), repr(error)
        message = str(error)
        assert "NaN" in message
        assert "{'id': 301}" in message
        assert "'n'" in message
        state = trigger.read_state()
        assert state is not None
        assert state.position.pk == {"id": 300}
        assert float(state.position.cursor) == 300.0
        # Said again on the next tick: the poller stays on the row until it is fixed.
        assert isinstance(tick_until_refused(trigger, handle, ticks=1), SerializationError)
        assert metrics.total("lag_measurement_failures_total") == 0
        # Once a number is put in the row, it is delivered.
        pg.execute(f"UPDATE {table} SET n = 301 WHERE id = 301")
        trigger.tick(handle)
        assert sorted(handle.keys) == list(range(1, 302))
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


@pytest.mark.postgresql
@pytest.mark.parametrize("column_type", ["numeric", "double precision"])
def test_infinite_cursors_are_ordered_values_delivered_and_checkpointed(
    pg: TestDatabase, column_type: str
) -> None:
    table = pg.qualified("measures")
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n {column_type} NOT NULL)")
    pg.execute(
        f"INSERT INTO {table} VALUES (1, '-Infinity'), (2, 0), (3, 1.5), (4, 'Infinity'), "
        "(5, 'Infinity')"
    )
    trigger = poller(pg, "measures", "n", batch_size=2)
    handle = Recorder()
    try:
        for _ in range(5):
            trigger.tick(handle)
        assert handle.keys == [1, 2, 3, 4, 5]
        state = trigger.read_state()
        assert state is not None
        assert state.position.cursor == float("inf")  # Decimal('Infinity') == inf too
        assert state.position.pk == {"id": 5}
        # The infinite checkpoint is bound back: nothing again, and a later tie comes.
        assert trigger.tick(handle) == 0
        pg.execute(f"INSERT INTO {table} VALUES (6, 'Infinity')")
        assert trigger.tick(handle) == 1
        assert handle.keys[-1] == 6
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_nan_has_no_checkpoint_encoding_and_infinities_round_trip() -> None:
    from dbtrigger.cursor import decode_value, encode_value  # noqa: PLC0415

    for nan in (float("nan"), decimal.Decimal("NaN"), decimal.Decimal("sNaN")):
        with pytest.raises(SerializationError, match="NaN"):
            encode_value(nan)
    for value in (
        float("inf"),
        float("-inf"),
        decimal.Decimal("Infinity"),
        decimal.Decimal("-Infinity"),
    ):
        kind, encoded = encode_value(value)
        assert decode_value(kind, encoded) == value
        assert type(decode_value(kind, encoded)) is type(value)


# --- MariaDB/MySQL zero dates ------------------------------------------------------------------


def insert_zero_dates(db: TestDatabase, column_type: str, rows: list[tuple[int, str]]) -> None:
    """The test's own table, with zero dates written in a session that allows them
    (MariaDB's default sql_mode does; set here so the test does not depend on it)."""
    with db.engine.begin() as conn:
        conn.execute(sa.text("SET SESSION sql_mode = ''"))
        conn.execute(
            sa.text(
                f"CREATE TABLE {db.qualified('legacy')} (id INT PRIMARY KEY, "
                f"changed {column_type} NULL, note VARCHAR(20), KEY ix_changed_id (changed, id))"
            )
        )
        for key, value in rows:
            conn.execute(
                sa.text(f"INSERT INTO {db.qualified('legacy')} VALUES (:id, :v, 'x')"),
                {"id": key, "v": value},
            )


@pytest.mark.mariadb
@pytest.mark.parametrize(
    ("column_type", "zero", "real"),
    [
        ("DATE", "0000-00-00", "2026-01-01"),
        ("DATETIME(6)", "0000-00-00 00:00:00", "2026-01-01 10:00:00"),
        ("TIMESTAMP", "0000-00-00 00:00:00", "2026-01-01 10:00:00"),
    ],
)
def test_a_zero_date_cursor_is_refused_naming_it_and_never_becomes_a_checkpoint(
    mariadb: TestDatabase, column_type: str, zero: str, real: str
) -> None:
    """Zero dates sort first: the first batch ends on one (a text checkpoint, before)."""
    insert_zero_dates(mariadb, column_type, [(1, zero), (2, zero), (3, real), (4, real)])
    trigger = poller(mariadb, "legacy", "changed", batch_size=2)
    handle = Recorder()
    try:
        error = tick_until_refused(trigger, handle)
        assert isinstance(error, SerializationError), repr(error)
        message = str(error)
        assert "zero date" in message
        assert zero in message
        assert "{'id': 1}" in message
        assert "'changed'" in message
        assert "NO_ZERO_DATE" in message  # what to do
        assert handle.keys == []
        assert trigger.read_state() is None  # no checkpoint the next tick would refuse
        # Fixed in the table, the rows come through and the checkpoint is a date.
        mariadb.execute(
            f"UPDATE {mariadb.qualified('legacy')} SET changed = :d WHERE id IN (1, 2)",
            {"d": "2025-12-31"},
        )
        trigger.tick(handle)
        trigger.tick(handle)
        assert handle.keys == [1, 2, 3, 4]
        state = trigger.read_state()
        assert state is not None
        assert isinstance(state.position.cursor, dt.date)
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


@pytest.mark.mariadb
@pytest.mark.parametrize("query_mode", [False, True])
def test_a_date_with_a_zero_day_mid_table_stops_the_poller_at_that_row(
    mariadb: TestDatabase, query_mode: bool
) -> None:
    """``2026-01-00`` sorts between December and January: rows before it are delivered."""
    insert_zero_dates(
        mariadb,
        "DATETIME",
        [(1, "2025-06-01 00:00:00"), (2, "2026-01-00 10:00:00"), (3, "2026-02-01 00:00:00")],
    )
    options: dict[str, Any] = {"batch_size": 1}
    if query_mode:
        source = SqlAlchemySource(
            url=mariadb.url,
            query=f"SELECT id, changed FROM {mariadb.qualified('legacy')}",
            cursor_column="changed",
            pk_columns=["id"],
            visibility="none",
        )
        trigger = PollTrigger(
            name="legacy", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=1
        )
    else:
        trigger = poller(mariadb, "legacy", "changed", **options)
    handle = Recorder()
    try:
        error = tick_until_refused(trigger, handle)
        assert handle.keys == [1]
        assert isinstance(error, SerializationError), repr(error)
        assert "2026-01-00 10:00:00" in str(error)
        assert "{'id': 2}" in str(error)
        state = trigger.read_state()
        assert state is not None
        assert state.position.pk == {"id": 1}
        assert isinstance(state.position.cursor, dt.datetime)
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_a_value_of_another_kind_than_its_column_never_becomes_a_checkpoint(
    sqlite_db: TestDatabase,
) -> None:
    """SQLite keeps what it is given: an INTEGER cursor column can hold text.

    At a batch end it became a text checkpoint, which the next fetch refused
    as a type change of the column; the row is refused instead, naming it.
    """
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)"))
        conn.execute(sa.text("INSERT INTO events VALUES (1, 1), (2, 2), (3, 'soon'), (4, 'x')"))
    trigger = poller(sqlite_db, "events", "seq", batch_size=2)
    handle = Recorder()
    try:
        error = tick_until_refused(trigger, handle)
        assert handle.keys == [1, 2]
        assert isinstance(error, SerializationError), repr(error)
        assert "{'id': 3}" in str(error)
        assert "'soon'" in str(error)
        assert "type change" in str(error)
        state = trigger.read_state()
        assert state is not None
        assert state.position.cursor == 2
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_an_sqlite_date_time_column_holding_unix_time_is_checkpointed_as_the_number(
    sqlite_db: TestDatabase,
) -> None:
    """SQLite keeps an integer written to a DATETIME column as an integer (before all text).

    A batch ending on it wrote an integer checkpoint, which the next fetch
    refused as a type change of the column.
    """
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE events (id INTEGER PRIMARY KEY, ts DATETIME NOT NULL)"))
        conn.execute(
            sa.text(
                "INSERT INTO events VALUES (1, 1577836800), (2, 1577836801), "
                "(3, '2020-01-01 00:00:00')"
            )
        )
    trigger = poller(sqlite_db, "events", "ts", batch_size=1)
    handle = Recorder()
    try:
        for _ in range(4):
            trigger.tick(handle)
        assert handle.keys == [1, 2, 3]
        state = trigger.read_state()
        assert state is not None
        assert state.position.cursor == "2020-01-01 00:00:00"
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


# --- lag bookkeeping never fails a tick ----------------------------------------------------------


def test_a_lag_column_the_driver_cannot_read_does_not_fail_the_commit_tick(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite: a DATETIME lag column holding text; its row is the oldest pending one.

    The measurement after the first commit reads it and fails (before: a raw
    ``ValueError`` out of the tick whose batch had committed). The row itself
    is then refused by the fetch, as an operator error naming it.
    """
    with sqlite_db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, "
                "created_at DATETIME)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO events VALUES (1, 1, '2026-01-01 00:00:00'), (2, 2, 'yesterday'), "
                "(3, 3, '2026-01-01 00:00:00')"
            )
        )
    metrics = InMemoryMetrics()
    trigger = poller(sqlite_db, "events", "seq", metrics, lag_column="created_at", batch_size=1)
    handle = Recorder()
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger.runtime"):
            assert trigger.tick(handle) == 1
        assert handle.keys == [1]
        failed = [r for r in caplog.records if getattr(r, "event", "") == "lag_measurement_failed"]
        assert len(failed) == 1
        assert failed[0].levelno == logging.WARNING
        assert "yesterday" in failed[0].getMessage()
        assert metrics.total("lag_measurement_failures_total", error_type="SerializationError") == 1
        error = tick_until_refused(trigger, handle, ticks=1)
        assert isinstance(error, SerializationError)
        assert "{'id': 2}" in str(error)
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


class BrokenLagSource(SqlAlchemySource):
    """A source of the user's own whose lag measurement has a bug (raises a plain error)."""

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        raise RuntimeError("lag bug in a custom source")

    def row_age(self, row: Any, now: dt.datetime) -> LagReading:
        raise RuntimeError("lag bug in a custom source")


def test_a_failing_lag_measurement_is_said_once_and_counted_every_time(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)"))
        conn.execute(sa.text("INSERT INTO events VALUES (:i, :i)"), [{"i": i} for i in range(1, 5)])
    metrics = InMemoryMetrics()
    source = BrokenLagSource(
        url=sqlite_db.url, table="events", cursor_column="seq", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        metrics=metrics,
        batch_size=1,
    )
    handle = Recorder()
    try:
        with caplog.at_level(logging.DEBUG, logger="dbtrigger.runtime"):
            for _ in range(4):
                assert trigger.tick(handle) == 1
        assert handle.keys == [1, 2, 3, 4]
        said = [r for r in caplog.records if getattr(r, "event", "") == "lag_measurement_failed"]
        assert [r.levelno for r in said] == [logging.WARNING] + [logging.DEBUG] * 3
        assert "RuntimeError" in said[0].getMessage()
        assert metrics.total("lag_measurement_failures_total", error_type="RuntimeError") == 4
        # The health check reports the source's failure instead of raising it.
        with sqlite_db.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO events VALUES (5, 5)"))
        report = check_health(trigger.store, "events", source=source)
        assert report.status == "error"
        assert "RuntimeError" in report.reason
    finally:
        source.close()
