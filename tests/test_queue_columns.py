"""Claim-mode queues in columns mode, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimContext, ClaimSource, QueueTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.errors import PartialBatchError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.queue import ddl
from dbtrigger.runtime.runner import Runner
from tests.databases import TestDatabase


def make_jobs(db: TestDatabase, rows: int, *, install: bool = True) -> None:
    db.execute(f"CREATE TABLE {db.qualified('jobs')} (id integer PRIMARY KEY, payload varchar(40))")
    if rows:
        db.execute(
            f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (:i, :p)",
            [{"i": i, "p": f"job {i}"} for i in range(1, rows + 1)],
        )
    if install:
        with db.engine.begin() as conn:
            table = sa.Table("jobs", sa.MetaData(), schema=db.schema, autoload_with=conn)
            ddl.apply(conn, ddl.install_columns(conn, table))


@pytest.fixture
def source(db: TestDatabase) -> Iterator[ClaimSource]:
    make_jobs(db, 10)
    src = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    yield src
    src.close()


def rows(db: TestDatabase) -> dict[int, dict[str, Any]]:
    with db.engine.connect() as conn:
        result = conn.execute(sa.text(f"SELECT * FROM {db.qualified('jobs')} ORDER BY id"))
        return {int(r["id"]): dict(r) for r in result.mappings()}


def trigger(source: ClaimSource, **kw: Any) -> QueueTrigger:
    options: dict[str, Any] = {
        "name": "jobs",
        "source": source,
        "batch_size": 4,
        "retry_delay_seconds": 0.0,
        "retry_delay_max_seconds": 0.0,
        "seed": 1,
    }
    options.update(kw)
    return QueueTrigger(**options)


def test_accepted_rows_are_done_and_marks_retry_or_reject(
    db: TestDatabase, source: ClaimSource
) -> None:
    seen: list[int] = []

    def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        for e in events:
            seen.append(e.pk["id"])
            assert e.after is not None
            assert e.after["payload"] == f"job {e.pk['id']}"
            assert not any(k.startswith("dbt_") for k in e.after)
            if e.pk["id"] == 3 and ctx.attempts(e) == 1:
                ctx.retry(e, "busy downstream")
            if e.pk["id"] == 5:
                ctx.reject(e, "malformed")

    q = trigger(source)
    first = q.tick_result(handle)
    assert (first.claimed, first.rows, first.retried, first.more) == (4, 3, 1, True)
    assert rows(db)[3]["dbt_status"] == "ready"
    assert rows(db)[3]["dbt_last_error"] == "retry requested: busy downstream"
    assert q.drain(handle) == 6  # rows 6-10 and row 3 again; row 5 rejected
    final = rows(db)
    assert {i for i, r in final.items() if r["dbt_status"] == "done"} == set(range(1, 11)) - {5}
    assert final[5]["dbt_status"] == "dead"
    assert final[5]["dbt_last_error"] == "rejected: malformed"
    assert final[3]["dbt_attempts"] == 2
    assert final[1]["dbt_done_at"] is not None
    assert sorted(seen) == sorted([*range(1, 11), 3])
    counts = q.status()
    assert dict(counts.by_status) == {"ready": 0, "claimed": 0, "done": 9, "dead": 1}
    assert counts.claimable_now == 0


def test_exception_retries_with_backoff_then_dead_and_dead_lettered(
    db: TestDatabase, source: ClaimSource, tmp_path: Path
) -> None:
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    metrics = InMemoryMetrics()
    q = trigger(source, batch_size=10, max_attempts=2, quarantine=sink, metrics=metrics)
    calls: list[int] = []

    def handle(events: list[RowChange]) -> None:
        calls.append(len(events))
        if any(e.pk["id"] == 7 for e in events):
            raise PartialBatchError([{"id": 7}], causes={0: RuntimeError("password=hunter2 bad")})

    assert q.tick(handle) == 9
    row7 = rows(db)[7]
    assert row7["dbt_status"] == "ready"
    assert "hunter2" not in row7["dbt_last_error"]
    assert q.tick(handle) == 0
    assert rows(db)[7]["dbt_status"] == "dead"
    assert rows(db)[7]["dbt_last_error"].startswith("failed 2 times; last: RuntimeError")
    records = sink.records()
    assert [dict(r.pk) for r in records] == [{"id": 7}]
    assert records[0].attempts == 2
    assert records[0].row is not None
    assert records[0].row["payload"] == "job 7"
    assert metrics.total("queue_rows_total", result="dead") == 1
    assert metrics.total("queue_rows_total", result="done") == 9
    assert calls == [10, 1]


def test_backoff_delays_the_retry(db: TestDatabase, source: ClaimSource) -> None:
    q = trigger(source, batch_size=10, retry_delay_seconds=30, retry_delay_max_seconds=60)

    def fail(events: list[RowChange]) -> None:
        raise RuntimeError("down")

    assert q.tick(fail) == 0
    counts = q.status()
    assert counts.delayed == 10
    assert counts.claimable_now == 0
    assert q.tick_result(fail).outcome == "idle"


def test_completion_is_fenced_by_the_claim_token(db: TestDatabase, source: ClaimSource) -> None:
    a = source.claim(limit=1, token="a" * 32, worker="A", visibility=0.3)
    assert [r.attempt for r in a] == [1]
    assert source.claim(limit=10, token="x" * 32, worker="X", visibility=30)[0].key != a[0].key
    time.sleep(0.6)
    b = source.claim(limit=1, token="b" * 32, worker="B", visibility=30)
    assert b[0].key == a[0].key
    assert b[0].attempt == 2  # the expired claim counted
    late = source.settle(token="a" * 32, done=[a[0].key])
    assert late.done == frozenset()
    row = rows(db)[a[0].key[0]]
    assert (row["dbt_status"], row["dbt_claim_token"]) == ("claimed", "b" * 32)
    assert source.settle(token="b" * 32, done=[b[0].key]).done == {b[0].key}
    assert rows(db)[a[0].key[0]]["dbt_status"] == "done"


def test_a_lost_claim_is_reported_not_overwritten(db: TestDatabase, source: ClaimSource) -> None:
    metrics = InMemoryMetrics()
    q = trigger(
        source,
        batch_size=1,
        visibility_timeout_seconds=0.3,
        heartbeat_interval_seconds=0.1,
        metrics=metrics,
    )
    other = trigger(source, batch_size=1, owner_id="other")

    def slow(events: list[RowChange], ctx: ClaimContext) -> None:
        # Simulate a frozen worker: the claim is taken over behind its back.
        with db.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE {db.qualified('jobs')} SET dbt_claim_token = 'stolen' WHERE id = :i"
                ),
                {"i": events[0].pk["id"]},
            )
        deadline = time.monotonic() + 60  # bounded: the next heartbeat notices the theft
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ctx.cancelled

    result = q.tick_result(slow)
    assert (result.rows, result.claims_lost) == (0, 1)
    assert result.settled == (((1,), "lost"),)
    assert rows(db)[1]["dbt_claim_token"] == "stolen"  # noqa: S105 - a claim token, not a secret
    assert metrics.total("queue_rows_total", result="lost") == 1
    assert other.tick(lambda events: None) == 1  # row 2 is unaffected


def test_heartbeat_keeps_a_slow_claim(db: TestDatabase, source: ClaimSource) -> None:
    q = trigger(
        source, batch_size=1, visibility_timeout_seconds=2.0, heartbeat_interval_seconds=0.25
    )
    other = trigger(source, batch_size=10, owner_id="other")
    stolen: list[int] = []
    holding = threading.Event()
    looked = threading.Event()

    def slow(events: list[RowChange]) -> None:
        holding.set()
        assert looked.wait(60)  # slow until the other worker has looked (bounded)

    def record(events: list[RowChange]) -> None:
        stolen.extend(e.pk["id"] for e in events)

    thread = threading.Thread(target=q.tick, args=(slow,))
    thread.start()
    try:
        assert holding.wait(60)  # row 1 is claimed and in the handler
        time.sleep(2.6)  # past the visibility timeout: only the heartbeat keeps the claim
        other.tick(record)
    finally:
        looked.set()
        thread.join(60)
    assert 1 not in stolen
    assert rows(db)[1]["dbt_status"] == "done"
    assert rows(db)[1]["dbt_attempts"] == 1


def test_crash_looping_row_ends_dead_without_a_handler_call(
    db: TestDatabase, source: ClaimSource
) -> None:
    db.execute(f"DELETE FROM {db.qualified('jobs')} WHERE id > 1")
    for n in range(3):  # three workers died holding it
        assert source.claim(limit=1, token=f"{n}" * 32, worker="w", visibility=0.05)
        time.sleep(0.15)
    q = trigger(source, batch_size=1, max_attempts=3)
    called: list[Any] = []
    result = q.tick_result(called.append)
    assert (result.dead, called) == (1, [])
    row = rows(db)[1]
    assert row["dbt_status"] == "dead"
    assert "claim expired 3 times without an outcome" in row["dbt_last_error"]
    assert "isolated as a single row" in row["dbt_last_error"]


def test_concurrent_triggers_claim_disjoint_rows(db: TestDatabase) -> None:
    make_jobs(db, 200)
    handled: list[int] = []
    lock = threading.Lock()

    def handle(events: list[RowChange]) -> None:
        with lock:
            handled.extend(e.pk["id"] for e in events)

    def work(n: int) -> None:
        src = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
        try:
            trigger(src, batch_size=7, owner_id=f"w{n}", max_concurrency=2).drain(handle)
        finally:
            src.close()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(handled) == list(range(1, 201))
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}


def test_on_done_delete(db: TestDatabase) -> None:
    make_jobs(db, 5)
    src = ClaimSource(
        url=db.url, table="jobs", schema=db.schema, pk_columns=["id"], on_done="delete"
    )
    try:
        assert trigger(src, batch_size=10).tick(lambda events: None) == 5
    finally:
        src.close()
    assert rows(db) == {}


def test_async_handler_and_tick_async(db: TestDatabase, source: ClaimSource) -> None:
    got: list[int] = []

    async def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        await asyncio.sleep(0)
        got.extend(e.pk["id"] for e in events)

    q = trigger(source, batch_size=3)
    assert q.tick(handle) == 3
    assert asyncio.run(q.tick_async(handle)) == 3
    assert sorted(got) == [1, 2, 3, 4, 5, 6]


def test_runner_drives_a_queue(db: TestDatabase, source: ClaimSource) -> None:
    q = trigger(source, batch_size=4)
    stats = Runner(q, lambda events: None, interval_seconds=0.01).run(max_ticks=5)
    assert stats.rows == 10
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}


def test_marking_outside_the_batch_is_refused(source: ClaimSource) -> None:
    kept: list[Any] = []

    def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        kept.append((events[0], ctx))
        foreign = RowChange(
            event_id="nope",
            op="upsert",
            source="x",
            cursor=None,
            pk={"id": 99},
            before=None,
            after=None,
        )
        with pytest.raises(Exception, match="not in this batch"):
            ctx.retry(foreign, "x")

    trigger(source, batch_size=1).tick(handle)
    event, ctx = kept[0]
    with pytest.raises(Exception, match="after the handler returned"):
        ctx.reject(event, "too late")


# --- the CLI -------------------------------------------------------------------------


def cli(*argv: str) -> int:
    return main(list(argv))


def table_args(db: TestDatabase) -> list[str]:
    return ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]


def test_install_is_a_dry_run_until_yes(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    make_jobs(db, 3, install=False)
    src = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    with pytest.raises(Exception, match="queue install") as info:
        src.counts()
    assert "--table jobs" in str(info.value)
    src.close()
    assert cli("queue", "install", *table_args(db)) == 0
    out = capsys.readouterr().out
    assert "ADD COLUMN dbt_status" in out
    assert "dry run" in out
    assert "dbt_status" not in rows(db)[1]
    assert cli("queue", "install", *table_args(db), "--yes") == 0
    assert rows(db)[1]["dbt_status"] == "ready"
    assert cli("queue", "install", *table_args(db)) == 0
    assert "nothing to do" in capsys.readouterr().out
    # three rows are still ready: dropping the columns would drop that work
    assert cli("queue", "uninstall", *table_args(db), "--yes", "--discard-pending") == 0
    assert "dbt_status" not in rows(db)[1]


def test_uninstall_refuses_while_work_is_not_done(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dropping the claim columns drops the queue's record of which rows are
    done: with rows still ready or claimed it refuses unless --discard-pending
    (it applied before, as sidecar mode never did)."""
    make_jobs(db, 3)
    db.execute(f"UPDATE {db.qualified('jobs')} SET dbt_status = 'done' WHERE id <> 2")
    capsys.readouterr()
    assert cli("queue", "uninstall", *table_args(db)) == 0  # a dry run says it would refuse
    out = capsys.readouterr().out
    assert "refused with --yes as it stands: 1 row(s) of queue " in out
    assert "jobs are not finished" in out
    assert cli("queue", "uninstall", *table_args(db), "--yes") != 0
    err = capsys.readouterr().err
    assert "1 row(s) of queue " in err
    assert "jobs are not finished (ready or claimed): stop the producers" in err
    assert "--discard-pending" in err
    assert rows(db)[2]["dbt_status"] == "ready"
    db.execute(f"UPDATE {db.qualified('jobs')} SET dbt_status = 'done'")
    assert cli("queue", "uninstall", *table_args(db), "--yes") == 0
    assert "dbt_status" not in rows(db)[2]


def test_install_existing_done(db: TestDatabase) -> None:
    make_jobs(db, 3, install=False)
    assert cli("queue", "install", *table_args(db), "--existing", "done", "--yes") == 0
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}


def test_status_retry_prune(
    db: TestDatabase, source: ClaimSource, capsys: pytest.CaptureFixture[str]
) -> None:
    def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        for e in events:
            if e.pk["id"] <= 2:
                ctx.reject(e, "bad")

    trigger(source, batch_size=10).tick(handle)
    capsys.readouterr()
    assert cli("queue", "status", *table_args(db), "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["by_status"] == {"ready": 0, "claimed": 0, "done": 8, "dead": 2}
    assert cli("queue", "retry", "--dead", *table_args(db), "--reason", "fixed parser") == 0
    assert "2 dead row(s)" in capsys.readouterr().out
    assert rows(db)[1]["dbt_status"] == "dead"
    assert cli("queue", "retry", "--dead", *table_args(db), "--reason", "fixed", "--yes") == 0
    row = rows(db)[1]
    assert (row["dbt_status"], row["dbt_attempts"]) == ("ready", 0)
    assert row["dbt_last_error"].startswith("re-driven (fixed); before: rejected: bad")
    assert cli("queue", "prune", *table_args(db), "--older-than", "0", "--chunk", "3") == 0
    assert "8 done/canceled row(s)" in capsys.readouterr().out
    assert len(rows(db)) == 10
    assert cli("queue", "prune", *table_args(db), "--older-than", "0", "--chunk", "3", "--yes") == 0
    assert sorted(rows(db)) == [1, 2]
    assert cli("queue", "prune", *table_args(db), "--older-than", "1h", "--yes") == 0
    assert "deleted 0" in capsys.readouterr().out.splitlines()[-1]
