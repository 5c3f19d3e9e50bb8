"""Driver failures that are not DB-API errors, or that look transient and are not.

* A PostgreSQL database in ``SQL_ASCII``: psycopg returns its text as bytes and
  SQLAlchemy's dialect fails on the first connection with a bare ``TypeError``
  (it escaped a tick as a raw exception). It is an operator error naming the
  fix, from the source and from a SQL checkpoint store on that database; with
  ``client_encoding=utf8`` in the URL the same database is polled, and a row
  holding bytes that are not UTF-8 is refused as data.
* SQLite text that is not UTF-8 makes the driver raise ``OperationalError``,
  which was retried as a transient failure on every tick for ever; it is a
  value in the source, refused as such.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import (
    InMemoryCheckpointStore,
    PollTrigger,
    SerializationError,
    SqlAlchemySource,
    SqlCheckpointStore,
)
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import DbTriggerError, FetchError, SourceDefinitionError, StoreRefusedError
from tests.databases import SESSION_DB_PREFIX, TestDatabase, admin_engine


@pytest.fixture
def ascii_url() -> Iterator[str]:
    """A database of its own in SQL_ASCII (named like this session's, so a crashed
    session's leftover is dropped by the next one), with a table of three rows."""
    admin = admin_engine("postgresql")
    name = f"{SESSION_DB_PREFIX}{os.getpid()}_ascii_{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(
            sa.text(
                f"CREATE DATABASE \"{name}\" ENCODING 'SQL_ASCII' TEMPLATE template0 "
                "LC_COLLATE 'C' LC_CTYPE 'C'"
            )
        )
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    # Rows written as a SQL_ASCII client would: the bytes are stored as they come.
    setup = sa.create_engine(url, connect_args={"client_encoding": "utf8"})
    try:
        with setup.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE TABLE orders (id int PRIMARY KEY, updated_at timestamptz NOT NULL "
                    "DEFAULT now(), note text)"
                )
            )
            conn.execute(sa.text("INSERT INTO orders (id, note) VALUES (1, 'plain'), (2, 'café')"))
        setup.dispose()
        yield url
    finally:
        setup.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def orders(url: str) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=url, table="orders", cursor_column="updated_at", pk_columns=["id"], visibility="none"
    )


@pytest.mark.postgresql
def test_a_sql_ascii_database_is_an_operator_error_naming_the_fix(ascii_url: str) -> None:
    source = orders(ascii_url)
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())
    try:
        with pytest.raises(SourceDefinitionError) as caught:
            trigger.tick(lambda events: None)
        message = str(caught.value)
        assert "SQL_ASCII" in message
        assert "client_encoding=utf8" in message
        # The start-up check says the same (it is where an operator may read it first).
        with pytest.raises(SourceDefinitionError, match="SQL_ASCII"):
            source.validate()
    finally:
        source.close()
    store = SqlCheckpointStore(url=ascii_url)
    try:
        with pytest.raises(StoreRefusedError, match="SQL_ASCII"):
            store.read("orders")
    finally:
        store.close()


@pytest.mark.postgresql
def test_with_client_encoding_utf8_it_is_polled_and_other_bytes_are_data(ascii_url: str) -> None:
    url = sa.make_url(ascii_url).update_query_dict({"client_encoding": "utf8"})
    source = orders(url.render_as_string(hide_password=False))
    got: list[tuple[int, str]] = []
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())
    try:
        trigger.tick(lambda events: got.extend((e.pk["id"], e.after["note"]) for e in events))
        assert got == [(1, "plain"), (2, "café")]
        with source.engine.begin() as conn:  # Latin-1 bytes: not UTF-8
            conn.execute(sa.text("INSERT INTO orders (id, note) VALUES (3, E'caf\\351')"))
        with pytest.raises(SerializationError, match="UTF8"):
            source.fetch(BEGINNING, 10)
    finally:
        source.close()


def test_sqlite_text_that_is_not_utf8_is_a_value_not_a_hiccup(tmp_path: Path) -> None:
    path = tmp_path / "source.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, note TEXT)")
    raw.execute("INSERT INTO orders VALUES (1, 1, 'ok'), (2, 2, CAST(X'636166E9' AS TEXT))")
    raw.commit()
    raw.close()
    source = SqlAlchemySource(
        url=f"sqlite:///{path}", table="orders", cursor_column="seq", pk_columns=["id"]
    )
    try:
        with pytest.raises(DbTriggerError) as caught:
            source.fetch(BEGINNING, 10)
        assert isinstance(caught.value, SerializationError), repr(caught.value)
        assert not isinstance(caught.value, FetchError)  # not retried as a hiccup
        assert "note" in str(caught.value)
    finally:
        source.close()


def test_a_cursor_column_that_cannot_be_ordered_says_so(pg: TestDatabase) -> None:
    """A jsonb cursor failed the first tick with "the checkpoint's cursor type does not
    match the column", when there was no checkpoint yet: it blamed the wrong thing."""
    pg.execute(f"CREATE TABLE {pg.schema}.docs (id INTEGER PRIMARY KEY, body JSONB NOT NULL)")
    pg.execute(f"INSERT INTO {pg.schema}.docs VALUES (1, '{{}}')")
    source = SqlAlchemySource(
        url=pg.url, schema=pg.schema, table="docs", cursor_column="body", pk_columns=["id"]
    )
    try:
        trigger = PollTrigger(
            name="docs", source=source, checkpoint_store=InMemoryCheckpointStore()
        )
        with pytest.raises(SourceDefinitionError, match="cannot be ordered") as err:
            trigger.tick(lambda events: None)
        assert "poll a timestamp, number or text column" in str(err.value)
    finally:
        source.close()
