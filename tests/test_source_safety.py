"""Source definitions that used to lose rows silently, against the real databases.

Each case is either delivered completely or refused with a typed error that
names the column and the fix: lossy cursor/key types (single-precision floats),
a cursor whose type changed under a stored checkpoint, key columns that are not
unique, and the append-only table polled by its own key (``cursor = pk``).
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql

from dbtrigger import (
    FetchError,
    FileCheckpointStore,
    PollTrigger,
    RowChange,
    SerializationError,
    SqlAlchemySource,
)
from dbtrigger.cli.main import main as cli_main
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import RetryableError, SourceDefinitionError, SourcePermissionError
from dbtrigger.sources.column_checks import (
    kinds_for_type,
    lossy_type_reason,
    unique_key_problem,
)
from dbtrigger.sources.errors_map import classify
from tests.databases import TestDatabase


def source(db: TestDatabase, table: str, **kwargs: Any) -> SqlAlchemySource:
    return SqlAlchemySource(url=db.url, table=table, schema=db.schema, **kwargs)


def drain(trigger_source: SqlAlchemySource, store_dir: Path, *, batch: int = 2) -> list[RowChange]:
    """Tick until idle, a new PollTrigger each tick (the checkpoint goes through JSON).

    A tick the visibility guard held back is not idle: on MariaDB the horizon is
    server-wide, and another session's open writer holds it for a while.
    """
    store = FileCheckpointStore(store_dir)
    seen: list[RowChange] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        trigger = PollTrigger(
            name="safety", source=trigger_source, checkpoint_store=store, batch_size=batch
        )
        result = trigger.tick_result(seen.extend)
        if result.rows == 0 and not result.held_back:
            return seen
        if result.rows == 0:
            time.sleep(0.05)
    raise AssertionError(f"did not go idle; delivered {[e.pk for e in seen][:20]}...")


# --- 1. lossy cursor and key types --------------------------------------------------------


SINGLE_FLOAT = {"postgresql": "real", "mariadb": "FLOAT"}
DOUBLE_FLOAT = {"postgresql": "double precision", "mariadb": "DOUBLE", "sqlite": "REAL"}
#: Tied cursor values; 0.1 + 0.2 needs all 17 digits of a double to round-trip.
TIED = [0.7, 0.7, 0.7, 0.1 + 0.2, 0.1 + 0.2, 1 / 3, 1 / 3]


def float_table(db: TestDatabase, sql_type: str, *, cursor_is_key: bool = False) -> None:
    key = "r" if cursor_is_key else "id"
    db.execute(
        f"CREATE TABLE {db.qualified('f')} (id INT NOT NULL, r {sql_type} NOT NULL, "
        f"PRIMARY KEY ({key}))"
    )
    rows = [{"i": i, "r": v + (i if cursor_is_key else 0)} for i, v in enumerate(TIED)]
    db.execute(f"INSERT INTO {db.qualified('f')} (id, r) VALUES (:i, :r)", rows)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_single_precision_float_cursor_is_refused(
    kind: str, request: pytest.FixtureRequest
) -> None:
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    float_table(db, SINGLE_FLOAT[kind])
    polled = source(db, "f", cursor_column="r", pk_columns=["id"])
    with pytest.raises(SourceDefinitionError, match=r"cursor column 'r'.*single-precision"):
        polled.fetch(BEGINNING, 2)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_single_precision_float_key_is_refused(kind: str, request: pytest.FixtureRequest) -> None:
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    float_table(db, SINGLE_FLOAT[kind], cursor_is_key=True)
    polled = source(db, "f", cursor_column="id", pk_columns=["r"])
    with pytest.raises(SourceDefinitionError, match=r"key column 'r'.*single-precision"):
        polled.fetch(BEGINNING, 2)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_single_precision_float_is_refused_in_query_mode(
    kind: str, request: pytest.FixtureRequest
) -> None:
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    float_table(db, SINGLE_FLOAT[kind])
    polled = SqlAlchemySource(
        url=db.url,
        query=f"SELECT id, r FROM {db.qualified('f')}",
        cursor_column="r",
        pk_columns=["id"],
    )
    with pytest.raises(SourceDefinitionError, match="single-precision"):
        polled.fetch(BEGINNING, 2)


def test_double_precision_cursors_deliver_every_tied_row(db: TestDatabase, tmp_path: Path) -> None:
    """Doubles round-trip exactly on all three databases: accepted, nothing lost."""
    float_table(db, DOUBLE_FLOAT[db.kind])
    seen = drain(source(db, "f", cursor_column="r", pk_columns=["id"]), tmp_path)
    expected = sorted(range(len(TIED)), key=lambda i: (TIED[i], i))
    assert [e.pk["id"] for e in seen] == expected
    assert [e.cursor for e in seen] == [TIED[i] for i in expected]  # exact floats, not Decimal


@pytest.mark.parametrize(
    ("dialect", "type_", "lossy"),
    [
        ("postgresql", postgresql.REAL(), True),
        ("postgresql", sa.Float(precision=24), True),
        ("postgresql", postgresql.DOUBLE_PRECISION(precision=53), False),
        ("postgresql", sa.Float(precision=53), False),
        ("mariadb", mysql.FLOAT(), True),
        ("mariadb", mysql.DOUBLE(asdecimal=True), False),
        ("sqlite", sa.REAL(), False),
        ("postgresql", sa.Numeric(12, 2), False),
        ("mssql", mssql.DATETIME2(), True),
        ("mssql", mssql.DATETIME2(precision=7), True),
        ("mssql", mssql.DATETIME2(precision=6), False),
        ("mssql", mssql.DATETIMEOFFSET(precision=3), False),
        ("postgresql", sa.DateTime(timezone=True), False),
    ],
)
def test_lossy_type_table(dialect: str, type_: sa.types.TypeEngine[Any], lossy: bool) -> None:
    assert (lossy_type_reason(dialect, type_) is not None) is lossy


# --- 2. a cursor whose type changed under the checkpoint ---------------------------------


def test_timestamp_to_timestamptz_under_a_checkpoint_is_refused(
    pg: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = pg.qualified("ev")
    pg.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY, updated_at timestamp NOT NULL)")
    pg.execute(
        f"INSERT INTO {table} VALUES (:i, TIMESTAMP '2024-01-01 10:00:00' + :i * INTERVAL '1 h')",
        [{"i": i} for i in range(4)],
    )
    seen = drain(source(pg, "ev", cursor_column="updated_at", pk_columns=["id"]), tmp_path)
    assert len(seen) == 4
    pg.execute(f"ALTER TABLE {table} ALTER COLUMN updated_at TYPE timestamptz")
    pg.execute(f"INSERT INTO {table} VALUES (9, now())")
    # The next process reflects the new type and must refuse the old checkpoint.
    restarted = source(pg, "ev", cursor_column="updated_at", pk_columns=["id"])
    trigger = PollTrigger(
        name="safety", source=restarted, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    with pytest.raises(SourceDefinitionError) as info:
        trigger.tick(lambda batch: None)
    message = str(info.value)
    assert "'updated_at'" in message
    assert "timestamp (without time zone)" in message  # the checkpoint's (old) kind
    assert "TIMESTAMP WITH TIME ZONE" in message  # the column's new type
    assert "dbtrigger reset" in message
    assert "--kind timestamp" in message
    # The documented fix: re-enter the checkpoint in the new type, then polling resumes.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # reset saves a backup of the old document here
    code = cli_main(
        [
            "reset",
            "safety",
            "--to-cursor",
            "2024-01-01T13:00:00+00:00",
            "--pk",
            "id=3",
            "--kind",
            "timestamp",
            "--reason",
            "updated_at became timestamptz",
            "--yes",
            "--store",
            str(tmp_path),
        ]
    )
    assert code == 0
    seen = []
    trigger = PollTrigger(
        name="safety", source=restarted, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    trigger.tick(seen.extend)
    assert [e.pk["id"] for e in seen] == [9]


def test_int_to_text_under_a_checkpoint_is_refused(db: TestDatabase, tmp_path: Path) -> None:
    table = db.qualified("seq")
    db.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY, n BIGINT NOT NULL)")
    db.execute(f"INSERT INTO {table} VALUES (:i, :i)", [{"i": i} for i in range(1, 6)])
    seen = drain(source(db, "seq", cursor_column="n", pk_columns=["id"]), tmp_path)
    assert len(seen) == 5
    if db.kind == "sqlite":  # no ALTER COLUMN TYPE: rebuild the table as migrations do
        db.execute("ALTER TABLE seq RENAME TO seq_old")
        db.execute("CREATE TABLE seq (id INT PRIMARY KEY, n TEXT NOT NULL)")
        db.execute("INSERT INTO seq SELECT id, CAST(n AS TEXT) FROM seq_old")
    elif db.kind == "postgresql":
        db.execute(f"ALTER TABLE {table} ALTER COLUMN n TYPE text")
    else:
        db.execute(f"ALTER TABLE {table} MODIFY n VARCHAR(20) NOT NULL")
    db.execute(f"INSERT INTO {table} VALUES (10, '10')")
    restarted = source(db, "seq", cursor_column="n", pk_columns=["id"])
    trigger = PollTrigger(
        name="safety", source=restarted, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    with pytest.raises(SourceDefinitionError, match=r"integer value for cursor column 'n'"):
        trigger.tick(lambda batch: None)


def test_query_mode_learns_the_kind_from_a_row(db: TestDatabase) -> None:
    table = db.qualified("q")
    db.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY, n VARCHAR(20) NOT NULL)")
    db.execute(f"INSERT INTO {table} VALUES (1, 'a'), (2, 'b')")
    polled = SqlAlchemySource(
        url=db.url, query=f"SELECT id, n FROM {table}", cursor_column="n", pk_columns=["id"]
    )
    assert polled.cursor_kind() == "str"
    assert [r["id"] for r in polled.fetch(Position("a", {"id": 1}), 5)] == [2]
    with pytest.raises(SourceDefinitionError, match="integer value for cursor column 'n'"):
        polled.fetch(Position(5, {"id": 1}), 5)


def test_cursor_kind_comes_from_the_declared_type(db: TestDatabase) -> None:
    db.execute(
        f"CREATE TABLE {db.qualified('k')} (id BIGINT PRIMARY KEY, at DATE NOT NULL, "
        "amount NUMERIC(12, 2) NOT NULL, label VARCHAR(5) NOT NULL)"
    )
    kinds = {
        col: source(db, "k", cursor_column=col, pk_columns=["id"]).cursor_kind()
        for col in ("at", "amount", "label", "id")
    }
    at_kind = "str" if db.kind == "sqlite" else "date"  # SQLite dates are compared as text
    assert kinds == {"at": at_kind, "amount": "decimal", "label": "str", "id": "int"}


def test_kind_table() -> None:
    assert kinds_for_type("postgresql", sa.DateTime(timezone=True)) == {"timestamp"}
    assert kinds_for_type("postgresql", sa.DateTime()) == {"naive_timestamp"}
    assert kinds_for_type("mariadb", mysql.TIMESTAMP()) == {"naive_timestamp"}
    assert kinds_for_type("postgresql", sa.BigInteger()) == {"int", "decimal", "float"}
    assert kinds_for_type("postgresql", postgresql.INTERVAL()) is None  # unknown: sampled


# --- 4. key columns that are not unique; cursor = key -------------------------------------


def test_cursor_equal_to_the_key_is_accepted_end_to_end(db: TestDatabase, tmp_path: Path) -> None:
    table = db.qualified("log")
    db.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY, body VARCHAR(10) NOT NULL)")
    db.execute(f"INSERT INTO {table} VALUES (:i, 'x')", [{"i": i} for i in range(1, 8)])
    polled = source(db, "log", cursor_column="id", pk_columns=["id"])
    seen = drain(polled, tmp_path, batch=3)
    assert [e.pk["id"] for e in seen] == list(range(1, 8))
    assert [e.cursor for e in seen] == list(range(1, 8))
    db.execute(f"INSERT INTO {table} VALUES (8, 'y'), (9, 'z')")
    more = drain(source(db, "log", cursor_column="id", pk_columns=["id"]), tmp_path, batch=3)
    assert [e.pk["id"] for e in more] == [8, 9]


def test_non_unique_pk_columns_are_refused(db: TestDatabase) -> None:
    db.execute(
        f"CREATE TABLE {db.qualified('dup')} (id INT NOT NULL, line INT NOT NULL, "
        "at INT NOT NULL, PRIMARY KEY (id, line))"
    )
    polled = source(db, "dup", cursor_column="at", pk_columns=["id"])
    with pytest.raises(SourceDefinitionError, match=r"\[id\].*not proven unique") as info:
        polled.fetch(BEGINNING, 5)
    assert "['id', 'line']" in str(info.value)  # says what is declared unique


def test_table_without_any_key_is_refused(db: TestDatabase) -> None:
    db.execute(f"CREATE TABLE {db.qualified('nokey')} (id INT NOT NULL, at INT NOT NULL)")
    with pytest.raises(SourceDefinitionError, match="not proven unique"):
        source(db, "nokey", cursor_column="at", pk_columns=["id"]).fetch(BEGINNING, 5)


def test_unique_keys_that_prove_the_position(db: TestDatabase) -> None:
    """A unique index on (cursor, id), or a primary key within a composite pk, is proof."""
    db.execute(
        f"CREATE TABLE {db.qualified('u1')} (id INT NOT NULL, at INT NOT NULL, UNIQUE (at, id))"
    )
    db.execute(
        f"CREATE TABLE {db.qualified('u2')} (region CHAR(2) NOT NULL, id INT PRIMARY KEY, "
        "at INT NOT NULL)"
    )
    db.execute(f"CREATE TABLE {db.qualified('u3')} (id INT NOT NULL, at INT NOT NULL)")
    db.execute(f"CREATE UNIQUE INDEX u3_id ON {db.qualified('u3')} (id)")
    assert source(db, "u1", cursor_column="at", pk_columns=["id"]).fetch(BEGINNING, 1) == []
    assert (
        source(db, "u2", cursor_column="at", pk_columns=["region", "id"]).fetch(BEGINNING, 1) == []
    )
    assert source(db, "u3", cursor_column="at", pk_columns=["id"]).fetch(BEGINNING, 1) == []


@pytest.mark.parametrize("fixture", ["sqlite_db", "pg"])  # MariaDB has no partial indexes
def test_partial_unique_index_is_not_proof(fixture: str, request: pytest.FixtureRequest) -> None:
    db: TestDatabase = request.getfixturevalue(fixture)
    db.execute(f"CREATE TABLE {db.qualified('p')} (id INT NOT NULL, at INT NOT NULL)")
    db.execute(f"CREATE UNIQUE INDEX p_id ON {db.qualified('p')} (id) WHERE at > 0")
    with pytest.raises(SourceDefinitionError, match="not proven unique"):
        source(db, "p", cursor_column="at", pk_columns=["id"]).fetch(BEGINNING, 1)


def test_a_view_is_polled_with_a_loud_warning(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    db.execute(f"CREATE TABLE {db.qualified('base')} (id INT PRIMARY KEY, at INT NOT NULL)")
    db.execute(f"INSERT INTO {db.qualified('base')} VALUES (1, 1), (2, 2)")
    db.execute(f"CREATE VIEW {db.qualified('v')} AS SELECT id, at FROM {db.qualified('base')}")
    with caplog.at_level(logging.WARNING, logger="dbtrigger.sources"):
        rows = source(db, "v", cursor_column="at", pk_columns=["id"]).fetch(BEGINNING, 5)
    assert [r["id"] for r in rows] == [1, 2]
    warned = [r for r in caplog.records if getattr(r, "event", "") == "unverified_unique_key"]
    assert warned
    assert "is a view" in warned[0].getMessage()


def test_unique_key_problem_table() -> None:
    assert unique_key_problem([("id",)], "at", ["id"]) is None
    assert unique_key_problem([("at", "id")], "at", ["id"]) is None
    assert unique_key_problem([("id",)], "id", ["id"]) is None
    assert unique_key_problem([("id", "line")], "at", ["id"]) is not None
    assert unique_key_problem([], "at", ["id"]) is not None


# --- 11. source errors: operator errors vs retryable ones ---------------------------------


def keyed(db: TestDatabase, name: str = "t") -> SqlAlchemySource:
    db.execute(f"CREATE TABLE {db.qualified(name)} (id INT PRIMARY KEY, at INT NOT NULL)")
    db.execute(f"INSERT INTO {db.qualified(name)} VALUES (1, 1)")
    return source(db, name, cursor_column="at", pk_columns=["id"])


def test_table_dropped_under_a_running_source_is_a_definition_error(db: TestDatabase) -> None:
    polled = keyed(db)
    assert len(polled.fetch(BEGINNING, 5)) == 1  # reflected while the table existed
    db.execute(f"DROP TABLE {db.qualified('t')}")
    with pytest.raises(SourceDefinitionError, match="retrying cannot help"):
        polled.fetch(BEGINNING, 5)


def test_unknown_column_in_where_is_a_definition_error(db: TestDatabase) -> None:
    keyed(db)
    polled = source(db, "t", cursor_column="at", pk_columns=["id"], where="nope = 1")
    with pytest.raises(SourceDefinitionError) as info:
        polled.fetch(BEGINNING, 5)
    assert not isinstance(info.value, RetryableError)


def test_missing_database_is_a_definition_error(db: TestDatabase, tmp_path: Path) -> None:
    if db.kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"
    else:
        url = sa.make_url(db.url).set(database="dbtrigger_no_such_db").render_as_string(False)
    polled = SqlAlchemySource(url=url, table="t", cursor_column="at", pk_columns=["id"])
    with pytest.raises(SourceDefinitionError):
        polled.fetch(BEGINNING, 5)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_connection_refused_stays_retryable(kind: str) -> None:
    port, scheme = (5, "postgresql+psycopg") if kind == "postgresql" else (7, "mysql+pymysql")
    url = f"{scheme}://nobody@127.0.0.1:{port}/x"  # a closed port: nothing listens there
    polled = SqlAlchemySource(url=url, table="t", cursor_column="at", pk_columns=["id"])
    with pytest.raises(FetchError):
        polled.fetch(BEGINNING, 5)


def test_missing_privilege_on_postgresql_is_a_permission_error(pg: TestDatabase) -> None:
    keyed(pg)
    role = f"dbt_noperm_{uuid.uuid4().hex[:8]}"
    pg.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        url = sa.make_url(pg.url).set(username=role).render_as_string(False)
        polled = SqlAlchemySource(
            url=url, table="t", schema=pg.schema, cursor_column="at", pk_columns=["id"]
        )
        with pytest.raises(SourcePermissionError, match="permission denied"):
            polled.fetch(BEGINNING, 5)
        polled.close()
    finally:
        pg.execute(f'DROP OWNED BY "{role}"')
        pg.execute(f'DROP ROLE "{role}"')


def test_missing_privilege_on_mariadb_is_a_permission_error(mariadb: TestDatabase) -> None:
    keyed(mariadb)
    user = f"dbt_np_{uuid.uuid4().hex[:8]}"
    mariadb.execute(f"CREATE USER '{user}'@'%'")
    mariadb.execute(f"CREATE USER '{user}'@'localhost'")
    try:
        url = sa.make_url(mariadb.url).set(username=user, database=mariadb.schema)
        polled = SqlAlchemySource(
            url=url.render_as_string(False), table="t", cursor_column="at", pk_columns=["id"]
        )
        with pytest.raises(SourcePermissionError, match="denied"):
            polled.fetch(BEGINNING, 5)
        polled.close()
    finally:
        mariadb.execute(f"DROP USER '{user}'@'%'")
        mariadb.execute(f"DROP USER '{user}'@'localhost'")


@pytest.mark.parametrize("value", ["infinity", "0044-03-15 BC"])
def test_values_the_driver_cannot_load_are_serialization_errors(
    pg: TestDatabase, value: str, tmp_path: Path
) -> None:
    table = pg.qualified("ts")
    pg.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY, at timestamptz NOT NULL)")
    pg.execute(f"INSERT INTO {table} VALUES (1, now() - interval '1 day'), (2, :v)", {"v": value})
    trigger = PollTrigger(
        name="bad",
        source=source(pg, "ts", cursor_column="at", pk_columns=["id"], visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path),
    )
    with pytest.raises(SerializationError, match="cannot be converted"):
        trigger.tick(lambda batch: None)


def test_classification_table() -> None:
    class FakePg(Exception):
        __module__ = "psycopg.errors"

        def __init__(self, sqlstate: str | None, text: str = "x") -> None:
            super().__init__(text)
            self.sqlstate = sqlstate

    def wrapped(orig: Exception, cls: type[sa.exc.DBAPIError] = sa.exc.OperationalError) -> Any:
        return cls("SELECT 1", {}, orig)

    assert classify(wrapped(FakePg("08006"))) == "retry"
    assert classify(wrapped(FakePg("40001"))) == "retry"  # serialization failure
    assert classify(wrapped(FakePg("57014"))) == "retry"  # statement timeout
    assert classify(wrapped(FakePg("0A000"))) == "retry"  # cached plan after ALTER
    assert classify(wrapped(FakePg("42P01"))) == "definition"
    assert classify(wrapped(FakePg("42501"))) == "permission"
    assert classify(wrapped(FakePg("22P02"))) == "data"
    assert classify(wrapped(FakePg(None, 'FATAL:  database "x" does not exist'))) == "definition"
    assert classify(wrapped(FakePg(None, "password authentication failed for"))) == "permission"
    assert classify(wrapped(FakePg(None, "server closed the connection"))) == "retry"
    assert classify(wrapped(ValueError("?"), sa.exc.ProgrammingError)) == "definition"
    assert classify(sa.exc.TimeoutError("pool exhausted")) == "retry"


# --- 5. the fingerprint ignores how the database is reached --------------------------------


def fp(**overrides: Any) -> SqlAlchemySource:
    kwargs: dict[str, Any] = {
        "url": "postgresql+psycopg://app:pw@db.example:5432/shop?sslmode=require",
        "table": "orders",
        "schema": "sales",
        "cursor_column": "updated_at",
        "pk_columns": ["id"],
        "where": "status = :s",
        "parameters": {"s": "paid"},
    }
    return SqlAlchemySource(**(kwargs | overrides))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("postgresql+psycopg://app@db/shop", "postgresql+psycopg://app@db/shop?sslmode=require"),
        ("postgresql+psycopg://app@db/shop", "postgresql+psycopg://app@db:5432/shop"),
        ("postgresql+psycopg://app@localhost/shop", "postgresql+psycopg://app@127.0.0.1/shop"),
        ("postgresql://app@db/shop", "postgresql+psycopg://app@db/shop"),
        ("postgresql+psycopg://app:old@db/shop", "postgresql+psycopg://app:rotated@db/shop"),
        ("postgresql+psycopg://app@DB/shop", "postgresql+psycopg://app@db/shop?connect_timeout=5"),
        ("mysql+pymysql://root@127.0.0.1:3306/shop", "mysql://root@localhost/shop?charset=utf8mb4"),
    ],
)
def test_connection_only_differences_keep_the_fingerprint(a: str, b: str) -> None:
    assert fp(url=a, schema=None).fingerprint() == fp(url=b, schema=None).fingerprint()


def test_default_schema_spelled_out_keeps_the_fingerprint() -> None:
    pg_url = "postgresql+psycopg://app@db/shop"
    assert (
        fp(url=pg_url, schema="public").fingerprint() == fp(url=pg_url, schema=None).fingerprint()
    )
    my_url = "mysql+pymysql://root@db/shop"
    assert fp(url=my_url, schema="shop").fingerprint() == fp(url=my_url, schema=None).fingerprint()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app@other-host/shop?sslmode=require",
        "postgresql+psycopg://app@db.example:6432/shop",  # another server on another port
        "postgresql+psycopg://app@db.example/other_db",
        "postgresql+psycopg://app@db.example/shop?options=-csearch_path%3Dother",
        "mysql+pymysql://app@db.example/shop",
    ],
)
def test_what_is_read_still_changes_the_fingerprint(url: str) -> None:
    assert fp(url=url).fingerprint() != fp().fingerprint()


def test_fingerprint_has_no_secret_and_a_version() -> None:
    source_ = fp(url="postgresql+psycopg://app:s3cr3t@db/shop?password=qpw&sslkey=/k")
    assert "s3cr3t" not in source_.fingerprint()
    rotated = fp(url="postgresql+psycopg://app:r0tated-pw@db/shop?password=r0tated-qpw&sslkey=/k2")
    assert rotated.fingerprint() == source_.fingerprint()


def test_documents_written_by_the_previous_algorithm_are_still_accepted() -> None:
    """The value below is what the previous release wrote for this definition."""
    accepted = fp().accepted_fingerprints()
    assert accepted[0] == fp().fingerprint()
    assert accepted[1] == "sha256:e067a357b0e9e645c59eb3c21170f77a6bad9b9da838200201365035f52b7be2"
    assert accepted[0] != accepted[1]
