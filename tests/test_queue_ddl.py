"""DDL on a queue table while its workers run.

A worker builds its claim from the table's definition, read once. After
``ALTER TABLE ... DROP COLUMN`` every claim of every running worker failed
(FetchError naming the column) until the worker was restarted: at default
settings the runner backed off to 300 s between failures, for ever. Then a
failed claim made the next one read the definition again; a column only
*added* stayed out of ``event.after`` until a restart (or such a failure).

Now the source compares the table's columns with the claim's at most every
``CHECK_SECONDS`` (dbtrigger._columns) and after a failed claim: an added
column is in the events from the next check on, and a claim that failed on a
dropped column runs again at once on the new definition (one WARNING, no
failed tick).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.errors import FetchError
from dbtrigger.queue import SidecarFeeder
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, rows


class Afters:
    def __init__(self) -> None:
        self.seen: list[dict[str, object]] = []

    def __call__(self, events: list[RowChange]) -> None:
        self.seen.extend(dict(e.after or {}) for e in events)


def test_a_column_dropped_and_one_added_under_a_running_worker(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 3600.0)  # the failure path alone
    make_jobs(db, 4)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source, batch_size=2)
    seen = Afters()
    try:
        assert queue.tick(seen) == 2
        assert set(seen.seen[0]) == {"id", "payload"}
        jobs = db.qualified("jobs")
        db.execute(f"ALTER TABLE {jobs} ADD COLUMN extra integer")
        db.execute(f"ALTER TABLE {jobs} DROP COLUMN payload")
        with caplog.at_level(logging.INFO, logger="dbtrigger"):
            assert queue.tick(seen) == 2  # before: FetchError, then this on the next tick
    finally:
        queue.close()
        source.close()
    assert [set(after) for after in seen.seen[2:]] == [{"id", "extra"}] * 2
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}
    [said] = [r for r in caplog.records if getattr(r, "event", "") == "source_columns_changed"]
    assert said.levelno == logging.WARNING
    assert "dropped: payload" in said.getMessage()
    assert "on the old columns failed" in said.getMessage()


def test_a_failed_claim_the_columns_do_not_explain_still_fails_typed(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The columns are as they were: the claim is not run again, it fails (typed)
    and the next one reads the definition again."""
    make_jobs(sqlite_db, 2)
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source, batch_size=2)
    calls: list[int] = []

    def broken(**claim: object) -> None:
        calls.append(1)
        raise sa.exc.OperationalError("claim", {}, Exception("disk I/O error"))

    try:
        monkeypatch.setattr(source, "_claim", broken)
        monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
        with pytest.raises(FetchError, match="reads the table's definition again"):
            queue.tick(Afters())
        assert calls == [1]
        assert source._target is None
        monkeypatch.undo()
        assert queue.tick(Afters()) == 2
    finally:
        queue.close()
        source.close()


@pytest.mark.parametrize("mode", ["columns", "sidecar"])
def test_a_column_added_under_a_running_worker_is_in_the_next_claims(
    db: TestDatabase, mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The delay is ``CHECK_SECONDS`` (30 s by default): here 0, so the next claim looks."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
    make_jobs(db, 2, install=mode == "columns")
    jobs = db.qualified("jobs")
    source = (
        ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
        if mode == "columns"
        else ClaimSource(
            url=db.url,
            table="jobs",
            schema=db.schema,
            pk_columns=["id"],
            mode="sidecar",
            cursor_column="id",
        )
    )
    feeder = None
    if mode == "sidecar":
        schema = ["--schema", db.schema] if db.schema else []
        argv = ["queue", "install", "--url", db.url, "--table", "jobs", *schema]
        assert main([*argv, "--mode", "sidecar", "--yes"]) == 0
        feeder = SidecarFeeder(
            name="jobs-feeder", source=source, checkpoint_store=FileCheckpointStore(tmp_path)
        )
        assert feeder.drain() == 2
    queue = QueueTrigger(name="jobs", source=source, batch_size=5)
    seen = Afters()
    try:
        assert queue.drain(seen) == 2
        db.execute(f"ALTER TABLE {jobs} ADD COLUMN note varchar(20)")
        db.execute(f"INSERT INTO {jobs} (id, payload, note) VALUES (3, 'p', 'hi')")
        if feeder is not None:
            assert feeder.drain() == 1
        assert queue.drain(seen) == 1
    finally:
        queue.close()
        if feeder is not None:
            feeder.close()
        source.close()
    assert set(seen.seen[0]) == {"id", "payload"}
    assert seen.seen[2]["note"] == "hi"  # before: no "note" until a restart


def _sidecar(db: TestDatabase, tmp_path: Path) -> tuple[ClaimSource, SidecarFeeder]:
    make_jobs(db, 4, install=False)
    source = ClaimSource(
        url=db.url,
        table="jobs",
        schema=db.schema,
        pk_columns=["id"],
        mode="sidecar",
        cursor_column="id",
    )
    schema = ["--schema", db.schema] if db.schema else []
    argv = ["queue", "install", "--url", db.url, "--table", "jobs", *schema]
    assert main([*argv, "--mode", "sidecar", "--yes"]) == 0
    feeder = SidecarFeeder(
        name="jobs-feeder", source=source, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    assert feeder.drain() == 4
    return source, feeder


def _jobs(db: TestDatabase) -> dict[str, tuple[str, int]]:
    with db.engine.connect() as conn:
        claims = db.qualified("dbtrigger_claims")
        result = conn.execute(sa.text(f"SELECT item_key, dbt_status, dbt_attempts FROM {claims}"))
        return {str(k): (str(s), int(a)) for k, s, a in result}


def test_a_column_dropped_under_a_running_sidecar_worker(
    db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In sidecar mode a claim takes claims rows, then reads the user rows by key.
    On PostgreSQL the two were separate statements, the first committed alone: after
    ``DROP COLUMN payload`` the read failed, the claim ran again on the new columns
    and found nothing (its own rows were held by the failed one), so the tick said
    idle, and the rows waited a visibility timeout (60 s by default) to come back,
    bisected as an expired claim. Now the claim and the read commit together."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 3600.0)  # the failure path alone
    source, feeder = _sidecar(db, tmp_path)
    queue = QueueTrigger(name="jobs", source=source, batch_size=2)
    seen = Afters()
    try:
        assert queue.tick(seen) == 2
        db.execute(f"ALTER TABLE {db.qualified('jobs')} DROP COLUMN payload")
        assert queue.tick(seen) == 2  # before, on PostgreSQL: 0 (idle)
    finally:
        queue.close()
        feeder.close()
        source.close()
    assert [set(after) for after in seen.seen[2:]] == [{"id"}] * 2
    assert set(_jobs(db).values()) == {("done", 1)}


def test_a_sidecar_claim_that_cannot_read_the_user_table_claims_nothing(
    db: TestDatabase, tmp_path: Path
) -> None:
    """The user table renamed under the workers: the claim fails (typed) and leaves
    every job ready, no attempt counted (before, on PostgreSQL, it had taken its
    rows: claimed until the visibility timeout, one attempt spent)."""
    source, feeder = _sidecar(db, tmp_path)
    queue = QueueTrigger(name="jobs", source=source, batch_size=2)
    jobs = db.qualified("jobs")
    try:
        assert queue.tick(Afters()) == 2
        if db.kind == "mariadb":
            db.execute(f"RENAME TABLE {jobs} TO {db.qualified('jobs_gone')}")
        else:
            db.execute(f"ALTER TABLE {jobs} RENAME TO jobs_gone")
        with pytest.raises(FetchError, match="reads the table's definition again"):
            queue.tick(Afters())
    finally:
        queue.close()
        feeder.close()
        source.close()
    assert sorted(_jobs(db).values()) == [("done", 1), ("done", 1), ("ready", 0), ("ready", 0)]


def test_a_column_retyped_under_a_running_worker_on_postgresql(
    pg: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg prepares a statement on the server once a connection has run it five
    times, and a prepared claim returns the rows' columns: after another session's
    ``ALTER COLUMN payload TYPE text`` PostgreSQL refuses it ("cached plan must not
    change result type") on every connection that prepared it. The claim failed on
    every tick, for good, saying the next claim reads the definition again (it did,
    and the same prepared statement failed again). Now such a connection is
    dropped with the pool, and the claim runs again on the new column type."""
    make_jobs(pg, 30)
    source = ClaimSource(url=pg.url, table="jobs", schema=pg.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source, batch_size=2)
    seen = Afters()
    try:
        for _ in range(6):  # past psycopg's prepare_threshold (5) on the pooled connection
            assert queue.tick(seen) == 2
        pg.execute(f"ALTER TABLE {pg.qualified('jobs')} ALTER COLUMN payload TYPE text")
        with caplog.at_level(logging.INFO, logger="dbtrigger"):
            assert queue.tick(seen) == 2  # before: FetchError, on this tick and every later one
            assert queue.tick(seen) == 2
    finally:
        queue.close()
        source.close()
    assert len(seen.seen) == 16
    [said] = [r for r in caplog.records if getattr(r, "event", "") == "source_columns_changed"]
    assert "type changed: payload" in said.getMessage()


def test_install_on_a_new_table_whose_index_name_a_renamed_queue_kept(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    """The queue table renamed under its workers (``jobs`` to ``jobs_old``) and a new
    ``jobs`` made in its place: the renamed table keeps its index's name
    (``ix_jobs_dbt_claimable``), which PostgreSQL and SQLite want unique in the
    schema. ``queue install`` added the claim columns, then failed on the index in
    the driver's words (every run again the same), leaving a queue with no claim
    index. Now it refuses before changing anything, naming the table that holds the
    name and what to do. MariaDB's index names are per table: no conflict there."""
    make_jobs(db, 0)
    old = db.qualified("jobs_old")
    if db.kind == "mariadb":
        db.execute(f"RENAME TABLE {db.qualified('jobs')} TO {old}")
    else:
        db.execute(f"ALTER TABLE {db.qualified('jobs')} RENAME TO jobs_old")
    make_jobs(db, 0, install=False)
    schema = ["--schema", db.schema] if db.schema else []
    argv = ["queue", "install", "--url", db.url, "--table", "jobs", *schema, "--yes"]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    with db.engine.connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("jobs", schema=db.schema)}
    if db.kind == "mariadb":
        assert code == 0
        assert "dbt_status" in columns
        return
    assert code != 0
    assert "ix_jobs_dbt_claimable" in err
    assert "jobs_old" in err  # the table that holds the name
    assert "Free the name" in err  # what to do
    assert columns == {"id", "payload"}  # before: the columns added, the index missing
