"""The claim queue behaves as the poller does where they share a concept (issue #20 item 15).

One rule for when a handler receives the context, ``%SETTING%`` options on
the Functions decorator, ``engine=`` on the source, the contexts' marking
methods; and the claim columns' types checked when the queue starts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dbtrigger import ClaimContext, ClaimSource, QueueTrigger, RowChange
from dbtrigger.runtime.tick import wants_context
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs


def claim_source(db: TestDatabase) -> ClaimSource:
    return ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])


# --- one rule for the context slot --------------------------------------------------


def test_a_defaulted_second_parameter_is_the_handlers_own_option(
    sqlite_db: TestDatabase,
) -> None:
    """``def h(events, retries=3)`` is called with the events alone, as a poller calls it."""
    make_jobs(sqlite_db, 4)
    source = claim_source(sqlite_db)
    seen: list[Any] = []

    def handle(events: list[RowChange], retries: int = 3) -> None:
        seen.append(retries)

    async def handle_async(events: list[RowChange], retries: int = 3) -> None:
        seen.append(retries)

    def named(events: list[RowChange], ctx: ClaimContext | None = None) -> None:
        seen.append(type(ctx).__name__)

    def annotated(events: list[RowChange], claim: ClaimContext | None = None) -> None:
        seen.append(type(claim).__name__)

    try:
        q = QueueTrigger(name="jobs", source=source, batch_size=1)
        assert q.tick(handle) == 1
        assert asyncio.run(q.tick_async(handle_async)) == 1
        assert q.tick(named) == 1
        assert q.tick(annotated) == 1
        assert seen == [3, 3, "ClaimContext", "ClaimContext"]
    finally:
        source.close()
    # One function decides, for every kind of handler.
    assert [wants_context(f) for f in (handle, handle_async, named, annotated)] == [
        False,
        False,
        True,
        True,
    ]

