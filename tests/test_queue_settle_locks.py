"""A claim queue's settlement behind an application's row lock gives up in bounded time.

A handler (or any application session) that updates a job row and leaves its
transaction open holds that row's lock. The worker's settlement then waited for
it: for ever on PostgreSQL (the queue's engine is in autocommit, ``lock_timeout
= 0``), 50 s on MariaDB. The tick hung silently with the claim. The queue's own
engine now bounds every claim, extension and settlement to
``LOCK_WAIT_SECONDS`` (30 s) of lock waiting (SQLite's claimers queue on the file
lock as long): the settlement fails as ``CommitError``, the claim expires and the
row is claimed again. The tests lower the bound to 2 s (the databases keep their
defaults); ``test_the_shipped_bound_is_30_seconds`` holds the default. A thread
runs the tick; the test waits for its outcome with a bound and ends the holder's
transaction in any case.
"""

from __future__ import annotations

import pytest

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


def test_a_settlement_behind_a_row_lock_gives_up(db: TestDatabase, bound: int) -> None:
    make_jobs(db, 1)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(
        name="jobs",
        source=source,
        batch_size=1,
        max_batches_per_tick=1,
        visibility_timeout_seconds=300,
        heartbeat_interval_seconds=120,  # no extension waits on the lock meanwhile
    )
    holder = db.engine.connect()

    def handle(events: list[RowChange]) -> None:
        # SQLite: another connection's write lock on the whole file
        holder.begin()
        holder.exec_driver_sql(f"UPDATE {db.qualified('jobs')} SET payload = 'x' WHERE id = 1")

    try:
        thread, outcome, _ = outcome_of(lambda: queue.tick(handle))
        thread.join(TICK_WITHIN)
        alive = thread.is_alive()
        holder.rollback()
        thread.join(90)
        assert not alive, f"the settlement still waited for the row lock after {TICK_WITHIN} s"
        [error] = outcome
        assert isinstance(error, CommitError), repr(error)
        assert "claimed again" in str(error), error
    finally:
        holder.close()
        queue.close()
        source.close()
