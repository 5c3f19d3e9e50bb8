"""DDL on a queue table while its workers run.

A worker builds its claim from the table's definition, read once. After
``ALTER TABLE ... DROP COLUMN`` every claim of every running worker failed
(FetchError naming the column) until the worker was restarted: at default
settings the runner backed off to 300 s between failures, for ever. Now a
failed claim makes the next one read the definition again, so one claim
fails, the next one delivers the rows as the table is now (the dropped column
gone, an added one there).
"""

from __future__ import annotations

import pytest

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.errors import FetchError
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, rows


def test_a_column_dropped_and_one_added_under_a_running_worker(db: TestDatabase) -> None:
    make_jobs(db, 4)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source, batch_size=2)
    seen: list[dict[str, object]] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend(dict(e.after or {}) for e in events)

    try:
        assert queue.tick(handle) == 2
        assert set(seen[0]) == {"id", "payload"}
        jobs = db.qualified("jobs")
        db.execute(f"ALTER TABLE {jobs} ADD COLUMN extra integer")
        db.execute(f"ALTER TABLE {jobs} DROP COLUMN payload")
        with pytest.raises(FetchError) as failed:
            queue.tick(handle)
        assert queue.tick(handle) == 2  # before: the same FetchError, on every claim
        assert "reads the table's definition again" in str(failed.value)
    finally:
        queue.close()
        source.close()
    assert [set(after) for after in seen[2:]] == [{"id", "extra"}] * 2
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}
