"""db.output values that reached the table changed, or failed as if the database were
unwell, and an output table altered under a running function; live on SQLite,
PostgreSQL and MariaDB (``dbtrigger._write_values``, ``TableHandle.forget``)."""

from __future__ import annotations

import datetime as dt
import json
import math
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import azure.functions as func
import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from dbtrigger import (
    DbBindings,
    DbOut,
    HandlerError,
    InMemoryCheckpointStore,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.azure import binding_of
from dbtrigger.errors import (
    CommitError,
    ConfigurationError,
    OutputConstraintError,
    OutputValueError,
    RetryableError,
)
from dbtrigger.output import OutputTarget
from tests.databases import TestDatabase
from tests.test_output import Clock, FailingCommits, wait_for_a_lock_wait

PLUS_TWO = dt.timezone(dt.timedelta(hours=2))


@pytest.fixture
def targets() -> Iterator[list[OutputTarget]]:
    """Targets made by a test, closed with it (no stray connections)."""
    made: list[OutputTarget] = []
    yield made
    for target in made:
        target.close()


def make_table(db: TestDatabase, name: str, *columns: sa.Column[Any]) -> sa.Table:
    meta = sa.MetaData(schema=db.schema)
    table = sa.Table(name, meta, sa.Column("id", sa.Integer, primary_key=True), *columns)
    meta.create_all(db.engine)
    return table


def alter(db: TestDatabase, table: sa.Table, change: str) -> None:
    name = db.engine.dialect.identifier_preparer.format_table(table)
    with db.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {name} {change}"))


def test_an_aware_datetime_in_a_column_without_a_time_zone_is_refused(
    db: TestDatabase, targets: list[OutputTarget]
) -> None:
    """10:00+02:00 was stored as 10:00 on SQLite and MariaDB (the offset dropped) and
    as 08:00 on PostgreSQL (the session's zone): another instant on each database,
    silently. It is refused naming the row and the column, and nothing is written;
    the conversion the message gives is stored as that wall clock on all three."""
    table = make_table(db, "stamps", sa.Column("at", sa.DateTime))
    target = OutputTarget(url=db.url, table="stamps", schema=db.schema)
    targets.append(target)
    aware = dt.datetime(2026, 1, 1, 10, 0, tzinfo=PLUS_TWO)
    rows = [{"id": 1, "at": dt.datetime(2026, 1, 1, 9, 0)}, {"id": 2, "at": aware}]

    with pytest.raises(OutputValueError) as err:
        target.write(rows)
    assert err.value.fields["column"] == "at"
    assert err.value.fields["row"] == 1
    assert "time-zone aware" in str(err.value)
    assert "astimezone(datetime.timezone.utc)" in str(err.value)
    assert not isinstance(err.value, RetryableError)
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 0

    rows[1]["at"] = aware.astimezone(dt.timezone.utc).replace(tzinfo=None)
    target.write(rows)
    with db.engine.connect() as conn:
        stored = conn.execute(sa.select(table.c.at).order_by(table.c.id)).scalars().all()
    assert stored == [dt.datetime(2026, 1, 1, 9, 0), dt.datetime(2026, 1, 1, 8, 0)]


def test_a_mariadb_json_column_takes_a_dict(
    mariadb: TestDatabase, targets: list[OutputTarget]
) -> None:
    """MariaDB's JSON is LONGTEXT with CHECK (json_valid(...)): a dict was refused,
    telling the user to give the column a type that holds it (JSON, which it was).
    A dict or a list is now sent as JSON text; a string, JSON text already (the
    json.dumps(...) the refusal asked for), is sent as it is, not encoded twice."""
    table = make_table(mariadb, "docs", sa.Column("body", sa.JSON), sa.Column("note", sa.Text))
    target = OutputTarget(url=mariadb.url, table="docs", schema=mariadb.schema)
    targets.append(target)

    target.write(
        [
            {"id": 1, "body": {"k": ["v", 1, None]}, "note": "{}"},
            {"id": 2, "body": json.dumps({"k": 2}), "note": "x"},
            {"id": 3, "body": [1, 2], "note": None},
            {"id": 4, "body": None, "note": None},
        ]
    )
    with mariadb.engine.connect() as conn:
        stored = conn.execute(sa.select(table.c.body, table.c.note).order_by(table.c.id)).all()
    assert [tuple(r) for r in stored] == [
        ({"k": ["v", 1, None]}, "{}"),
        ({"k": 2}, "x"),
        ([1, 2], None),
        (None, None),
    ]
    with pytest.raises(OutputValueError, match="column 'note'"):  # a plain text column
        target.write([{"id": 5, "body": None, "note": {"k": 1}}])


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_a_value_the_database_cannot_hold_is_refused_not_retried(
    kind: str, request: pytest.FixtureRequest, targets: list[OutputTarget]
) -> None:
    """A NUL in a PostgreSQL text column (psycopg's DataError) and a NaN on MariaDB
    (PyMySQL's ProgrammingError) failed as OutputWriteError, retryable: a batch
    delivered again and again, failing the same way, with no column named."""
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    make_table(db, "vals", sa.Column("txt", sa.Text), sa.Column("f", sa.Float))
    target = OutputTarget(url=db.url, table="vals", schema=db.schema)
    targets.append(target)
    row = (
        {"id": 1, "txt": "a\x00b", "f": 1.5}
        if kind == "postgresql"
        else {"id": 1, "txt": "a", "f": math.nan}
    )
    column = "txt" if kind == "postgresql" else "f"

    with pytest.raises(OutputValueError) as err:
        target.write([{"id": 0, "txt": "fine", "f": 0.0}, row])
    assert not isinstance(err.value, RetryableError)
    assert err.value.fields["column"] == column
    assert err.value.fields["row"] == 1
    assert "a\x00b" not in str(err.value)


def timer() -> TimerRequest:
    return TimerRequest(past_due=False, schedule_status={}, schedule={"AdjustForDST": True})


def test_a_column_added_under_a_running_function_app_is_written(
    db: TestDatabase, request: pytest.FixtureRequest
) -> None:
    """A function writing a column the table does not have yet fails (typed, the
    batch not committed); the operator adds the column; the next timer tick wrote
    nothing still: the table had been read once, and every delivery was refused
    against that copy until the host restarted."""
    orders = make_table(db, "orders", sa.Column("seq", sa.Integer, nullable=False))
    sink = make_table(db, "sink", sa.Column("amount", sa.Integer))
    with db.engine.begin() as conn:
        conn.execute(orders.insert(), [{"id": 1, "seq": 1}, {"id": 2, "seq": 2}])
    source = SqlAlchemySource(
        url=db.url, table="orders", schema=db.schema, cursor_column="seq", pk_columns=["id"]
    )
    request.addfinalizer(source.close)
    app = func.FunctionApp()
    bindings = DbBindings()

    @app.schedule(schedule="0 */5 * * * *", arg_name="timer")
    @bindings.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    @bindings.output(
        "out", url=db.url, table="sink", schema=db.schema, action="upsert", conflict_columns=["id"]
    )
    def orders_poll(timer: func.TimerRequest, events: list[RowChange], out: DbOut) -> None:
        out.set([{"id": e.pk["id"], "amount": 10, "note": "new"} for e in events])

    (function,) = app.get_functions()
    invoke = function.get_user_function()
    request.addfinalizer(binding_of(invoke).output.close)

    with pytest.raises(HandlerError) as err:
        invoke(timer=timer())
    assert isinstance(err.value.__cause__, ConfigurationError)
    assert "no column(s) note" in str(err.value)

    alter(db, sink, "ADD COLUMN note VARCHAR(20)")
    invoke(timer=timer())
    with db.engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT id, amount, note FROM {db.qualified('sink')}")).all()
    assert sorted(tuple(r) for r in rows) == [(1, 10, "new"), (2, 10, "new")]


def test_a_dropped_column_or_table_is_named_and_a_table_made_anew_is_written(
    db: TestDatabase, targets: list[OutputTarget]
) -> None:
    """A column dropped, then the table, since the first write: each write failed as
    OutputWriteError in the driver's words, retryable, against the copy read at the
    first write, even after the table was made again as it was."""
    table = make_table(db, "sink", sa.Column("amount", sa.Integer), sa.Column("note", sa.Text))
    target = OutputTarget(
        url=db.url, table="sink", schema=db.schema, action="upsert", conflict_columns=["id"]
    )
    targets.append(target)
    target.write([{"id": 1, "amount": 1, "note": "a"}])

    alter(db, table, "DROP COLUMN note")
    with pytest.raises(ConfigurationError, match=r"has no column\(s\) note"):
        target.write([{"id": 2, "amount": 2, "note": "b"}])

    table.drop(db.engine)
    with pytest.raises(ConfigurationError, match="does not exist"):
        target.write([{"id": 3, "amount": 3}])

    table.create(db.engine)
    target.write([{"id": 4, "amount": 4, "note": "d"}])
    with db.engine.connect() as conn:
        assert [tuple(r) for r in conn.execute(sa.select(table))] == [(4, 4, "d")]


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app:Sup3r@Secret@127.0.0.1:5432/db",
        "mysql+pymysql://app:Sup3r@Secret@127.0.0.1:3306/db",
    ],
)
def test_a_password_with_a_bare_at_sign_is_refused_without_showing_it(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A password holding an '@' not written as %40 ended at that '@': the rest of it
    was read as the host, and every write failed with OutputWriteError "failed to
    resolve host 'Secret@127.0.0.1'", the password's tail in the message and the
    traceback (the mask knew only the part before the '@')."""
    monkeypatch.setenv("DEST_DB_URL", url)
    target = OutputTarget(url="%DEST_DB_URL%", table="sink")  # the app still imports

    with pytest.raises(ConfigurationError) as err:
        target.write([{"id": 1}])
    shown = "".join(traceback.format_exception(err.value))
    assert "Secret" not in shown
    assert "Sup3r" not in shown
    assert "'DEST_DB_URL'" in str(err.value)
    assert "%40" in str(err.value)
    with pytest.raises(ConfigurationError, match="%40"):  # a literal URL: at once
        OutputTarget(url=url, table="sink")
    target.close()


def test_a_row_past_max_allowed_packet_is_named_not_retried(
    mariadb: TestDatabase, targets: list[OutputTarget]
) -> None:
    """MariaDB drops the connection on a statement larger than max_allowed_packet:
    the write failed as OutputWriteError "server has gone away", retryable, a batch
    failing so for ever with nothing saying which row or what to change."""
    table = make_table(mariadb, "docs", sa.Column("body", sa.Text(2**32 - 1)))
    target = OutputTarget(url=mariadb.url, table="docs", schema=mariadb.schema)
    targets.append(target)
    with mariadb.engine.connect() as conn:
        limit = int(conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one())

    with pytest.raises(OutputValueError) as err:
        target.write([{"id": 1, "body": "small"}, {"id": 2, "body": "x" * limit}])
    assert not isinstance(err.value, RetryableError)
    assert err.value.fields["row"] == 1
    assert err.value.fields["column"] == "body"
    assert "max_allowed_packet" in str(err.value)

    target.write([{"id": 3, "body": "x" * (limit // 4)}])  # the pool recovers
    with mariadb.engine.connect() as conn:
        assert conn.execute(sa.select(table.c.id)).scalars().all() == [3]


def test_rows_are_written_in_key_order_so_two_writers_wait_instead_of_deadlocking(
    pg: TestDatabase, caplog: pytest.LogCaptureFixture, targets: list[OutputTarget]
) -> None:
    """Rows were written in the order given: a write of keys [2, 1] took row 2 and
    waited for row 1, which another transaction held and then asked for row 2, a
    deadlock (one of them rolled back, a second of deadlock_timeout each; 20 threads
    upserting 10 of 40 keys in random order spent minutes so). In key order the
    write waits for row 1 holding nothing the other wants."""
    sink = pg.qualified("ko_sink")
    pg.execute(f"CREATE TABLE {sink} (id INTEGER PRIMARY KEY, v INTEGER)")
    pg.execute(f"INSERT INTO {sink} VALUES (1, 0), (2, 0)")
    target = OutputTarget(
        url=pg.url, table="ko_sink", schema=pg.schema, action="upsert", conflict_columns=["id"]
    )
    targets.append(target)
    outcome: list[Any] = []
    other = pg.engine.connect()
    try:
        tx = other.begin()
        other.exec_driver_sql("SET LOCAL deadlock_timeout = '60s'")  # the write's check decides
        other.exec_driver_sql(f"UPDATE {sink} SET v = 10 WHERE id = 1")

        def write() -> None:
            try:
                outcome.append(target.write([{"id": 2, "v": 2}, {"id": 1, "v": 1}]))
            except Exception as exc:
                outcome.append(exc)

        with caplog.at_level("INFO", logger="dbtrigger"):
            thread = threading.Thread(target=write)
            thread.start()
            wait_for_a_lock_wait(pg, "ko_sink", thread)
            other.exec_driver_sql(f"UPDATE {sink} SET v = 20 WHERE id = 2")
            tx.commit()
            thread.join(60)
    finally:
        other.close()
    assert outcome == [2], outcome
    events = [r.__dict__.get("event") for r in caplog.records]
    assert "output_write_retried" not in events, events  # no deadlock victim
    with pg.engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT id, v FROM {sink} ORDER BY id").fetchall()
    assert [tuple(r) for r in rows] == [(1, 1), (2, 2)]


@pytest.mark.parametrize("keyed", [True, False])
def test_the_default_insert_writes_a_redelivered_batch_again(
    sqlite_db: TestDatabase, keyed: bool, request: pytest.FixtureRequest
) -> None:
    """docs/azure.md: after a commit that failed once the handler had written, the
    redelivery's insert finds its rows there: refused on a keyed sink (pointing at
    action='upsert'), written twice on one without a key."""
    db = sqlite_db
    make_table(db, "orders", sa.Column("seq", sa.Integer, nullable=False))
    db.execute("INSERT INTO orders VALUES (1, 1), (2, 2)")
    key = "PRIMARY KEY" if keyed else ""
    db.execute(f"CREATE TABLE sink (order_id INTEGER {key}, amount INTEGER)")
    source = SqlAlchemySource(url=db.url, table="orders", cursor_column="seq", pk_columns=["id"])
    request.addfinalizer(source.close)
    store = FailingCommits(InMemoryCheckpointStore())
    clock = Clock()
    bindings = DbBindings()

    @bindings.trigger(
        arg_name="events", source=source, checkpoint_store=store, name="o", clock=clock
    )
    @bindings.output("out", url=db.url, table="sink")
    def poll(timer: object, events: list[RowChange], out: DbOut) -> None:
        out.set([{"order_id": e.pk["id"], "amount": 1} for e in events])

    request.addfinalizer(binding_of(poll).output.close)
    store.armed = True
    with pytest.raises(CommitError):
        poll(timer=None)
    store.armed = False
    clock.now += dt.timedelta(minutes=10)  # the lease lapsed
    if keyed:
        with pytest.raises(HandlerError) as err:
            poll(timer=None)
        assert isinstance(err.value.__cause__, OutputConstraintError)
        assert "action='upsert'" in str(err.value)
    else:
        poll(timer=None)
    with db.engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT order_id FROM sink ORDER BY order_id")).scalars()
        assert list(ids) == ([1, 2] if keyed else [1, 1, 2, 2])


def test_rows_of_a_table_referring_to_itself_keep_their_order(
    pg: TestDatabase, targets: list[OutputTarget]
) -> None:
    """A parent given before the row referring to it is written first, whatever
    their keys: sorted by key, the child (id 1) would come before its parent (id 2)
    and break the foreign key."""
    tree = pg.qualified("tree")
    pg.execute(f"CREATE TABLE {tree} (id INTEGER PRIMARY KEY, parent INTEGER REFERENCES {tree})")
    target = OutputTarget(
        url=pg.url, table="tree", schema=pg.schema, action="upsert", conflict_columns=["id"]
    )
    targets.append(target)
    assert target.write([{"id": 2, "parent": None}, {"id": 1, "parent": 2}]) == 2
