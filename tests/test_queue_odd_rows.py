"""Rows the application (or an operator) wrote into the claim columns by hand,
and claim columns or schedules that cannot hold a queue's rows.

A row ``claimed`` without a ``dbt_claim_token`` (an INSERT that set the status,
an UPDATE that cleared the token of a claimed row to "release" it) led every
pick once due: its group was looked up by ``dbt_claim_token = NULL``, which
matches nothing, so each claim took nothing and every worker said
``idle: nothing claimable`` while ``queue status`` counted the rows behind it
as claimable now - the whole queue stalled, silently.
"""

from __future__ import annotations

import datetime as dt

import pytest

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue import ClaimContext
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


_TIME = {
    "postgresql": "timestamp with time zone",
    "mariadb": "datetime(6)",
    "sqlite": "varchar(23)",
}


def test_claim_columns_that_allow_null_are_refused_when_the_queue_starts(
    db: TestDatabase,
) -> None:
    """A table declared by hand with the right types but nullable claim columns:
    a plain INSERT left dbt_attempts and dbt_visible_at NULL, and the row was never
    claimed and counted as claimable nowhere (`idle: nothing claimable` for ever); a
    row enqueue()d on SQLite (dated, attempts NULL) failed every claim with a bare
    TypeError."""
    time = _TIME[db.kind]
    db.execute(
        f"CREATE TABLE {db.qualified('jobs')} (id integer PRIMARY KEY, payload varchar(40), "
        f"dbt_status varchar(8) DEFAULT 'ready', dbt_attempts integer, dbt_visible_at {time}, "
        "dbt_claim_token varchar(36), dbt_claimed_by varchar(200), "
        f"dbt_last_error varchar(2000), dbt_done_at {time})"
    )
    db.execute(f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (1, 'plain')")
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source)
    try:
        with pytest.raises(ConfigurationError) as caught:
            queue.tick(lambda events: None)
    finally:
        queue.close()
        source.close()
    message = str(caught.value)
    for column in ("dbt_status", "dbt_attempts", "dbt_visible_at"):
        assert f"jobs.{column} allows NULL" in message
    assert "NOT NULL" in message


@pytest.mark.parametrize(
    "run_after",
    [1e12, dt.datetime(9999, 12, 31, 23, 59, tzinfo=dt.timezone.utc)],
)
def test_a_job_scheduled_past_the_finished_rows_time_is_refused(
    db: TestDatabase, run_after: float | dt.timedelta | dt.datetime
) -> None:
    """enqueue(run_after=) at or after year 9999 was stored on PostgreSQL (year 33715
    for 1e12 s, which Python cannot read back) and reported by queue status as a
    row made ready by hand (stranded: 'queue retry --stranded' would run it now);
    MariaDB and SQLite refused it as a CommitError about an overflow or NOT NULL."""
    make_jobs(db, 0)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        with pytest.raises(ConfigurationError, match="schedule it earlier"):
            source.enqueue([{"id": 1, "payload": "later"}], run_after=run_after)
        assert source.enqueue([{"id": 2, "payload": "soon"}], run_after=3600) == 1
    finally:
        source.close()
    assert list(rows(db)) == [2]


def test_a_row_deleted_under_its_claim_is_not_blamed_on_an_expiry(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """The application deleting (or finishing) a row while a worker held it made the
    settlement's WARNING say 'the claim expired': an operator raises the visibility
    timeout for a cause that was never there."""
    make_jobs(db, 2)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source)

    def handle(events: list[RowChange]) -> None:
        db.execute(f"DELETE FROM {db.qualified('jobs')} WHERE id = 2")

    try:
        with caplog.at_level("WARNING", logger="dbtrigger.queue"):
            result = queue.tick_result(handle)
    finally:
        queue.close()
        source.close()
    assert (result.claimed, result.claims_lost) == (2, 1)
    lost = [r.getMessage() for r in caplog.records if "no longer held" in r.getMessage()]
    assert len(lost) == 1
    assert "deleted the row" in lost[0]


def test_a_retry_delay_past_the_columns_range_is_refused_at_the_call(db: TestDatabase) -> None:
    """ctx.retry(e, delay_seconds=1e12) (a timestamp or milliseconds passed as seconds)
    failed the whole settlement on MariaDB and SQLite (a datetime overflow, a NOT NULL
    constraint: a CommitError, the batch-mates' outcomes lost with it and the claim
    left to expire, again and again), and on PostgreSQL left the row ready in year
    33715, reported as stranded."""
    make_jobs(db, 2)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source)

    def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        ctx.retry(events[0], "the mailer said later", delay_seconds=1e12)

    try:
        with pytest.raises(ConfigurationError, match="from 0 to 1000 years"):
            queue.tick(handle)
        assert source.counts().stranded == 0
    finally:
        queue.close()
        source.close()
