"""A role refused the DDL a CDC source runs (its control table, the publication) is
told the server's reason and the advice for that statement, never the general
"grant CONNECT, USAGE on the schema, SELECT on the table" of a refused read.

PostgreSQL's refusals went through the general driver mapping, whose advice was
appended after the server's reason: for a CREATE TABLE or an ALTER it named the
wrong privileges. MariaDB's control table refusals (create, upgrade) dropped the
server's reason altogether.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pymysql
import pytest
import sqlalchemy as sa

from dbtrigger.cdc import binlog_control, pg_control
from dbtrigger.cdc.pg_setup import TableName, drop_publication, ensure_publication
from dbtrigger.errors import SourcePermissionError
from tests.databases import TestDatabase

READ_ADVICE = "SELECT on the table"


@pytest.fixture
def pg_role(pg: TestDatabase) -> Iterator[psycopg.Connection]:
    """A session of a role that may use ``pg.schema`` but create nothing in it."""
    role = f"r_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {pg.schema} TO {role}")
    url = sa.make_url(pg.url)
    conn = psycopg.connect(
        host=url.host, port=url.port, user=role, dbname=url.database, autocommit=True
    )
    try:
        yield conn
    finally:
        conn.close()
        pg.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


@pytest.mark.postgresql
def test_postgresql_control_table_and_publication_refusals(
    pg: TestDatabase, pg_role: psycopg.Connection
) -> None:
    with pytest.raises(SourcePermissionError) as created:
        pg_control.ensure(pg_role, pg.schema)
    text = str(created.value)
    assert "permission denied for schema" in text, text  # the server's reason
    assert f"GRANT CREATE ON SCHEMA {pg.schema} TO this role" in text, text
    assert READ_ADVICE not in text, text

    # A control table an earlier dbtrigger made (no released_lsn), owned by another role.
    with psycopg.connect(
        sa.make_url(pg.url)
        .render_as_string(hide_password=False)
        .replace("postgresql+psycopg", "postgresql"),
        autocommit=True,
    ) as admin:
        admin.execute(pg_control.create_sql(pg.schema))
        admin.execute(
            f"ALTER TABLE {pg.schema}.{pg_control.TABLE} DROP COLUMN released_lsn;"
            f"CREATE TABLE {pg.schema}.t (id int PRIMARY KEY)"
        )
    with pytest.raises(SourcePermissionError) as altered:
        pg_control.ensure(pg_role, pg.schema)
    text = str(altered.value)
    assert "must be owner of table" in text, text
    assert "Have its owner run: ALTER TABLE" in text, text
    assert READ_ADVICE not in text, text

    with pytest.raises(SourcePermissionError) as published:
        ensure_publication(pg_role, "p_refused", [TableName(pg.schema, "t")], create=True)
    text = str(published.value)
    assert "have an owner run: CREATE PUBLICATION" in text, text
    assert READ_ADVICE not in text, text


@pytest.fixture
def mariadb_user(mariadb: TestDatabase) -> Iterator[pymysql.Connection]:
    """A session of a user that may read ``mariadb.schema`` but not create nor alter."""
    user, secret = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    mariadb.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{secret}'")
    mariadb.execute(f"GRANT SELECT ON `{mariadb.schema}`.* TO '{user}'@'%'")
    url = sa.make_url(mariadb.url)
    conn = pymysql.connect(
        host=url.host, port=url.port or 3306, user=user, password=secret, database=mariadb.schema
    )
    try:
        yield conn
    finally:
        conn.close()
        mariadb.execute(f"DROP USER '{user}'@'%'")


@pytest.mark.mariadb
def test_mariadb_control_table_refusals_give_the_servers_reason(
    mariadb: TestDatabase, mariadb_user: pymysql.Connection
) -> None:
    database = str(mariadb.schema)
    with pytest.raises(SourcePermissionError) as created:
        binlog_control.ensure(mariadb_user, database)
    text = str(created.value)
    assert "CREATE command denied" in text, text  # the server's reason
    assert "GRANT CREATE, SELECT, INSERT, UPDATE, DELETE" in text, text

    for statement in binlog_control.create_sql(database):  # made by an earlier version
        mariadb.execute(statement)
    mariadb.execute(f"ALTER TABLE `{database}`.`{binlog_control.TABLE}` DROP COLUMN generation")
    with pytest.raises(SourcePermissionError) as altered:
        binlog_control.ensure(mariadb_user, database)
    text = str(altered.value)
    assert "ALTER command denied" in text, text
    assert f"GRANT ALTER ON `{database}`.*" in text, text


@pytest.mark.postgresql
def test_postgresql_control_row_writes_and_publication_drop_name_their_grant(
    pg: TestDatabase, pg_role: psycopg.Connection
) -> None:
    role = pg_role.info.user
    table = f"{pg.schema}.{pg_control.TABLE}"
    admin_url = sa.make_url(pg.url).set(drivername="postgresql")
    with psycopg.connect(admin_url.render_as_string(hide_password=False), autocommit=True) as admin:
        admin.execute(pg_control.create_sql(pg.schema))
        admin.execute(f"INSERT INTO {table} (slot, tables) VALUES ('s', '{{}}')")
        admin.execute(f"GRANT SELECT ON {table} TO {role}")  # reads, may not write
        admin.execute(f"CREATE TABLE {pg.schema}.t (id int PRIMARY KEY)")
        admin.execute(f"CREATE PUBLICATION p_{role} FOR TABLE {pg.schema}.t")
    try:
        for write in (
            lambda: pg_control.save_bound(pg_role, pg.schema, "s", "0/10"),
            lambda: pg_control.delete(pg_role, pg.schema, "s"),
        ):
            with pytest.raises(SourcePermissionError) as refused:
                write()
            text = str(refused.value)
            assert "permission denied for table" in text, text
            assert f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table}" in text, text
            assert READ_ADVICE not in text, text
        with pytest.raises(SourcePermissionError) as dropping:
            drop_publication(pg_role, f"p_{role}")
        text = str(dropping.value)
        assert "must be owner of publication" in text, text
        assert f"DROP PUBLICATION p_{role}" in text, text
        assert READ_ADVICE not in text, text
    finally:
        pg.execute(f"DROP PUBLICATION IF EXISTS p_{role}")
