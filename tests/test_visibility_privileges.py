"""A guard that settles for less for want of a privilege says so, with the GRANT to run.

MariaDB without PROCESS: ``auto`` falls back from the exact transaction
horizon to a bounded window; PostgreSQL without ``pg_read_all_stats``: the
transaction horizon cannot see other roles' sessions. The worker logs it once
at WARNING when the guard is chosen, naming the GRANT for its own account,
and ``dbtrigger check`` reports it on both databases.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.checks import check_source
from dbtrigger.errors import ConfigurationError
from tests.databases import TestDatabase


def make_orders(db: TestDatabase) -> None:
    t = db.qualified("orders")
    if db.kind == "mariadb":
        db.execute(
            f"CREATE TABLE {t} (id INT PRIMARY KEY, "
            "updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) "
            "ON UPDATE CURRENT_TIMESTAMP(6), KEY ix (updated_at, id))"
        )
    else:
        db.execute(f"CREATE TABLE {t} (id INT PRIMARY KEY, updated_at timestamptz NOT NULL)")
    db.execute(f"INSERT INTO {t} (id, updated_at) VALUES (1, '2026-01-01 00:00:00')")


@pytest.fixture
def mariadb_account(mariadb: TestDatabase) -> Iterator[str]:
    """A URL for an account that may read the table but lacks PROCESS."""
    make_orders(mariadb)
    user = f"dbt_vp_{uuid.uuid4().hex[:8]}"
    for host in ("%", "localhost"):
        mariadb.execute(f"CREATE USER '{user}'@'{host}'")
        mariadb.execute(f"GRANT SELECT ON `{mariadb.schema}`.* TO '{user}'@'{host}'")
    try:
        yield (
            sa.make_url(mariadb.url)
            .set(username=user, database=mariadb.schema)
            .render_as_string(False)
        )
    finally:
        for host in ("%", "localhost"):
            mariadb.execute(f"DROP USER '{user}'@'{host}'")


@pytest.fixture
def pg_role(pg: TestDatabase) -> Iterator[str]:
    """A URL for a role that may read the table but not pg_read_all_stats."""
    make_orders(pg)
    role = f"dbt_vp_{uuid.uuid4().hex[:8]}"
    pg.execute(f'CREATE ROLE "{role}" LOGIN')
    pg.execute(f'GRANT USAGE ON SCHEMA "{pg.schema}" TO "{role}"')
    pg.execute(f'GRANT SELECT ON {pg.qualified("orders")} TO "{role}"')
    try:
        yield sa.make_url(pg.url).set(username=role).render_as_string(False)
    finally:
        pg.execute(f'DROP OWNED BY "{role}"')
        pg.execute(f'DROP ROLE "{role}"')


def source(url: str, schema: str | None) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=url, table="orders", schema=schema, cursor_column="updated_at", pk_columns=["id"]
    )


def visibility_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "visibility_mode"]


def test_mariadb_without_process_warns_once_with_the_grant(
    mariadb: TestDatabase,
    mariadb_account: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    polled = source(mariadb_account, None)
    user = sa.make_url(mariadb_account).username
    trigger = PollTrigger(
        name="orders", source=polled, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        assert trigger.drain(lambda events: None) == 1
        trigger.tick(lambda events: None)
    (record,) = visibility_records(caplog)  # once, not per fetch
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "falls back from the exact transaction horizon to safety-window" in text
    assert f"GRANT PROCESS ON *.* TO '{user}'@'%'" in text
    assert record.grant == f"GRANT PROCESS ON *.* TO '{user}'@'%'"  # type: ignore[attr-defined]
    findings = {f.check: f for f in check_source(polled)}
    polled.close()
    finding = findings["visibility_privilege"]
    assert finding.severity == "warning"
    assert "lacks the PROCESS privilege" in finding.message
    assert finding.fix == f"GRANT PROCESS ON *.* TO '{user}'@'%'"


def test_mariadb_with_process_checks_ok_and_logs_info(
    mariadb: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_orders(mariadb)
    polled = source(mariadb.url, mariadb.schema)  # root: every privilege
    findings = {f.check: f for f in check_source(polled)}
    assert findings["visibility_privilege"].severity == "ok"
    assert "exact transaction horizon" in findings["visibility_privilege"].message
    trigger = PollTrigger(
        name="orders", source=polled, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        trigger.drain(lambda events: None)
    polled.close()
    (record,) = visibility_records(caplog)
    assert record.levelno == logging.INFO
    assert "GRANT" not in record.getMessage()


def test_postgresql_without_pg_read_all_stats_warns_with_the_grant(
    pg: TestDatabase, pg_role: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    polled = source(pg_role, pg.schema)
    role = sa.make_url(pg_role).username
    findings = {f.check: f for f in check_source(polled)}
    assert findings["visibility_privilege"].severity == "warning"
    assert findings["visibility_privilege"].fix == f"GRANT pg_read_all_stats TO {role}"
    trigger = PollTrigger(
        name="orders", source=polled, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    with pg.engine.connect() as other, caplog.at_level(logging.INFO, logger="dbtrigger"):
        other.execute(sa.text("SELECT 1"))  # another role's session the guard cannot see
        with pytest.raises(ConfigurationError, match="GRANT pg_read_all_stats"):
            trigger.tick(lambda events: None)
    polled.close()
    (record,) = visibility_records(caplog)
    assert record.levelno == logging.WARNING
    assert f"GRANT pg_read_all_stats TO {role}" in record.getMessage()
