"""A claim queue's settlement behind an application's row lock gives up in bounded time.

A handler (or any application session) that updates a job row and leaves its
transaction open holds that row's lock. The worker's settlement then waited for
it: for ever on PostgreSQL (the queue's engine is in autocommit, ``lock_timeout
= 0``), 50 s on MariaDB. The tick hung silently with the claim. The queue's own
engine now bounds every claim, extension and settlement to 30 s of lock waiting
(SQLite's claimers already queue on the file lock for 30 s): the settlement fails
as ``CommitError``, the claim expires and the row is claimed again. A thread runs
the tick; the test waits for its outcome with a bound and ends the holder's
transaction in any case.
"""

from __future__ import annotations

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.errors import CommitError
from tests.databases import TestDatabase
from tests.test_output_locks import outcome_of
from tests.test_queue_columns import make_jobs

#: Liveness bound of the tick: past the 30 s lock bound, below MariaDB's 50 s default.
TICK_WITHIN = 45.0


def test_a_settlement_behind_a_row_lock_gives_up(db: TestDatabase) -> None:
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
