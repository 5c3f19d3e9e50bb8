"""A claim queue's drain does not return while retried rows wait.

A row its handler retried (``ctx.retry``, a raise) goes back to ``ready`` with
``dbt_visible_at`` in the future; the claim after it comes back empty, and
``QueueTrigger.drain`` returned there, the row not done. Now it waits for a
retry due within ``retry_wait_seconds`` and claims it, and raises a
``HandlerError`` saying how many rows wait and when, nothing skipped, when the
first is further off. On SQLite, PostgreSQL and MariaDB: the due time is read
with each database's own clock arithmetic.
"""

from __future__ import annotations

from typing import Any

import pytest

from dbtrigger import ClaimSource, QueueTrigger
from dbtrigger.errors import HandlerError
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs


def _queue(db: TestDatabase) -> tuple[ClaimSource, QueueTrigger]:
    make_jobs(db, 3)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    return source, QueueTrigger(name="jobs", source=source, batch_size=10)


def test_a_queue_drain_claims_a_retry_that_comes_due(db: TestDatabase) -> None:
    """Before: the drain returned after the first claim (2 done), row 2 still
    ``ready`` for its retry."""
    source, queue = _queue(db)
    delivered: list[tuple[int, int]] = []

    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            delivered.append((int(e.pk["id"]), ctx.attempts(e)))
            if e.pk["id"] == 2 and ctx.attempts(e) == 1:
                ctx.retry(e, "429 from the mailer", delay_seconds=0.5)

    try:
        assert queue.drain(handle) == 3
        assert queue.status().by_status["done"] == 3
    finally:
        queue.close()
        source.close()
    assert sorted(delivered) == [(1, 1), (2, 1), (2, 2), (3, 1)]


def test_a_queue_drain_raises_for_a_retry_past_its_wait(db: TestDatabase) -> None:
    source, queue = _queue(db)

    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            if e.pk["id"] == 2:
                ctx.retry(e, "429 from the mailer", delay_seconds=600)

    try:
        with pytest.raises(HandlerError) as raised:
            queue.drain(handle)
        counts = queue.status()
    finally:
        queue.close()
        source.close()
    text = str(raised.value)
    assert "stopped after 2 row(s): 1 event(s) wait for a retry" in text
    assert "they stay ready in the table" in text
    assert "Nothing was skipped" in text
    assert 590 < float(text.split("(in ")[1].split("s)", maxsplit=1)[0]) <= 600
    assert raised.value.fields["waiting_retries"] == 1
    assert (counts.by_status["done"], counts.delayed) == (2, 1)
