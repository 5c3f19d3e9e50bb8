from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from dbtrigger import SqlAlchemySource
from tests.azurite import Azurite, start_azurite
from tests.cdc_servers import (
    BinlogDatabase,
    BinlogMariadb,
    CdcDatabase,
    LogicalPostgres,
    binlog_database,
    cdc_database,
    start_binlog_mariadb,
    start_logical_postgres,
)
from tests.databases import TestDatabase, drop_session_databases, make_database

DB_KINDS = ["sqlite", "postgresql", "mariadb"]

# Property tests count examples, never time: no per-example deadline and no "too slow"
# health check, which a loaded machine (a CI run beside other work) fails on its own.
# A test's own @settings(...) keeps these for what it does not set.
settings.register_profile("dbtrigger", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("dbtrigger")


def _marks(kind: str) -> list[pytest.MarkDecorator]:
    return [getattr(pytest.mark, kind)] if kind in ("postgresql", "mariadb") else []


@pytest.fixture(params=[pytest.param(k, marks=_marks(k)) for k in DB_KINDS])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    """An isolated schema on each of SQLite, PostgreSQL and MariaDB."""
    yield from make_database(request.param, tmp_path)


@pytest.fixture(params=[pytest.param(k, marks=_marks(k)) for k in ("postgresql", "mariadb")])
def server_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    """An isolated schema on PostgreSQL and on MariaDB: the servers, for behaviour
    SQLite cannot show (several sessions reading and writing at once)."""
    yield from make_database(request.param, tmp_path)


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[TestDatabase]:
    yield from make_database("postgresql", tmp_path)


@pytest.fixture
def mariadb(tmp_path: Path) -> Iterator[TestDatabase]:
    yield from make_database("mariadb", tmp_path)


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[TestDatabase]:
    yield from make_database("sqlite", tmp_path)


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    """A running Azurite (blob, queue, table) on free loopback ports."""
    yield from start_azurite()


@pytest.fixture(autouse=True)
def _close_sources(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Dispose the engine of every SqlAlchemySource a test created.

    Sources own their connection pools for the life of a process; a test is a
    much shorter life, and a pool left for the garbage collector would surface
    as a ResourceWarning in some later test.
    """
    created: list[SqlAlchemySource] = []
    original = SqlAlchemySource.__init__

    def tracking_init(self: SqlAlchemySource, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(SqlAlchemySource, "__init__", tracking_init)
    yield
    for source in created:
        source.close()


@pytest.fixture(scope="session", autouse=True)
def _drop_session_databases() -> Iterator[None]:
    yield
    drop_session_databases()


@pytest.fixture(scope="session")
def logical_pg() -> Iterator[LogicalPostgres]:
    """A private PostgreSQL with wal_level=logical (tests/cdc_servers.py), once per session."""
    yield from start_logical_postgres()


@pytest.fixture
def cdc_db(logical_pg: LogicalPostgres) -> Iterator[CdcDatabase]:
    """A database of this test's own on the private logical-decoding server."""
    yield from cdc_database(logical_pg)


@pytest.fixture(scope="session")
def binlog_mariadb() -> Iterator[BinlogMariadb]:
    """A private MariaDB with a ROW binary log (tests/cdc_servers.py), once per session."""
    yield from start_binlog_mariadb()


@pytest.fixture
def binlog_db(binlog_mariadb: BinlogMariadb) -> Iterator[BinlogDatabase]:
    """A database of this test's own on the private binlog server."""
    yield from binlog_database(binlog_mariadb)


# --- parallel runs (pytest-xdist) ---------------------------------------------------------

#: Test files whose pollers wait on a horizon shared beyond their own database: MariaDB's
#: transaction horizon is server-wide and PostgreSQL's snapshot (xid) horizon cluster-wide.
HORIZON_FILES = (
    "test_visibility.py",
    "test_visibility_mariadb.py",
    "test_visibility_cache.py",
    "test_runtime_visibility.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist names each item's group from its marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n N --dist loadgroup`` the tests that share a horizon run on one worker.

    Each worker has its own PostgreSQL database and Azurite, but there is one MariaDB
    server and one PostgreSQL cluster: a test holding a writer open on purpose would
    hold back a guarded poller of a test running beside it on another worker. Kept on
    one worker they run one after another, as in a serial run; the rest spread freely.
    """
    group = pytest.mark.xdist_group("shared-horizons")
    for item in items:
        if (
            item.get_closest_marker("mariadb") is not None
            or "mariadb" in item.nodeid.lower()
            # A test (or a fixture it uses) asking for the mariadb fixture by name.
            or "mariadb" in getattr(item, "fixturenames", ())
            or item.path.name in HORIZON_FILES
        ):
            item.add_marker(group)
