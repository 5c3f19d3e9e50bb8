"""A done row made ready again by hand.

Updating a done row with ``dbt_status = 'ready'`` alone (the obvious way to run
it again) left it with a finished row's ``dbt_visible_at`` (9999-12-31): never
claimed, and ``queue status`` counted it as "waiting for a retry" or
"scheduled for later". Now status names it stranded and says what to do, and
``queue retry --stranded`` makes it claimable.
"""

from __future__ import annotations

import json

import pytest

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.cli import main
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, rows


def test_a_row_made_ready_by_hand_is_reported_stranded_and_re_driven(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    make_jobs(db, 2)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source)
    seen: list[tuple[int, str]] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend((int(e.pk["id"]), str((e.after or {})["payload"])) for e in events)

    args = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    try:
        assert queue.drain(handle) == 2
        db.execute(
            f"UPDATE {db.qualified('jobs')} SET payload = 'again', dbt_status = 'ready' "
            "WHERE id = 2"
        )
        assert queue.drain(handle) == 0  # stranded: never claimed
        counts = source.counts()
        assert (counts.stranded, counts.delayed, counts.scheduled) == (1, 0, 0)
        capsys.readouterr()
        assert main(["queue", "status", *args]) == 0
        out = capsys.readouterr().out
        assert "STRANDED: 1 ready row(s)" in out
        assert "queue retry --stranded" in out
        assert main(["queue", "status", "--json", *args]) == 0
        assert json.loads(capsys.readouterr().out)["stranded"] == 1
        reason = ["--reason", "payload changed"]
        assert main(["queue", "retry", "--stranded", *args, *reason, "--yes"]) == 0
        assert "1 stranded row(s)" in capsys.readouterr().out
        assert queue.drain(handle) == 1
    finally:
        queue.close()
        source.close()
    assert seen[2:] == [(2, "again")]
    assert source.counts().stranded == 0


#: The database's UTC now, in the form each dialect's ``dbt_visible_at`` holds.
NOW = {
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now')",
    "postgresql": "now()",
    "mariadb": "UTC_TIMESTAMP(6)",
}


@pytest.mark.parametrize("on_done", ["mark", "delete"])
def test_a_row_made_ready_while_it_runs_is_delivered_again_with_its_new_values(
    db: TestDatabase, on_done: str
) -> None:
    """The documented way to run a row again, done while a worker holds it: that
    worker's settlement is fenced off (lost, not done, not deleted) and the row
    comes again with the new values. A settlement that ignored the status would
    have marked (or deleted) the new version unseen."""
    make_jobs(db, 2)
    source = ClaimSource(
        url=db.url, table="jobs", schema=db.schema, pk_columns=["id"], on_done=on_done
    )
    queue = QueueTrigger(name="jobs", source=source)
    seen: list[tuple[int, str]] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend((int(e.pk["id"]), str((e.after or {})["payload"])) for e in events)
        if len(seen) == 2:  # the producer re-enqueues row 1 while its first run is going on
            db.execute(
                f"UPDATE {db.qualified('jobs')} SET payload = 'v2', dbt_status = 'ready', "
                f"dbt_visible_at = {NOW[db.kind]}, dbt_claim_token = NULL, dbt_attempts = 0 "
                "WHERE id = 1"
            )

    try:
        first = queue.tick_result(handle)
        assert (first.rows, first.claims_lost) == (1, 1)
        assert queue.drain(handle) == 1
    finally:
        queue.close()
        source.close()
    assert seen == [(1, "job 1"), (2, "job 2"), (1, "v2")]
    left = {int(r["id"]): r for r in rows(db).values()}
    if on_done == "delete":
        assert left == {}
    else:
        assert {(i, r["payload"], r["dbt_status"]) for i, r in left.items()} == {
            (1, "v2", "done"),
            (2, "job 2", "done"),
        }


def test_a_handler_writing_its_result_on_its_row_keeps_it_done_and_runs_it_once(
    db: TestDatabase,
) -> None:
    """By design (docs/queues.md, 'Running a row again'): an UPDATE of a claimed
    row's own columns alone is not new work, so a handler's own write of its
    result stays on the row, marked done, and the row is not delivered again."""
    make_jobs(db, 1)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source)
    seen: list[int] = []

    def handle(events: list[RowChange]) -> None:
        for e in events:
            seen.append(int(e.pk["id"]))
            db.execute(
                f"UPDATE {db.qualified('jobs')} SET payload = 'sent' WHERE id = :id",
                {"id": e.pk["id"]},
            )

    try:
        assert queue.drain(handle) == 1
        assert queue.drain(handle) == 0
    finally:
        queue.close()
        source.close()
    assert seen == [1]
    assert {(r["payload"], r["dbt_status"]) for r in rows(db).values()} == {("sent", "done")}
