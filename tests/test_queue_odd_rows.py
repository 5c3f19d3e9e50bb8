"""Rows the application (or an operator) wrote into the claim columns by hand.

A row ``claimed`` without a ``dbt_claim_token`` (an INSERT that set the status,
an UPDATE that cleared the token of a claimed row to "release" it) led every
pick once due: its group was looked up by ``dbt_claim_token = NULL``, which
matches nothing, so each claim took nothing and every worker said
``idle: nothing claimable`` while ``queue status`` counted the rows behind it
as claimable now - the whole queue stalled, silently.
"""

from __future__ import annotations

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, rows


def test_a_claimed_row_without_a_token_does_not_stall_the_queue(db: TestDatabase) -> None:
    make_jobs(db, 5)
    db.execute(
        f"UPDATE {db.qualified('jobs')} SET dbt_status = 'claimed', dbt_claim_token = NULL "
        "WHERE id IN (1, 2)"
    )
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source)
    seen: list[int] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend(int(e.pk["id"]) for e in events)

    try:
        for _ in range(10):  # a bound, not a timing: each drain claims what is claimable
            if queue.drain(handle) == 0:
                break
    finally:
        queue.close()
        source.close()
    assert sorted(seen) == [1, 2, 3, 4, 5]
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}
