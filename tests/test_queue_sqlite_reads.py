"""A SQLite queue's reads do not take the database's write lock.

Every transaction of a SQLite queue's engine began ``BEGIN IMMEDIATE`` (claims
need it: two claimers must not read the same rows before either writes),
reading the table's shape and ``status``/``dead-letter list`` included. Behind
another connection's write transaction the first use of a source then waited the
whole lock bound (30 s) in its column probe, which failed silently (a spurious
"columns changed" a check later), and a sidecar feeder's 2 s insert bound became
32 s; ``counts()`` and ``dead_rows()`` failed with ``database is locked``. Reads
now begin a deferred transaction and go on beside the writer; claims and
settlements still take the write lock up front. The bound is lowered to 2 s so
the old failure shows in seconds; a thread runs the reads, the test waits for
their outcome with a bound and ends the holder's transaction in any case.
"""

from __future__ import annotations

from typing import Any

import pytest

from dbtrigger import ClaimSource
from dbtrigger.queue import engines
from tests.databases import TestDatabase
from tests.test_output_locks import outcome_of
from tests.test_queue_columns import make_jobs

#: Liveness bound of the reads (past the lowered 2 s lock bound).
READS_WITHIN = 20.0


def test_reads_go_on_beside_a_writer(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "LOCK_WAIT_SECONDS", 2)
    make_jobs(sqlite_db, 2)
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    holder = sqlite_db.engine.connect()
    holder.begin()  # another connection's write transaction, left open
    holder.exec_driver_sql("UPDATE jobs SET payload = 'x' WHERE id = 1")

    def read() -> tuple[Any, ...]:
        target = source.target
        return target, source.counts(), source.dead_rows()

    try:
        thread, outcome, _ = outcome_of(read)
        thread.join(READS_WITHIN)
        alive = thread.is_alive()
        holder.rollback()
        thread.join(90)
        assert not alive, f"the reads still waited for the write lock after {READS_WITHIN} s"
        [result] = outcome
        assert not isinstance(result, BaseException), repr(result)
        _, counts, dead = result
        assert counts.by_status["ready"] == 2
        assert dead == []
        watch = source._columns  # the shape the claims were built on was read
        assert watch is not None
        assert watch.layout is not None
        assert "dbt_status" in [name for name, _ in watch.layout]
    finally:
        holder.close()
        source.close()
