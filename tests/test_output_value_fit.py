"""db.output values that reached their column changed without a word: rounded, cut
off, read in a time zone, or sent through a binary float; live on SQLite,
PostgreSQL and MariaDB (``dbtrigger._write_values.misfit``).

Each value is either stored as given (read back equal) or refused before
anything is written, as an OutputValueError naming the row and the column,
not retryable: writing the batch again would change nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import DbOut
from dbtrigger.errors import ConfigurationError, OutputValueError, RetryableError
from dbtrigger.output import OutputTarget
from tests.databases import TestDatabase

UTC = dt.timezone.utc
PLUS_TWO = dt.timezone(dt.timedelta(hours=2))

#: Column types per database, by role.
TYPES = {
    "postgresql": {
        "ts": "TIMESTAMP",
        "tstz": "TIMESTAMPTZ",
        "ts0": "TIMESTAMP(0)",
        "tm0": "TIME(0)",
        "num": "NUMERIC(12,2)",
        "big": "NUMERIC",
        "f8": "DOUBLE PRECISION",
        "f4": "REAL",
        "i4": "INTEGER",
        "i8": "BIGINT",
        "u": "UUID",
        "txt": "TEXT",
        "bin": "BYTEA",
        "flag": "BOOLEAN",
        "day": "DATE",
        "tod": "TIME",
        "doc": "JSONB",
    },
    "mariadb": {
        "ts": "DATETIME(6)",
        "tstz": "TIMESTAMP(6) NULL",
        "ts0": "DATETIME",
        "tm0": "TIME",
        "num": "DECIMAL(12,2)",
        "big": "DECIMAL(65,30)",
        "f8": "DOUBLE",
        "f4": "FLOAT",
        "i4": "INT",
        "i8": "BIGINT",
        "u": "UUID",
        "txt": "TEXT",
        "bin": "BLOB",
        "flag": "BOOLEAN",
        "day": "DATE",
        "tod": "TIME(6)",
        "doc": "JSON",
    },
    "sqlite": {
        "ts": "DATETIME",
        "tstz": "TIMESTAMP",
        "ts0": "DATETIME",
        "tm0": "TIME",
        "num": "NUMERIC(12,2)",
        "big": "NUMERIC",
        "f8": "REAL",
        "f4": "FLOAT",
        "i4": "INTEGER",
        "i8": "BIGINT",
        "u": "CHAR(36)",
        "txt": "TEXT",
        "bin": "BLOB",
        "flag": "BOOLEAN",
        "day": "DATE",
        "tod": "TIME",
        "doc": "JSON",
    },
}
FIXTURES = {"postgresql": "pg", "mariadb": "mariadb", "sqlite": "sqlite_db"}


@pytest.fixture
def typed(request: pytest.FixtureRequest) -> Iterator[tuple[TestDatabase, OutputTarget]]:
    """A table with one column of each role on the database ``request.param`` names."""
    db: TestDatabase = request.getfixturevalue(FIXTURES[request.param])
    columns = ", ".join(f"{name} {kind}" for name, kind in TYPES[db.kind].items())
    db.execute(f"CREATE TABLE {db.qualified('fit')} (id INTEGER PRIMARY KEY, {columns})")
    target = OutputTarget(url=db.url, table="fit", schema=db.schema)
    yield db, target
    target.close()


def stored(db: TestDatabase, column: str) -> list[Any]:
    table = sa.Table("fit", sa.MetaData(schema=db.schema), autoload_with=db.engine)
    with db.engine.connect() as conn:
        return list(conn.execute(sa.select(table.c[column]).order_by(table.c.id)).scalars())


#: Values each database stores as given (the check read them back equal).
KEPT: dict[str, list[tuple[str, Any]]] = {
    "all": [
        ("ts", dt.datetime(2026, 3, 29, 2, 30, 0, 123456)),
        ("ts0", dt.datetime(2026, 1, 1, 10, 0, 0)),
        ("num", Decimal("1234567890.12")),
        ("num", Decimal("1.2")),
        ("num", 7),
        ("f8", Decimal("0.1")),
        ("f8", 2**53),
        ("f4", Decimal("0.125")),
        ("i4", 2.0),
        ("i8", 2**63 - 1),
        ("txt", "héllo ☃ 🎉"),
        ("txt", None),
        ("bin", b"\x00\xff"),
        ("flag", True),
        ("day", dt.date(2026, 2, 28)),
        ("tod", dt.time(10, 0, 0, 123456)),
    ],
    "postgresql": [
        ("tstz", dt.datetime(2026, 1, 1, 10, 0, tzinfo=PLUS_TWO)),
        ("i4", Decimal("2.0")),
        ("big", Decimal("12345678901234567890.123456789012345678")),
        ("big", 2**70 + 1),
        ("u", uuid.UUID(int=12345)),
        ("doc", {"k": ["é", 1, None]}),
    ],
    "mariadb": [
        ("tstz", dt.datetime(2026, 1, 1, 10, 0, 0, 5)),
        ("i4", Decimal("2.0")),
        ("big", Decimal("12345678901234567890.123456789012345678")),
        ("u", uuid.UUID(int=12345)),
    ],
    "sqlite": [("big", Decimal("1234567.25")), ("big", 2**70), ("doc", {"k": ["é", 1, None]})],
}


@pytest.mark.parametrize("typed", list(TYPES), indirect=True)
def test_values_each_column_holds_read_back_as_written(
    typed: tuple[TestDatabase, OutputTarget],
) -> None:
    db, target = typed
    cases = [*KEPT["all"], *KEPT[db.kind]]
    out = DbOut(target)
    for index, (column, value) in enumerate(cases):
        out.set({"id": index, column: value})
        assert out.flush() == 1
    for column, given in cases:
        got = stored(db, column)
        wanted = given
        if column in ("f4", "f8"):  # a number given to a binary float is that float
            got, wanted = [float(g) for g in got if g is not None], float(given)
        assert wanted in got, (column, given, got)


#: (database, column, value, words of the reason): each was stored changed before.
REFUSED = [
    # PostgreSQL read it in the session's TimeZone: another instant per server setting.
    ("postgresql", "tstz", dt.datetime(2026, 1, 1, 10, 0), "naive datetime"),
    # Rounded (PostgreSQL: 10:00:00.999999 became 10:00:01) or cut off (MariaDB).
    ("postgresql", "ts0", dt.datetime(2026, 1, 1, 10, 0, 0, 999999), "microseconds (999999)"),
    ("mariadb", "ts0", dt.datetime(2026, 1, 1, 10, 0, 0, 999999), "microseconds (999999)"),
    ("postgresql", "tm0", dt.time(10, 0, 0, 500000), "microseconds (500000)"),
    ("mariadb", "tm0", dt.time(10, 0, 0, 500000), "microseconds (500000)"),
    # NUMERIC(12,2): 1.239 was stored as 1.24 on all three.
    *((kind, "num", Decimal("1.239"), "3 digits after the decimal point") for kind in TYPES),
    *((kind, "num", 1.239, "3 digits after the decimal point") for kind in TYPES),
    # An integer column: 1.5 became 2 on PostgreSQL and MariaDB (and stayed 1.5 on SQLite).
    *((kind, "i4", Decimal("1.5"), "has a fraction") for kind in TYPES),
    *((kind, "i4", 1.5, "has a fraction") for kind in TYPES),
    # A binary float column: rounded to the nearest double.
    *((kind, "f8", Decimal("0.30000000000000000001"), "significant digits") for kind in TYPES),
    *((kind, "f8", 2**53 + 1, "significant digits") for kind in TYPES),
    # A 4-byte float (SQLite's FLOAT is 8 bytes): MariaDB gave back 0.123457.
    *(
        (kind, "f4", Decimal("0.1234567"), "significant digits")
        for kind in ("postgresql", "mariadb")
    ),
    # SQLite's NUMERIC is a binary float: 12345678901234567890.12... became ...7168.
    ("sqlite", "big", Decimal("12345678901234567890.123456789012345678"), "SQLite keeps"),
    # PostgreSQL stored the hex escape '\x627974...' as the text.
    *((kind, "txt", b"bytes", "is bytes") for kind in TYPES),
    # The time of day cut off (10:30 stored as the date alone), the offset dropped.
    *((kind, "day", dt.datetime(2026, 1, 1, 10, 30), "time of day") for kind in TYPES),
    *((kind, "tod", dt.time(10, 0, tzinfo=PLUS_TWO), "time zone") for kind in TYPES),
    # psycopg raised a TypeError of its own (not a DbTriggerError) for text in bytea.
    *((kind, "bin", "text", "is text") for kind in TYPES),
    # pysqlite cannot send them: a retryable OutputWriteError, for ever, before.
    ("sqlite", "i4", Decimal("2"), "SQLite's driver cannot send"),
    ("sqlite", "u", uuid.UUID(int=1), "SQLite's driver cannot send"),
    ("sqlite", "txt", Decimal("1.10"), "SQLite's driver cannot send"),
    ("sqlite", "txt", dt.timedelta(hours=30), "SQLite's driver cannot send"),
    # json.dumps cannot write them: psycopg's own TypeError came out of out.flush().
    *((kind, "doc", {"at": dt.datetime(2026, 1, 1)}, "not JSON serializable") for kind in TYPES),
    *((kind, "doc", [Decimal("1.1")], "not JSON serializable") for kind in TYPES),
    # SQLAlchemy's SQLite DATETIME refuses text: read as the database failing, before.
    ("sqlite", "ts", "2026-01-01 10:00", "cannot store a str value"),
]


@pytest.mark.parametrize(
    ("typed", "column", "value", "words"),
    REFUSED,
    indirect=["typed"],
    ids=[f"{k}-{c}-{type(v).__name__}-{i}" for i, (k, c, v, _) in enumerate(REFUSED)],
)
def test_a_value_its_column_would_change_is_refused_and_nothing_is_written(
    typed: tuple[TestDatabase, OutputTarget], column: str, value: Any, words: str
) -> None:
    db, target = typed
    out = DbOut(target)
    out.set([{"id": 1, column: None}, {"id": 2, column: None}, {"id": 3, column: value}])
    with pytest.raises(OutputValueError) as err:
        out.flush()
    assert not isinstance(err.value, RetryableError)
    assert err.value.fields["column"] == column
    assert err.value.fields["row"] == 2
    assert words in str(err.value)
    assert "Writing it again cannot help" in str(err.value)
    assert stored(db, column) == []  # all or nothing


@pytest.mark.parametrize("typed", ["postgresql"], indirect=True)
def test_the_conversions_the_refusals_give_are_stored_as_meant(
    typed: tuple[TestDatabase, OutputTarget],
) -> None:
    """A naive UTC wall clock given its zone is that instant whatever the session's
    TimeZone; a timestamp(0) value with its microseconds dropped is that second."""
    db, target = typed
    naive = dt.datetime(2026, 1, 1, 10, 0, 0, 999999)
    target.write(
        [{"id": 1, "tstz": naive.replace(tzinfo=UTC), "ts0": naive.replace(microsecond=0)}]
    )
    assert stored(db, "tstz") == [naive.replace(tzinfo=UTC)]
    assert stored(db, "ts0") == [dt.datetime(2026, 1, 1, 10, 0, 0)]


@pytest.mark.parametrize("typed", list(TYPES), indirect=True)
@pytest.mark.parametrize("action", ["insert", "upsert"])
def test_rows_with_other_columns_than_the_first_are_refused(
    typed: tuple[TestDatabase, OutputTarget], action: str
) -> None:
    """OutputTarget.write built its statement from row 0's columns: a column only a
    later row named was dropped (its value lost, the default stored, 'wrote 2'), and
    one a later row lacked failed as a retryable OutputWriteError."""
    db, _ = typed
    target = OutputTarget(
        url=db.url,
        table="fit",
        schema=db.schema,
        action=action,  # type: ignore[arg-type]
        conflict_columns=["id"] if action == "upsert" else None,
    )
    try:
        with pytest.raises(ConfigurationError, match=r"row 1 .* same columns"):
            target.write([{"id": 1, "i4": 1}, {"id": 2, "i4": 2, "txt": "kept?"}])
        with pytest.raises(ConfigurationError, match=r"row 1 .* same columns"):
            target.write([{"id": 1, "i4": 1, "txt": "a"}, {"id": 2, "i4": 2}])
        assert stored(db, "id") == []
    finally:
        target.close()


@pytest.mark.parametrize("typed", ["postgresql"], indirect=True)
def test_a_json_serializer_of_the_engine_is_the_one_that_judges(
    typed: tuple[TestDatabase, OutputTarget],
) -> None:
    """A datetime inside a JSON value is refused only when the engine's serializer
    cannot write it: one given as json_serializer= that can is used as it is."""
    db, _ = typed
    target = OutputTarget(
        url=db.url,
        table="fit",
        schema=db.schema,
        engine_kwargs={"json_serializer": lambda value: json.dumps(value, default=str)},
    )
    try:
        target.write([{"id": 1, "doc": {"at": dt.datetime(2026, 1, 1)}}])
    finally:
        target.close()
    assert stored(db, "doc") == [{"at": "2026-01-01 00:00:00"}]
