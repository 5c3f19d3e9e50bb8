"""A claim queue's settlement behind an application's row lock gives up in bounded time.

A handler (or any application session) that updates a job row and leaves its
transaction open holds that row's lock. The worker's settlement then waited for
it: for ever on PostgreSQL (the queue's engine is in autocommit, ``lock_timeout
= 0``), 50 s on MariaDB. The tick hung silently with the claim. The queue's own
engine now bounds every claim, extension and settlement to
``LOCK_WAIT_SECONDS`` (30 s) of lock waiting (SQLite's claimers queue on the file
lock as long): the settlement fails as ``CommitError``, the claim expires and the
row is claimed again. The same with the user's own driver arguments
(``engine_kwargs={"connect_args": ...}``), which used to replace the bound instead
of keeping it (for ever again on PostgreSQL, 50 s on MariaDB, SQLite's 5 s
default). The tests lower the bound to 2 s (the databases keep their
defaults); ``test_the_shipped_bound_is_30_seconds`` holds the default. A thread
runs the tick; the test waits for its outcome with a bound and ends the holder's
transaction in any case.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.errors import CommitError
from dbtrigger.queue import engines
from tests.databases import TestDatabase
from tests.test_output_locks import outcome_of
from tests.test_queue_columns import make_jobs

#: The queue's lock bound in these tests (read when the source makes its engine).
BOUND = 2
#: Liveness bound of the tick: past the lowered lock bound, below MariaDB's 50 s default.
TICK_WITHIN = 20.0


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(engines, "LOCK_WAIT_SECONDS", BOUND)
    return BOUND


def test_the_shipped_bound_is_30_seconds() -> None:
    """The default every dialect's own engine gets (the lock tests run with 2 s)."""
    assert engines.LOCK_WAIT_SECONDS == 30
    pg = engines.engine_options("postgresql", {})
    assert pg["connect_args"] == {"options": "-c lock_timeout=30000"}
    assert pg["isolation_level"] == "AUTOCOMMIT"
    mysql = engines.engine_options("mysql", {})["connect_args"]["init_command"]
    assert mysql == ("SET SESSION innodb_lock_wait_timeout = 30, SESSION lock_wait_timeout = 30")
    assert engines.engine_options("sqlite", {})["connect_args"] == {"timeout": 30}


#: Driver arguments of the user's own (``engine_kwargs={"connect_args": ...}``),
#: with a setting of theirs to see on the queue's connections: before, the queue's
#: lock bound was dropped for them (a settlement waited for ever on PostgreSQL).
THEIR_CONNECT_ARGS = {
    "postgresql": {"application_name": "jobs", "options": "-c work_mem=8MB"},
    "mariadb": {"connect_timeout": 10, "init_command": "SET @app = 'jobs'"},
    "sqlite": {"check_same_thread": False},
}


def settings(db: TestDatabase, source: ClaimSource) -> dict[str, object]:
    """The lock bound and the user's setting, on a connection of the queue's engine."""
    statements = {
        "postgresql": "SELECT current_setting('lock_timeout'), "
        "current_setting('application_name'), current_setting('work_mem')",
        "mariadb": "SELECT @@innodb_lock_wait_timeout, @@lock_wait_timeout, @app",
        "sqlite": "PRAGMA busy_timeout",
    }
    with source.engine.connect() as conn:
        row = conn.exec_driver_sql(statements[db.kind]).one()
        conn.rollback()
    return dict(zip(("bound", "second", "theirs"), row, strict=False))


def one_job_queue(source: ClaimSource) -> QueueTrigger:
    """One row a claim, claims that do not expire during the test, and no extension
    that would wait on the lock meanwhile."""
    return QueueTrigger(
        name="jobs",
        source=source,
        batch_size=1,
        max_batches_per_tick=1,
        visibility_timeout_seconds=300,
        heartbeat_interval_seconds=120,
    )


def settles_behind_a_row_lock_then_redelivers(db: TestDatabase, queue: QueueTrigger) -> None:
    """The handler leaves a transaction open on job 1 (SQLite: another connection's
    write lock on the whole file): the settlement gives up within the test's bound as
    a CommitError, and once the claim expires the row is delivered again."""
    holder = db.engine.connect()

    def handle(events: list[RowChange]) -> None:
        holder.begin()
        holder.exec_driver_sql(f"UPDATE {db.qualified('jobs')} SET payload = 'x' WHERE id = 1")

    try:
        thread, outcome, _ = outcome_of(lambda: queue.tick(handle))
        thread.join(TICK_WITHIN)
        alive = thread.is_alive()
        holder.rollback()
        thread.join(90)
        assert not alive, f"the settlement still waited for the row lock after {TICK_WITHIN} s"
    finally:
        holder.close()
    [error] = outcome
    assert isinstance(error, CommitError), repr(error)
    assert "claimed again" in str(error), error
    # the claim expiring (visible again now), the row is delivered again
    db.execute(f"UPDATE {db.qualified('jobs')} SET dbt_visible_at = '2000-01-01 00:00:00.000'")
    again: list[RowChange] = []
    queue.tick(again.extend)
    assert [e.pk for e in again] == [{"id": 1}]


@pytest.mark.parametrize("connect_args", ["none", "theirs"])
def test_a_settlement_behind_a_row_lock_gives_up(
    db: TestDatabase, bound: int, connect_args: str
) -> None:
    make_jobs(db, 1)
    theirs = connect_args == "theirs"
    source = ClaimSource(
        url=db.url,
        table="jobs",
        schema=db.schema,
        pk_columns=["id"],
        engine_kwargs={"connect_args": THEIR_CONNECT_ARGS[db.kind]} if theirs else None,
    )
    expected: dict[str, dict[str, object]] = {
        "postgresql": {"bound": f"{bound}s", "second": "jobs" if theirs else "", "theirs": "8MB"},
        "mariadb": {"bound": bound, "second": bound, "theirs": "jobs" if theirs else None},
        "sqlite": {"bound": bound * 1000},
    }
    queue = one_job_queue(source)
    try:
        settles_behind_a_row_lock_then_redelivers(db, queue)
        seen = settings(db, source)
        if db.kind == "postgresql" and not theirs:
            seen.pop("theirs")  # the server's work_mem
            expected["postgresql"].pop("theirs")
        assert seen == expected[db.kind]
    finally:
        queue.close()
        source.close()


def test_a_settlement_on_a_shared_engine_behind_a_row_lock_gives_up(
    db: TestDatabase, bound: int
) -> None:
    """The application's own engine (``ClaimSource(engine=...)``) keeps its settings,
    so the bound set at connect time was not there: the settlement waited for ever on
    PostgreSQL and 50 s on MariaDB. Each unit of work now bounds its own lock waits."""
    make_jobs(db, 1)
    shared = sa.create_engine(db.url)
    source = ClaimSource(engine=shared, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = one_job_queue(source)
    try:
        settles_behind_a_row_lock_then_redelivers(db, queue)
        with shared.connect() as conn:  # the application's sessions are as they were
            if db.kind == "postgresql":
                assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "0"
            elif db.kind == "mariadb":
                assert conn.exec_driver_sql("SELECT @@innodb_lock_wait_timeout").scalar() == 50
    finally:
        queue.close()
        source.close()
        shared.dispose()
