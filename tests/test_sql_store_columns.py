"""SqlCheckpointStore on a state table someone altered: a document the columns
cannot hold is refused, whole, never stored cut short.

A DBA "tidying" the schema (``document`` to ``TEXT`` on MariaDB, which stops at
64 KB, or to ``varchar(n)``) must not turn a growing document into an outage
retried for ever (a strict server's "data too long" read as unavailable) nor,
on a MariaDB/MySQL server without a strict ``sql_mode``, into a document stored
cut short that the next read finds corrupt, the poller stopped until a reset.
"""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa

from dbtrigger.errors import StoreRefusedError
from dbtrigger.state.stores import SqlCheckpointStore, StoredDocument
from tests.databases import TestDatabase, admin_engine

SMALL = b'{"a": 1}'
LARGE = json.dumps({"a": "x" * 300}).encode()


def _narrow_document_column(db: TestDatabase) -> None:
    table = db.qualified("dbtrigger_state")
    if db.kind == "postgresql":
        db.execute(f"ALTER TABLE {table} ALTER COLUMN document TYPE varchar(100)")
    else:
        db.execute(
            f"ALTER TABLE {table} MODIFY document VARCHAR(100) "
            "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        )


def test_a_document_the_altered_column_cannot_hold_is_refused_and_nothing_changes(
    server_db: TestDatabase,
) -> None:
    store = SqlCheckpointStore(url=server_db.url, schema=server_db.schema)
    try:
        etag = store.write("orders", SMALL, if_match=None)
        _narrow_document_column(server_db)
        # a refusal a person must act on (not an outage the runtime retries for ever)
        with pytest.raises(StoreRefusedError, match=r"document column .*ALTER TABLE") as caught:
            store.write("orders", LARGE, if_match=etag)
        assert "x" * 50 not in str(caught.value)  # the document is not echoed
        assert store.read("orders") == StoredDocument(SMALL, etag)
    finally:
        store.close()


def test_a_non_strict_mariadb_never_stores_a_document_cut_short(mariadb: TestDatabase) -> None:
    store = SqlCheckpointStore(
        url=mariadb.url,
        schema=mariadb.schema,
        # a server (or a session) without STRICT_TRANS_TABLES truncates with a warning
        engine_kwargs={"connect_args": {"init_command": "SET SESSION sql_mode=''"}},
    )
    try:
        etag = store.write("orders", SMALL, if_match=None)
        _narrow_document_column(mariadb)
        with pytest.raises(StoreRefusedError, match=r"document column .*ALTER TABLE"):
            store.write("orders", LARGE, if_match=etag)
        assert store.read("orders") == StoredDocument(SMALL, etag)
        with pytest.raises(StoreRefusedError, match="document column"):
            store.write("other", LARGE, if_match=None)  # a create is checked the same way
        assert store.read("other") is None
    finally:
        store.close()


@pytest.mark.parametrize("sql_mode", [None, ""])
def test_the_read_back_of_a_write_is_only_for_a_session_that_is_not_strict(
    mariadb: TestDatabase, sql_mode: str | None
) -> None:
    """A strict session (the servers' default) refuses what does not fit by itself:
    its commits pay no read-back, one question of the session's mode a connection."""
    connect = {} if sql_mode is None else {"init_command": f"SET SESSION sql_mode='{sql_mode}'"}
    store = SqlCheckpointStore(
        url=mariadb.url, schema=mariadb.schema, engine_kwargs={"connect_args": connect}
    )
    statements: list[str] = []
    try:
        etag = store.write("orders", SMALL, if_match=None)
        sa.event.listen(
            store._engine, "before_cursor_execute", lambda *a: statements.append(str(a[2]))
        )
        for _ in range(3):
            etag = store.write("orders", SMALL, if_match=etag)
    finally:
        store.close()
    read_backs = [s for s in statements if "length(" in s.lower()]
    assert len(read_backs) == (0 if sql_mode is None else 3)
    assert not [s for s in statements if "sql_mode" in s.lower()]  # asked once, before


@pytest.mark.parametrize("change", ["drop", "rename etag"])
def test_a_state_table_dropped_or_altered_while_running_is_refused_not_an_outage(
    db: TestDatabase, change: str
) -> None:
    """A running store made its table once; dropped or altered since, every read and
    write failed as StoreUnavailableError, an outage the runtime retried quietly for
    ever, while a restarted process finds no table and starts over from the beginning."""
    store = SqlCheckpointStore(url=db.url, schema=db.schema)
    try:
        etag = store.write("orders", SMALL, if_match=None)
        table = db.qualified("dbtrigger_state")
        if change == "drop":
            db.execute(f"DROP TABLE {table}")
        else:
            db.execute(f"ALTER TABLE {table} RENAME COLUMN etag TO etag_old")
        ops = [lambda: store.read("orders"), lambda: store.write("orders", LARGE, if_match=etag)]
        if change == "drop":
            ops.append(store.list_keys)  # (a listing reads no etag)
        for op in ops:
            with pytest.raises(StoreRefusedError, match=r"dropped or altered.*ddl\(\)"):
                op()
    finally:
        store.close()


WIDE = '{"k": "漢字"}'.encode()  # characters LATIN1 has no place for


def test_a_latin1_postgresql_database_refuses_a_character_it_cannot_hold(
    pg: TestDatabase,
) -> None:
    """psycopg encodes text for the database's encoding on the client: a checkpoint
    holding a character LATIN1 lacks escaped the store as a bare UnicodeEncodeError."""
    admin = admin_engine("postgresql")
    name = f"dbtrigger_latin1_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(
            sa.text(
                f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
                "TEMPLATE template0"
            )
        )
    url = admin.url.set(database=name)
    store = SqlCheckpointStore(url=url.render_as_string(False))
    # ...and with client_encoding=utf8 the server refuses it (22P05), not the client
    utf8 = SqlCheckpointStore(
        url=url.update_query_dict({"client_encoding": "utf8"}).render_as_string(False)
    )
    try:
        etag = store.write("orders", SMALL, if_match=None)
        for each in (store, utf8):
            with pytest.raises(StoreRefusedError, match=r"encoding.*UTF8"):
                each.write("orders", WIDE, if_match=etag)
        assert store.read("orders") == StoredDocument(SMALL, etag)
    finally:
        store.close()
        utf8.close()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))


@pytest.mark.parametrize("sql_mode", [None, ""])
def test_a_latin1_document_column_on_mariadb_refuses_what_it_cannot_hold(
    mariadb: TestDatabase, sql_mode: str | None
) -> None:
    connect = {} if sql_mode is None else {"init_command": f"SET SESSION sql_mode='{sql_mode}'"}
    store = SqlCheckpointStore(
        url=mariadb.url, schema=mariadb.schema, engine_kwargs={"connect_args": connect}
    )
    try:
        etag = store.write("orders", SMALL, if_match=None)
        mariadb.execute(
            f"ALTER TABLE {mariadb.qualified('dbtrigger_state')} MODIFY document LONGTEXT "
            "CHARACTER SET latin1 NOT NULL"
        )
        with pytest.raises(StoreRefusedError, match="document column"):
            store.write("orders", WIDE, if_match=etag)  # strict: 1366; else stored as '??'
        assert store.read("orders") == StoredDocument(SMALL, etag)
    finally:
        store.close()
