"""A CDC source's control-table DDL behind a lock fails the same way on both dialects.

Creating or upgrading the control table runs at a source's first read (and in the
admin commands). Behind a transaction open on the table it waits at most its bound,
then gives up: on MariaDB as a :class:`~dbtrigger.errors.FetchError`, on PostgreSQL
as a bare :class:`~dbtrigger.errors.RetryableError`. The contract's failure table
(§5.3, the source's read failed: the handler is not invoked, the next tick retries)
calls for ``FetchError``, a ``RetryableError`` too, so both raise it now. MariaDB's
words also said only "another session holds" it: they name the sessions now, as
PostgreSQL's do.
"""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from dbtrigger.cdc import binlog_control, pg_connection, pg_control
from dbtrigger.cdc.binlog_setup import connect
from dbtrigger.errors import FetchError
from tests.databases import TestDatabase
from tests.test_ddl_locks import holding, outcome
from tests.test_mariadb_mdl_holders import reading


@pytest.mark.postgresql
def test_postgresql_control_table_upgrade_behind_an_open_transaction_is_a_fetch_error(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_connection, "DDL_LOCK_TIMEOUT", 1.0)
    assert pg.schema is not None
    dsn = sa.make_url(pg.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pg_control.create_sql(pg.schema))
        table = f"{pg.schema}.{pg_control.TABLE}"
        conn.execute(f"ALTER TABLE {table} DROP COLUMN released_lsn")  # an earlier version's
        error = outcome(
            holding(pg, f"SELECT * FROM {table}"), lambda: pg_control.ensure(conn, pg.schema)
        )
        assert isinstance(error, FetchError), repr(error)
        message = str(error)
        assert "adding released_lsn to the control table waited 1 s for a lock" in message
        assert "held by backend pid" in message, message
        assert pg_control.ensure(conn, pg.schema) is False  # upgraded once it ended
        assert pg_control.has_bound(conn, pg.schema)


@pytest.mark.mariadb
@pytest.mark.xdist_group("shared-horizons")
def test_mariadb_control_table_upgrade_behind_a_reader_names_it(
    mariadb: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(binlog_control, "DDL_LOCK_WAIT_SECONDS", 1.0)
    db = mariadb
    assert db.schema is not None
    conn = connect(sa.make_url(db.url), database=False)
    try:
        binlog_control.ensure(conn, db.schema)
        with conn.cursor() as cur:  # a table made by a version before the marks
            cur.execute(f"ALTER TABLE {db.qualified(binlog_control.TABLE)} DROP COLUMN generation")
        ident: list[int] = []
        error = outcome(
            reading(db, binlog_control.TABLE, ident), lambda: binlog_control.ensure(conn, db.schema)
        )
        assert isinstance(error, FetchError), repr(error)
        message = str(error)
        assert f"adding columns to {db.schema}.{binlog_control.TABLE} waited 1 s" in message
        assert f"connection {ident[0]} (Sleep, transaction open for" in message, message
        assert "SELECT" not in message, message
        assert binlog_control.ensure(conn, db.schema) is False  # upgraded once it ended
    finally:
        conn.close()
