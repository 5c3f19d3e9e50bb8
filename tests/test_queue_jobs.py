"""Producers on a claim queue: enqueue, scheduled jobs, priority, cancel - library and CLI.

Each runs on SQLite, PostgreSQL and MariaDB: the scheduled time is the
database's clock, the priority claim walks the ``(dbt_priority,
dbt_visible_at)`` index one priority at a time, and cancel must never touch a
row a worker holds.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError, OutputConstraintError, RetryableError
from dbtrigger.queue import SidecarFeeder, ddl
from dbtrigger.queue.layout import Claim
from tests.databases import TestDatabase


def make_jobs(db: TestDatabase, *, priority: bool = False) -> None:
    db.execute(f"CREATE TABLE {db.qualified('jobs')} (id integer PRIMARY KEY, payload varchar(40))")
    with db.engine.begin() as conn:
        table = sa.Table("jobs", sa.MetaData(), schema=db.schema, autoload_with=conn)
        ddl.apply(conn, ddl.install_columns(conn, table, priority=priority))


def rows(db: TestDatabase) -> dict[int, dict[str, Any]]:
    with db.engine.connect() as conn:
        result = conn.execute(sa.text(f"SELECT * FROM {db.qualified('jobs')} ORDER BY id"))
        return {int(r["id"]): dict(r) for r in result.mappings()}


@pytest.fixture
def source(db: TestDatabase) -> Iterator[ClaimSource]:
    make_jobs(db)
    src = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    yield src
    src.close()


@pytest.fixture
def ranked(db: TestDatabase) -> Iterator[ClaimSource]:
    make_jobs(db, priority=True)
    src = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    yield src
    src.close()


def claim(source: ClaimSource, limit: int, name: str, visibility: float = 60) -> Claim:
    """One claim by the claim token ``name`` (test names, not secrets)."""
    return source.claim_batch(limit=limit, token=name, worker="w", visibility=visibility)


def claimed_ids(source: ClaimSource, limit: int, name: str = "t") -> list[int]:
    return [r.pk["id"] for r in claim(source, limit, name).rows]


def job(i: int) -> dict[str, Any]:
    return {"id": i, "payload": f"job {i}"}


# --- enqueue and scheduled jobs -----------------------------------------------------------


def test_enqueue_now_and_later_on_the_database_clock(source: ClaimSource) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    assert source.enqueue([job(1), job(2)]) == 2
    assert source.enqueue([job(3)], run_after=3600) == 1  # a delay: the database's clock
    assert source.enqueue([job(4)], run_after=dt.timedelta(hours=2)) == 1
    assert source.enqueue([job(5)], run_after=now + dt.timedelta(days=1)) == 1
    assert source.enqueue([job(6)], run_after=now - dt.timedelta(seconds=5)) == 1
    counts = source.counts()
    assert counts.by_status["ready"] == 6
    assert (counts.claimable_now, counts.scheduled, counts.delayed) == (3, 3, 0)
    assert sorted(claimed_ids(source, 10)) == [1, 2, 6]
    assert claimed_ids(source, 10, "t2") == []  # the scheduled ones are not due


def test_enqueue_refuses_what_it_cannot_mean(db: TestDatabase, source: ClaimSource) -> None:
    with pytest.raises(ConfigurationError, match="claim columns"):
        source.enqueue([{"id": 1, "dbt_status": "done"}])
    with pytest.raises(ConfigurationError, match=r"no column.*nope"):
        source.enqueue([{"id": 1, "nope": 2}])
    with pytest.raises(ConfigurationError, match="no time zone"):
        source.enqueue([job(1)], run_after=dt.datetime(2030, 1, 1))
    with pytest.raises(ConfigurationError, match="finite"):
        source.enqueue([job(1)], run_after=float("inf"))
    with pytest.raises(ConfigurationError, match=r"queue install .*--priority --yes"):
        source.enqueue([job(1)], priority=3)
    assert rows(db) == {}


def test_enqueueing_a_key_already_in_the_table_says_how_to_run_it_again(
    db: TestDatabase, source: ClaimSource, capsys: pytest.CaptureFixture[str]
) -> None:
    """A producer re-enqueues a finished job by its key. It was a ``CommitError``
    (retryable: a worker's retry loop would insert it again for ever) that said
    only the driver's words; the row is a data problem, and a queue row is its
    job: the error says how to run the row that is there again."""
    source.enqueue([job(1), job(2)])
    QueueTrigger(name="jobs", source=source).drain(lambda events: None)
    with pytest.raises(OutputConstraintError, match="already in") as caught:
        source.enqueue([job(3), job(2)])
    assert not isinstance(caught.value, RetryableError)
    assert "dbt_status = 'ready'" in str(caught.value)
    assert "queues.md#running-a-row-again" in str(caught.value)
    assert sorted(rows(db)) == [1, 2]  # nothing inserted, job 3 neither
    where = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    capsys.readouterr()
    assert main(["queue", "add", *where, "--row", json.dumps(job(1))]) != 0
    assert "already in" in capsys.readouterr().err


# --- priority -----------------------------------------------------------------------------


def test_higher_priority_is_claimed_first_across_levels(ranked: ClaimSource) -> None:
    ranked.enqueue([job(1), job(2)])  # priority 0
    ranked.enqueue([job(3)], priority=-4)
    ranked.enqueue([job(4), job(5)], priority=7)
    ranked.enqueue([job(6)], priority=2)
    ranked.enqueue([job(7)], priority=9, run_after=3600)  # highest, but not due
    assert claimed_ids(ranked, 3, "a") == [4, 5, 6]  # 7 first, then 2: one claim, two levels
    assert claimed_ids(ranked, 3, "b") == [1, 2, 3]
    assert claimed_ids(ranked, 3, "c") == []


def test_priority_claims_never_mix_an_expired_claim_with_fresh_rows(ranked: ClaimSource) -> None:
    ranked.enqueue([job(1), job(2), job(3), job(4)])  # priority 0
    # A worker claims them and dies: its claim expires at once.
    assert len(claim(ranked, 4, "dead", visibility=-1).rows) == 4
    ranked.enqueue([job(5)], priority=3)
    first = claim(ranked, 10, "a")
    assert [r.pk["id"] for r in first.rows] == [5]
    assert first.more  # the expired claim comes next, alone
    second = claim(ranked, 10, "b")
    assert [r.pk["id"] for r in second.rows] == [1, 2]  # halved, as without priority
    assert second.bisected == (4, 2)


def test_priority_queue_drains_through_a_trigger(ranked: ClaimSource) -> None:
    ranked.enqueue([job(i) for i in range(1, 6)], priority=1)
    ranked.enqueue([job(i) for i in range(6, 9)], priority=5)
    seen: list[int] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend(e.pk["id"] for e in events)

    with QueueTrigger(name="jobs", source=ranked, batch_size=2) as queue:
        assert queue.drain(handle) == 8
    assert seen == [6, 7, 8, 1, 2, 3, 4, 5]


def test_install_priority_later_adds_only_the_column_and_index(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    make_jobs(db)
    db.execute(f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (1, 'x')")
    args = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    assert main(["queue", "install", *args, "--priority", "--existing", "done"]) == 0
    out = capsys.readouterr().out
    assert "dbt_priority" in out
    assert "ix_jobs_dbt_priority" in out
    assert "DROP INDEX" in out  # the dbt_visible_at index gives way (see queue/ddl.py)
    assert "dbt_status" not in out.replace("WHERE dbt_status", "")  # nothing else re-added
    assert main(["queue", "install", *args, "--priority", "--existing", "done", "--yes"]) == 0
    assert rows(db)[1]["dbt_status"] == "ready"  # --existing only applies to a fresh install
    assert rows(db)[1]["dbt_priority"] == 0
    assert main(["queue", "uninstall", *args, "--yes", "--discard-pending"]) == 0
    assert "dbt_priority" not in rows(db)[1]


# --- cancel -------------------------------------------------------------------------------


def test_cancel_takes_pending_rows_and_leaves_running_and_finished_ones(
    db: TestDatabase, source: ClaimSource
) -> None:
    source.enqueue([job(1)])
    assert claimed_ids(source, 1, "running") == [1]  # a worker holds row 1 now
    source.enqueue([job(4)])
    (four,) = claim(source, 1, "fin").rows
    assert source.settle(done=[four.key], **{"token": "fin"}).done
    source.enqueue([job(5)])
    claim(source, 1, "gone", visibility=-1)  # an expired claim
    source.enqueue([job(2)])
    source.enqueue([job(3)], run_after=3600)
    dry = source.cancel([1, 2, 3, {"id": 4}, 5, 99], reason="customer left", dry_run=True)
    assert (dry.canceled, dry.running, dry.finished, dry.missing) == (
        [{"id": 2}, {"id": 3}, {"id": 5}],
        [{"id": 1}],
        [{"id": 4}],
        [{"id": 99}],
    )
    assert rows(db)[2]["dbt_status"] == "ready"
    done = source.cancel([1, 2, 3, 4, 5, 99], reason="customer left")
    assert done == dry
    after = rows(db)
    assert {i: r["dbt_status"] for i, r in after.items()} == {
        1: "claimed",
        2: "canceled",
        3: "canceled",
        4: "done",
        5: "canceled",
    }
    assert after[2]["dbt_last_error"] == "canceled: customer left"
    assert after[5]["dbt_claim_token"] is None
    assert claimed_ids(source, 10, "later") == []  # nothing canceled comes back
    assert source.counts().by_status["canceled"] == 3
    assert source.prune(older_than_seconds=0, statuses=("done", "canceled"), dry_run=False) == 4
    with pytest.raises(ConfigurationError, match="exactly the key columns"):
        source.cancel([{"key": 1}], reason="x")


def test_sidecar_cancel_matches_the_user_key(db: TestDatabase, tmp_path: Path) -> None:
    db.execute(
        f"CREATE TABLE {db.qualified('items')} (id integer PRIMARY KEY, version integer NOT NULL)"
    )
    db.execute(f"INSERT INTO {db.qualified('items')} VALUES (1, 1), (2, 1)")
    assert main(["queue", "install", "--url", db.url, "--table", "items", "--mode", "sidecar",
                 *(["--schema", db.schema] if db.schema else []), "--yes"]) == 0  # fmt: skip
    source = ClaimSource(
        url=db.url,
        table="items",
        schema=db.schema,
        pk_columns=["id"],
        mode="sidecar",
        cursor_column="version",
    )
    feeder = SidecarFeeder(name="f", source=source, checkpoint_store=FileCheckpointStore(tmp_path))
    try:
        assert feeder.drain() == 2
        with pytest.raises(ConfigurationError, match="sidecar"):
            source.enqueue([{"id": 3, "version": 1}], run_after=60)
        result = source.cancel([2, 7], reason="not needed")
        assert (result.canceled, result.missing) == ([{"id": 2}], [{"id": 7}])
        assert claimed_ids(source, 5) == [1]
    finally:
        feeder.close()
        source.close()


# --- the CLI, as an operator types it -------------------------------------------------------


def test_queue_add_cancel_status_through_the_cli(
    db: TestDatabase,
    ranked: ClaimSource,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    assert (
        main(["queue", "add", *args, "--row", json.dumps(job(1)), "--row", json.dumps(job(2))]) == 0
    )
    assert capsys.readouterr().out.startswith("added 2 row(s) to ")
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(job(3)) + "\n\n" + json.dumps(job(4))))
    assert main(["queue", "add", *args, "--file", "-", "--run-after", "2h", "--priority", "4"]) == 0
    assert "due in 2h, priority 4" in capsys.readouterr().out
    assert main(["queue", "add", *args, "--row", json.dumps(job(5)),
                 "--run-after", "2031-01-01T00:00:00Z"]) == 0  # fmt: skip
    assert "due at 2031-01-01T00:00:00+00:00" in capsys.readouterr().out
    assert main(["queue", "status", *args]) == 0
    out = capsys.readouterr().out
    assert "claimable now: 2" in out
    assert "scheduled for later: 3" in out
    assert main(["queue", "cancel", *args, "--key", "3", "--key", '{"id": 5}', "--key", "8",
                 "--reason", "typo"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "2 would be canceled: " in out
    assert "1 not in the queue: " in out
    assert "dry run: add --yes" in out
    assert rows(db)[3]["dbt_status"] == "ready"
    assert (
        main(["queue", "cancel", *args, "--key", "3", "--key", "5", "--reason", "typo", "--yes"])
        == 0
    )
    assert "2 canceled: " in capsys.readouterr().out
    assert rows(db)[5]["dbt_status"] == "canceled"
    assert main(["queue", "add", *args, "--row", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    assert main(["queue", "add", *args, "--row", "{}", "--run-after", "tomorrow"]) == 2
    assert "neither a delay" in capsys.readouterr().err


def test_queue_commands_take_the_queue_from_source(
    db: TestDatabase,
    source: ClaimSource,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = f"jobsapp_{tmp_path.name.replace('-', '_')}"  # a fresh module per database
    (tmp_path / f"{app}.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import ClaimSource, QueueTrigger

            source = ClaimSource(url={db.url!r}, table="jobs", schema={db.schema!r},
                                 pk_columns=["id"])
            queue = QueueTrigger(name="jobs", source=source)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    source.enqueue([job(1), job(2)])
    for spec in (f"{app}:queue", f"{app}:source"):
        assert main(["queue", "status", "--source", spec, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["by_status"]["ready"] == 2
    assert main(["queue", "add", "--source", f"{app}:queue", "--row", json.dumps(job(3))]) == 0
    assert main(["queue", "install", "--source", f"{app}:queue"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["queue", "status", "--source", f"{app}:queue", "--table", "x"]) == 2
    assert "drop --url/--table" in capsys.readouterr().err
    assert main(["queue", "status"]) == 2
    assert "--url URL --table TABLE, or --source" in capsys.readouterr().err
    assert main(["queue", "status", "--source", f"{app}:ClaimSource"]) == 2
    assert "not a QueueTrigger" in capsys.readouterr().err
    assert len(rows(db)) == 3
    sys.modules[app].source.close()


def test_ages_are_real_or_said_unknown(
    db: TestDatabase, source: ClaimSource, capsys: pytest.CaptureFixture[str]
) -> None:
    """An enqueued row's age is its own; SQLite's epoch default is never shown as an age."""
    source.enqueue([job(1)])
    counts = source.counts()
    assert counts.oldest_ready_age_seconds is not None
    assert counts.oldest_ready_age_seconds < 3600
    assert not counts.undated
    db.execute(f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (2, 'by hand')")
    counts = source.counts()
    args = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    assert main(["queue", "status", *args]) == 0
    out = capsys.readouterr().out
    if db.kind == "sqlite":  # the install's default is the epoch: no time for that row
        assert (counts.undated, counts.oldest_ready_age_seconds) == (True, None)
        assert "oldest ready for an unknown time" in out
    else:  # the column defaults to the database's clock
        assert not counts.undated
        assert counts.oldest_ready_age_seconds is not None
        assert counts.oldest_ready_age_seconds < 3600
