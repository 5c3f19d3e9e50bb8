"""``dbtrigger queue status`` while workers run: its numbers are of one instant.

The counts were four statements, each its own snapshot on PostgreSQL and
MariaDB (the queue's reads autocommit): a claim landing between them showed
rows both ``ready`` (read first) and gone from ``claimable now`` (read
next), so the numbers did not add up. Here a worker claims every row right
after the first statement of the count: before, ``ready 6`` beside
``claimable now: 0``; now one statement, one snapshot.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from dbtrigger import ClaimSource
from dbtrigger.queue.operations import QueueCounts
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs


def adds_up(counts: QueueCounts) -> bool:
    """Every ready row, and every row of an expired claim, is in exactly one of
    ``claimable now``, ``waiting for a retry``, ``scheduled`` or ``stranded``."""
    by = counts.by_status
    shown = counts.claimable_now + counts.delayed + counts.scheduled + counts.stranded
    return by["ready"] + counts.expired_claims == shown


def test_status_counts_are_of_one_instant_while_a_worker_claims(server_db: TestDatabase) -> None:
    db = server_db
    make_jobs(db, 6)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    worker = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    claimed: list[Any] = []
    _ = source.target  # the table's checks before the hook is armed

    def between(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not claimed and "count(" in statement.lower():
            claimed.append(worker.claim(limit=10, token="t" * 32, worker="w", visibility=60))

    sa.event.listen(source.engine, "after_cursor_execute", between)
    try:
        counts = source.counts()
    finally:
        sa.event.remove(source.engine, "after_cursor_execute", between)
        worker.close()
        source.close()
    assert len(claimed[0]) == 6  # the worker claimed every row during the count
    assert adds_up(counts), counts  # before: ready 6, claimable now 0
    assert counts.by_status["ready"] + counts.by_status["claimed"] == 6
