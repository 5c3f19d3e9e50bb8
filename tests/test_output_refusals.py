"""A row that breaks a rule of its table, on SQLite, PostgreSQL and MariaDB at their
default settings: a data problem (typed, not retryable) or worth retrying (typed).

Every case used to be an ``OutputWriteError`` (retryable): a redelivery failed the
same way for ever, and MariaDB's message quoted the duplicate value. Now the error
says which rule, which columns and which row (by its key), and never a value.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import DbBindings, DbOut, HandlerError, RowChange, SqlAlchemySource
from dbtrigger.dbio import DbWriter
from dbtrigger.errors import (
    OperatorError,
    OutputConstraintError,
    OutputReferenceError,
    OutputValueError,
    OutputWriteError,
    RetryableError,
)
from dbtrigger.output import OutputTarget
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.databases import TestDatabase

#: Values no message may show (the key columns, ``id``, may be shown).
SECRET = "s3cret"  # noqa: S105 - a marker, not a password

GOOD = {"id": 2, "email": f"{SECRET}-g@x", "name": "g", "qty": 1, "parent_id": 1}


@pytest.fixture
def sink(db: TestDatabase) -> TestDatabase:
    """r_sink: a primary key, a unique email, a NOT NULL name of 5 characters, a
    SMALLINT qty checked >= 0 and a foreign key to r_parent; one row (id 1) in it."""
    parent, table = db.qualified("r_parent"), db.qualified("r_sink")
    db.execute(f"CREATE TABLE {parent} (id INTEGER PRIMARY KEY)")
    db.execute(
        f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, email VARCHAR(40), "
        "name VARCHAR(5) NOT NULL, qty SMALLINT, parent_id INTEGER, "
        "CONSTRAINT ux_email UNIQUE (email), CONSTRAINT ck_qty CHECK (qty >= 0), "
        f"CONSTRAINT fk_parent FOREIGN KEY (parent_id) REFERENCES {parent} (id))"
    )
    db.execute(f"INSERT INTO {parent} VALUES (1)")
    db.execute(f"INSERT INTO {table} VALUES (1, '{SECRET}-a@x', 'n', 0, 1)")
    return db


def ids(db: TestDatabase) -> list[int]:
    with db.engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql(f"SELECT id FROM {db.qualified('r_sink')}")]


ALL = ("sqlite", "postgresql", "mariadb")
#: (case, the bad row's changes, action) -> per dialect: the error class, the kind
#: (``fields["kind"]``), a text the message names, whether the row is named by its key.
#: None: SQLite at its defaults stores the row (no length, range or foreign-key check).
CASES: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "unique, not the upsert's key": (
        {"email": f"{SECRET}-a@x"},
        "upsert",
        {
            "sqlite": (OutputConstraintError, "unique", "'ux_email' on (email)", False),
            "postgresql": (OutputConstraintError, "unique", "'ux_email' on (email)", True),
            # MariaDB's upsert guard fails the statement without naming the key
            "mariadb": (OutputConstraintError, "unique", "not the upsert's conflict key", True),
        },
    ),
    "unique, insert of a key that exists": (
        {"id": 1},
        "insert",
        {
            "sqlite": (OutputConstraintError, "unique", "action='upsert'", False),
            "postgresql": (OutputConstraintError, "unique", "'r_sink_pkey' on (id)", True),
            "mariadb": (OutputConstraintError, "unique", "'PRIMARY' on (id)", True),
        },
    ),
    "not null": (
        {"name": None},
        "insert",
        dict.fromkeys(ALL, (OutputConstraintError, "not_null", "column 'name'", True)),
    ),
    "check": (
        {"qty": -1},
        "insert",
        {  # only MariaDB's failed statement leaves the transaction to find the row in
            "sqlite": (OutputConstraintError, "check", "'ck_qty'", False),
            "postgresql": (OutputConstraintError, "check", "'ck_qty'", False),
            "mariadb": (OutputConstraintError, "check", "'ck_qty'", True),
        },
    ),
    "too long": (
        {"name": f"{SECRET}-long"},
        "insert",
        {
            "sqlite": None,
            "postgresql": (OutputValueError, None, "column 'name' (VARCHAR(5))", True),
            "mariadb": (OutputValueError, None, "column 'name' (VARCHAR(5))", True),
        },
    ),
    "out of range": (
        {"qty": 70000},
        "insert",
        {
            "sqlite": None,
            "postgresql": (OutputValueError, None, "column 'qty' (SMALLINT)", True),
            "mariadb": (OutputValueError, None, "column 'qty' (SMALLINT)", True),
        },
    ),
    "past 64 bits": (
        {"qty": 2**70},
        "insert",
        dict.fromkeys(ALL, (OutputValueError, None, "column 'qty' (SMALLINT)", True)),
    ),
    "foreign key": (
        {"parent_id": 99},
        "insert",
        {
            "sqlite": None,
            "postgresql": (OutputReferenceError, "foreign_key", "'fk_parent' on (parent_id)", True),
            "mariadb": (OutputReferenceError, "foreign_key", "'fk_parent' on (parent_id)", True),
        },
    ),
}


@pytest.mark.parametrize("binding", ["db.output", "DbWriter"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_row_that_breaks_a_rule_is_typed(sink: TestDatabase, case: str, binding: str) -> None:
    db = sink
    changes, action, expected = CASES[case]
    bad = {**GOOD, "id": 3, "email": f"{SECRET}-b@x", **changes}
    rows = [GOOD, bad]
    want = expected[db.kind]

    def write() -> None:
        if binding == "db.output":
            conflict = ["id"] if action == "upsert" else None
            target = OutputTarget(
                url=db.url,
                table="r_sink",
                schema=db.schema,
                action=action,  # type: ignore[arg-type]
                conflict_columns=conflict,
            )
            try:
                target.write(rows)
            finally:
                target.close()
        else:
            writer = DbWriter(url=db.url, table="r_sink", schema=db.schema)
            try:
                if action == "upsert":
                    writer.upsert_many(rows=rows, conflict_columns=["id"])
                else:
                    writer.insert_many(rows=rows)
            finally:
                writer.close()

    if want is None:
        write()
        assert sorted(ids(db)) == [1, 2, 3]  # stored as it is: SQLite checks none of it
        return
    kind_of_error, kind, named, by_key = want
    with pytest.raises(
        OutputWriteError if kind_of_error is OutputReferenceError else OperatorError
    ) as err:
        write()
    error = err.value
    assert type(error) is kind_of_error, (type(error), error)
    assert isinstance(error, RetryableError) == (kind_of_error is OutputReferenceError)
    message = str(error)
    assert SECRET not in message, message
    assert SECRET not in repr(error.log_fields())
    assert f"{db.kind if db.kind != 'mariadb' else 'mysql'}:r_sink" in message.replace(
        f"{db.schema}.", ""
    )
    assert named in message, message
    if kind is not None:
        assert error.fields["kind"] == kind
    if by_key:
        assert "row 1 (id=" in message, message
        assert error.fields["row"] == 1
    else:
        assert "one of the 2 rows" in message, message
    assert sorted(ids(db)) == [1]  # nothing half-written


def test_under_a_trigger_a_duplicate_goes_to_the_dead_letter_sink(
    sqlite_db: TestDatabase, tmp_path: Any
) -> None:
    """The poller does not stall behind a row whose write breaks a unique key: with a
    dead-letter sink, after max_attempts the row is set aside (its error typed, no
    value in it) and the rows beside it are written."""
    db = sqlite_db
    db.execute("CREATE TABLE src (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, email TEXT)")
    db.execute("CREATE TABLE out_rows (id INTEGER PRIMARY KEY, email TEXT UNIQUE)")
    db.execute(f"INSERT INTO out_rows VALUES (100, '{SECRET}-dup')")
    db.execute(
        "INSERT INTO src VALUES (1, 1, :a), (2, 2, :b), (3, 3, :c)",
        {"a": f"{SECRET}-1", "b": f"{SECRET}-dup", "c": f"{SECRET}-3"},
    )
    source = SqlAlchemySource(url=db.url, table="src", cursor_column="seq", pk_columns=["id"])
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    bindings = DbBindings()

    @bindings.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        name="copy",
        max_attempts=2,
        quarantine=sink,
    )
    @bindings.output("out", url=db.url, table="out_rows", action="upsert", conflict_columns=["id"])
    def copy(timer: object, events: list[RowChange], out: DbOut) -> None:
        out.set([{"id": e.pk["id"], "email": e.after["email"]} for e in events])

    with pytest.raises(HandlerError) as err:
        copy(timer=None)
    assert isinstance(err.value.__cause__, OutputConstraintError)
    copy(timer=None)  # the second delivery bisects: row 2 is set aside
    with db.engine.connect() as conn:
        written = sorted(r[0] for r in conn.exec_driver_sql("SELECT id FROM out_rows"))
    assert written == [1, 3, 100]
    records = sink.records("copy")
    assert [r.pk for r in records] == [{"id": 2}]
    assert "OutputConstraintError" in records[0].error
    assert SECRET not in records[0].error
    with sa.create_engine(db.url).connect() as conn:  # the source row is untouched
        assert conn.exec_driver_sql("SELECT count(*) FROM src").scalar() == 3


def test_deleting_a_row_still_referred_to_is_retryable(sink: TestDatabase) -> None:
    """DbWriter.delete of a parent row a child row still refers to: the child may be
    deleted first by another delivery, so it is retried (it was an untyped write error)."""
    db = sink
    if db.kind == "sqlite":  # foreign keys are not checked at SQLite's defaults
        writer = DbWriter(url=db.url, table="r_parent")
        try:
            assert writer.delete(pk={"id": 1}) == 1
        finally:
            writer.close()
        return
    writer = DbWriter(url=db.url, table="r_parent", schema=db.schema)
    try:
        with pytest.raises(OutputReferenceError, match=r"other rows still refer to") as err:
            writer.delete(pk={"id": 1})
    finally:
        writer.close()
    assert "'fk_parent'" in str(err.value)
    assert err.value.fields["kind"] == "foreign_key"
