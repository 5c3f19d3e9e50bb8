from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.azurite import Azurite, start_azurite
from tests.databases import TestDatabase, make_database

DB_KINDS = ["sqlite", "postgresql", "mariadb"]


def _marks(kind: str) -> list[pytest.MarkDecorator]:
    return [getattr(pytest.mark, kind)] if kind in ("postgresql", "mariadb") else []


@pytest.fixture(params=[pytest.param(k, marks=_marks(k)) for k in DB_KINDS])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    """An isolated schema on each of SQLite, PostgreSQL and MariaDB."""
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
