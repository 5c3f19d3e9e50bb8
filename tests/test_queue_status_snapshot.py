"""``dbtrigger queue status`` and ``queue prune`` while workers run.

Status: its numbers are of one instant.

The counts were four statements, each its own snapshot on PostgreSQL (the
queue's reads autocommit there): a claim landing between them showed
rows both ``ready`` (read first) and gone from ``claimable now`` (read
next), so the numbers did not add up. Here a worker claims every row right
after the first statement of the count: before, ``ready 6`` beside
``claimable now: 0``; now one statement, one snapshot.

Prune: a row picked as finished before the cutoff and run again before its
delete keeps its fresh outcome.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from dbtrigger import ClaimSource, QueueTrigger
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


#: The database's UTC now, as each dialect's ``dbt_visible_at`` holds it.
NOW = {"postgresql": "now()", "mariadb": "UTC_TIMESTAMP(6)"}


def test_prune_leaves_a_row_run_again_between_its_pick_and_its_delete(
    server_db: TestDatabase,
) -> None:
    """``queue prune --older-than 1h`` picks finished keys, then deletes them by key
    and status: a row picked as done days ago, made ready by its producer and done
    again by a worker in between, was deleted with its fresh outcome. The delete
    now holds the cutoff too."""
    db = server_db
    make_jobs(db, 2)
    jobs = db.qualified("jobs")
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    worker = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=worker)
    assert queue.tick(lambda events: None) == 2
    ago = {
        "postgresql": "now() - interval '2 days'",
        "mariadb": "UTC_TIMESTAMP(6) - INTERVAL 2 DAY",
    }
    db.execute(f"UPDATE {jobs} SET dbt_done_at = {ago[db.kind]}")
    _ = source.target
    ran: list[int] = []

    def between(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not ran and statement.lstrip().upper().startswith("SELECT"):
            db.execute(
                f"UPDATE {jobs} SET dbt_status = 'ready', dbt_visible_at = {NOW[db.kind]}, "
                "dbt_claim_token = NULL, dbt_attempts = 0 WHERE id = 1"
            )
            ran.append(queue.tick(lambda events: None))

    sa.event.listen(source.engine, "after_cursor_execute", between)
    try:
        pruned = source.prune(older_than_seconds=3600, dry_run=False)
    finally:
        sa.event.remove(source.engine, "after_cursor_execute", between)
        queue.close()
        worker.close()
        source.close()
    assert ran == [1]  # row 1 ran again between the pick and the delete
    with db.engine.connect() as conn:
        left = conn.execute(sa.text(f"SELECT id, dbt_status FROM {jobs}")).all()
    assert [tuple(r) for r in left] == [(1, "done")]  # before: [] (both deleted)
    assert pruned == 1
