"""Real databases for tests: a fresh, throw-away schema per test.

PostgreSQL gets a schema per test inside a database of its own per test
*session*, MariaDB a database per test (MySQL's word for a schema), SQLite a
file in the test's tmp directory.

Why a PostgreSQL database per session: the default visibility guard waits for
every transaction open *in the same database* (a late commit could carry an
older cursor). Two test sessions sharing one database - two developers, or a
developer and CI - would hold each other's pollers back at random. A service that is not
reachable is a test *failure* with a message saying how to start it, never a
skip: integration tests that silently skip hide exactly the bugs they exist for.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

PG_ADMIN_URL = os.environ.get(
    "DBTRIGGER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_ADMIN_URL = os.environ.get(
    "DBTRIGGER_TEST_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)

START_HINTS = {
    "postgresql": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "mariadb": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
}

_admin_engines: dict[str, sa.Engine] = {}
_session_pg: dict[str, sa.Engine] = {}
SESSION_DB_PREFIX = "dbtrigger_s_"


def admin_engine(kind: str) -> sa.Engine:
    if kind not in _admin_engines:
        url = PG_ADMIN_URL if kind == "postgresql" else MARIADB_ADMIN_URL
        engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except sa.exc.OperationalError as exc:
            pytest.fail(
                f"{kind} is not reachable at {engine.url.render_as_string(hide_password=True)} "
                f"({exc.orig}); start it with: {START_HINTS[kind]}",
                pytrace=False,
            )
        _admin_engines[kind] = engine
    return _admin_engines[kind]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def session_pg_engine() -> sa.Engine:
    """An AUTOCOMMIT engine on this session's own PostgreSQL database (created once)."""
    if "engine" not in _session_pg:
        admin = admin_engine("postgresql")
        name = f"{SESSION_DB_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:6]}"
        with admin.connect() as conn:
            # Leftovers of sessions that died without cleaning up.
            for (old,) in conn.execute(
                sa.text("SELECT datname FROM pg_database WHERE datname LIKE :p"),
                {"p": f"{SESSION_DB_PREFIX}%"},
            ):
                pid = old[len(SESSION_DB_PREFIX) :].split("_")[0]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{old}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = admin.url.set(database=name)
        _session_pg["engine"] = sa.create_engine(
            url, isolation_level="AUTOCOMMIT", pool_pre_ping=True
        )
    return _session_pg["engine"]


def drop_session_databases() -> None:
    engine = _session_pg.pop("engine", None)
    if engine is None:
        return
    name = engine.url.database
    engine.dispose()
    with admin_engine("postgresql").connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@dataclass
class TestDatabase:
    """One isolated place to create tables: ``url`` + ``schema`` (None on SQLite)."""

    __test__ = False

    kind: str  # "sqlite", "postgresql", "mariadb"
    url: str
    schema: str | None
    engine: sa.Engine

    def qualified(self, table: str) -> str:
        return f"{self.schema}.{table}" if self.schema else table

    def execute(
        self, sql: str, params: dict[str, object] | list[dict[str, object]] | None = None
    ) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(sql), params or {})

    def scalar(self, sql: str, params: dict[str, object] | None = None) -> object:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params or {}).scalar()


def make_database(kind: str, tmp_path: Path) -> Iterator[TestDatabase]:
    """Yield an isolated database of ``kind``; drop it afterwards."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'source.db'}"
        engine = sa.create_engine(url)
        try:
            yield TestDatabase(kind, url, None, engine)
        finally:
            engine.dispose()
        return
    admin = session_pg_engine() if kind == "postgresql" else admin_engine(kind)
    name = f"t_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        if kind == "postgresql":
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
        else:
            conn.execute(sa.text(f"CREATE DATABASE `{name}`"))
    url = admin.url.render_as_string(hide_password=False)
    engine = sa.create_engine(url, pool_pre_ping=True)
    opened: list[Any] = []
    sa.event.listen(engine, "connect", lambda dbapi_connection, _: opened.append(dbapi_connection))
    try:
        yield TestDatabase(kind, url, name, engine)
    finally:
        engine.dispose()
        _close_leaked(opened)
        with admin.connect() as conn:
            if kind == "postgresql":
                conn.execute(sa.text(f'DROP SCHEMA "{name}" CASCADE'))
            else:
                # Bounded: a connection of another engine still holding a lock
                # on the database fails the teardown instead of hanging it (and,
                # with it, every MariaDB horizon on the server) for a day.
                conn.execute(
                    sa.text(
                        f"SET STATEMENT lock_wait_timeout=60 FOR DROP DATABASE IF EXISTS `{name}`"
                    )
                )


def _close_leaked(connections: list[Any]) -> None:
    """Close the driver connections a failed test left checked out of ``engine``.

    ``engine.dispose()`` closes only the pooled ones. A test that failed
    between ``begin()`` and ``commit()`` leaves its connection open, with a
    write transaction whose locks make the ``DROP`` below wait on the
    connection's own process; on MariaDB that open writer also holds every
    transaction horizon on the server back.
    """
    for connection in connections:
        with contextlib.suppress(Exception):  # closed already (by the pool), or broken
            connection.close()
