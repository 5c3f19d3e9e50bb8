"""The queue's lock bound is merged into the user's driver arguments, theirs winning.

``engine_options`` replaced the queue's ``connect_args`` with the user's
(``engine_kwargs={"connect_args": {"application_name": "jobs"}}``), dropping the
lock bound (PostgreSQL ``-c lock_timeout``, MariaDB's ``init_command``, SQLite's
``timeout``) without a word; the reverse, a URL's own ``?options=`` or
``?timeout=``, was overridden by the queue's. Now each key is merged: the user's
value wins, a PostgreSQL ``options`` string gets the bound appended unless it
sets ``lock_timeout`` itself, and a MariaDB ``init_command`` of the user's is
kept, the bound set after it at connect for the variables it leaves alone. The
settlement behind a lock with such arguments: ``test_queue_settle_locks``.
"""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, QueueTrigger
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue.engines import engine_options
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs
from tests.test_source_lock_waits import refusing_pooler


def connect_args(dialect: str, given: object = None, url: str | None = None) -> object:
    kwargs = {} if given is None else {"connect_args": given}
    query = sa.make_url(url).query if url else None
    return engine_options(dialect, kwargs, query)["connect_args"]


def test_their_keys_are_kept_with_the_bound() -> None:
    assert connect_args("postgresql", {"application_name": "jobs"}) == {
        "application_name": "jobs",
        "options": "-c lock_timeout=30000",
    }
    assert connect_args("mysql", {"connect_timeout": 10}) == {
        "connect_timeout": 10,
        "init_command": "SET SESSION innodb_lock_wait_timeout = 30, SESSION lock_wait_timeout = 30",
    }
    assert connect_args("sqlite", {"check_same_thread": False}) == {
        "check_same_thread": False,
        "timeout": 30,
    }


def test_their_postgresql_options_get_the_bound_appended() -> None:
    assert connect_args("postgresql", {"options": "-c search_path=app"}) == {
        "options": "-c search_path=app -c lock_timeout=30000"
    }
    url = "postgresql+psycopg://u@h/db?options=-c%20search_path%3Dapp"
    assert connect_args("postgresql", url=url) == {
        "options": "-c search_path=app -c lock_timeout=30000"
    }
    assert connect_args("postgresql", {"options": "-c lock_timeout=5s"}) == {
        "options": "-c lock_timeout=5s"
    }


def test_their_own_bound_or_init_command_wins() -> None:
    assert connect_args("sqlite", {"timeout": 5}) == {"timeout": 5}
    assert connect_args("sqlite", url="sqlite:///q.db?timeout=5") == {}  # the URL's 5 s
    theirs = {"init_command": "SET time_zone = '+00:00'"}
    assert connect_args("mysql", theirs) == theirs  # the bound: at connect, after theirs
    assert connect_args("mysql", url="mysql+pymysql://u@h/db?init_command=SET%20@a%3D1") == {}


def test_connect_args_must_be_a_dict() -> None:
    with pytest.raises(ConfigurationError, match="connect_args must be a dict"):
        engine_options("postgresql", {"connect_args": ["-c", "x"]})


def test_a_mariadb_init_command_of_theirs_keeps_the_bound(
    mariadb: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    mariadb.execute(f"CREATE TABLE {mariadb.qualified('jobs')} (id integer PRIMARY KEY)")
    monkeypatch.setattr("dbtrigger.queue.engines.LOCK_WAIT_SECONDS", 2)
    init = "SET SESSION innodb_lock_wait_timeout = 7, @app = 'jobs'"
    source = ClaimSource(
        url=mariadb.url,
        table="jobs",
        schema=mariadb.schema,
        pk_columns=["id"],
        engine_kwargs={"connect_args": {"init_command": init}},
    )
    try:
        with source.engine.connect() as conn:
            seen = conn.exec_driver_sql(
                "SELECT @@innodb_lock_wait_timeout, @@lock_wait_timeout, @app"
            ).one()
        assert tuple(seen) == (7, 2, "jobs")  # their value; the bound they left alone
    finally:
        source.close()


@pytest.mark.postgresql
def test_a_pooler_that_refuses_the_bound_is_connected_to_without_it(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PgBouncer (Azure's built-in pooler, Neon's) refuses ``-c lock_timeout`` in the
    startup options: every claim of a queue behind one failed to connect. It connects
    without the bound instead, keeps the user's own options, and says so once."""
    make_jobs(pg, 2)
    refused = refusing_pooler(monkeypatch)
    source = ClaimSource(
        url=pg.url,
        table="jobs",
        schema=pg.schema,
        pk_columns=["id"],
        engine_kwargs={"connect_args": {"application_name": "jobs-app"}},
    )
    seen: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            trigger = QueueTrigger(name="jobs", source=source)
            trigger.tick(lambda events: seen.extend(int(e.pk["id"]) for e in events))
            with source.engine.connect() as conn:
                name = conn.exec_driver_sql("SELECT current_setting('application_name')")
                assert name.scalar() == "jobs-app"  # their own arguments kept
        assert sorted(seen) == [1, 2]
        assert len(refused) == 1  # asked once, not at every connection
        [warning] = [r for r in caplog.records if getattr(r, "event", "") == "lock_bound_refused"]
        assert "claims and settlements now wait" in warning.getMessage()
        assert "ALTER ROLE" in warning.getMessage()
    finally:
        source.close()
