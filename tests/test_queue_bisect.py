"""Rows of an expired claim are claimed again in halves (issue #20 item 6).

The pure rule (:func:`dbtrigger.queue.pick.choose`) table by table, then the
claim statements on every database: a fresh head takes only fresh rows, an
expired claim leading the pick is halved and its other half waits as a group,
a claim that expired holding one row isolates it. The end-to-end proof with
worker processes that ``os._exit`` is in ``tests/test_queue_chaos.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger
from dbtrigger.cli import main
from dbtrigger.queue import SidecarFeeder
from dbtrigger.queue.pick import Choice, Picked, choose
from tests.databases import TestDatabase, admin_engine
from tests.test_queue_columns import make_jobs, rows


def fresh(i: int) -> Picked:
    return Picked((i,), "ready", None)


def expired(i: int, claim: str = "t1") -> Picked:
    return Picked((i,), "claimed", claim)


def grouped(i: int, group: str = "g1") -> Picked:
    return Picked((i,), "ready", group)


@pytest.mark.parametrize(
    ("picked", "expected"),
    [
        ([], Choice()),
        ([fresh(1), fresh(2)], Choice(claim=[(1,), (2,)])),
        # A fresh head takes the fresh rows only: expired rows are never mixed in.
        ([fresh(1), expired(2), fresh(3), grouped(4)], Choice(claim=[(1,), (3,)])),
        # An expired claim leading the pick: its first half, the rest regrouped.
        (
            [expired(i) for i in range(1, 6)] + [fresh(9)],
            Choice(claim=[(1,), (2,), (3,)], regroup=[(4,), (5,)], bisected=(5, 3)),
        ),
        # Only the leading claim's rows count; another expired claim waits its turn.
        (
            [expired(1), expired(2, "t2"), expired(3)],
            Choice(claim=[(1,)], regroup=[(3,)], bisected=(2, 1)),
        ),
        # A claim that expired holding one row: that row alone, isolated.
        ([expired(7), fresh(8)], Choice(claim=[(7,)], isolated=True)),
        # A regrouped half is tried whole, never mixed with fresh rows.
        ([grouped(4), grouped(5), fresh(6), grouped(7, "g2")], Choice(claim=[(4,), (5,)])),
        # A regrouped half of one row is not isolated: it never expired alone.
        ([grouped(4), fresh(6)], Choice(claim=[(4,)])),
    ],
)
def test_choose(picked: list[Picked], expected: Choice) -> None:
    assert choose(picked) == expected


def wait_until_expired(source: ClaimSource, count: int) -> None:
    """Wait (bounded) until ``count`` claims' rows have expired: no fixed sleep."""
    deadline = time.monotonic() + 30
    while source.counts().expired_claims < count:
        assert time.monotonic() < deadline, source.counts()
        time.sleep(0.05)


def age(db: TestDatabase, ids: list[int]) -> None:
    """Make rows ``ids`` visible an hour ago, so they lead the next pick."""
    earlier = {
        "postgresql": "now() - interval '1 hour'",
        "mariadb": "UTC_TIMESTAMP(6) - INTERVAL 1 HOUR",
        "sqlite": "'2000-01-01 00:00:00.000'",
    }[db.kind]
    listed = ", ".join(str(i) for i in ids)
    db.execute(
        f"UPDATE {db.qualified('jobs')} SET dbt_visible_at = {earlier} WHERE id IN ({listed})"
    )


def test_an_expired_claim_is_claimed_again_in_halves(db: TestDatabase) -> None:
    make_jobs(db, 6)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        first = source.claim(limit=10, token="a" * 32, worker="A", visibility=0.2)
        assert len(first) == 6
        wait_until_expired(source, 6)
        db.execute(
            f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (7, 'new'), (8, 'new')"
        )
        age(db, [7, 8])

        # Fresh rows lead: they are claimed, the expired ones are left in the pick.
        b = source.claim_batch(limit=10, token="b" * 32, worker="B", visibility=30)
        assert sorted(r.key for r in b.rows) == [(7,), (8,)]
        assert (b.more, b.bisected) == (True, None)

        # The expired claim leads now: half of it, on the attempt it had (an
        # expiry shared by several rows is nobody's: its attempt is given back).
        c = source.claim_batch(limit=10, token="c" * 32, worker="C", visibility=0.2)
        assert c.bisected == (6, 3)
        assert [(r.attempt, r.isolated) for r in c.rows] == [(1, False)] * 3
        # The other half waits as a group and is claimed whole, alone.
        d = source.claim_batch(limit=10, token="d" * 32, worker="D", visibility=30)
        assert len(d.rows) == 3
        assert d.bisected is None
        assert {r.key for r in c.rows} | {r.key for r in d.rows} == {r.key for r in first}
        table = rows(db)
        assert {table[r.key[0]]["dbt_claim_token"] for r in d.rows} == {"d" * 32}

        # C's three rows expire: two of them, then the third as its own group.
        wait_until_expired(source, 3)
        e = source.claim_batch(limit=10, token="e" * 32, worker="E", visibility=0.2)
        assert (len(e.rows), e.bisected) == (2, (3, 2))
        f = source.claim_batch(limit=10, token="f" * 32, worker="F", visibility=30)
        assert [(r.attempt, r.isolated) for r in f.rows] == [(1, False)]

        # E's two rows expire: one, then the other; a claim of one row that
        # expires isolates its row, and that expiry counts.
        wait_until_expired(source, 2)
        g = source.claim_batch(limit=10, token="g" * 32, worker="G", visibility=0.2)
        assert (len(g.rows), g.bisected) == (1, (2, 1))
        source.claim_batch(limit=10, token="h" * 32, worker="H", visibility=30)
        wait_until_expired(source, 1)
        i = source.claim_batch(limit=10, token="i" * 32, worker="I", visibility=30)
        assert [(r.key, r.attempt, r.isolated) for r in i.rows] == [(g.rows[0].key, 2, True)]
    finally:
        source.close()


def test_only_an_isolated_row_goes_dead_for_expiring(db: TestDatabase) -> None:
    """A row in a half is handled (its shared expiry costs it no attempt); an
    isolated one with its attempts used up is dead without a handler call."""
    make_jobs(db, 2)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    q = QueueTrigger(name="jobs", source=source, batch_size=10, max_attempts=1)
    called: list[Any] = []
    try:
        source.claim(limit=10, token="a" * 32, worker="A", visibility=0.2)
        wait_until_expired(source, 2)
        # Row 1 or 2 is claimed as half of the expired claim (attempt 1 again,
        # the shared expiry given back): handled, done.
        result = q.tick_result(lambda events: called.extend(e.pk["id"] for e in events))
        assert (result.rows, result.dead, result.more) == (1, 0, True)
        # The other half, claimed as a group of one, expires: isolated, dead.
        source.claim(limit=10, token="b" * 32, worker="B", visibility=0.2)
        wait_until_expired(source, 1)
        result = q.tick_result(lambda events: called.extend(e.pk["id"] for e in events))
        assert (result.rows, result.dead) == (0, 1)
        assert len(called) == 1
        dead = [r for r in rows(db).values() if r["dbt_status"] == "dead"]
        assert len(dead) == 1
        assert dead[0]["dbt_attempts"] == 2  # the expiry alone counted, the shared one not
        assert dead[0]["dbt_last_error"].startswith("claim expired 1 times without an outcome")
        assert "isolated as a single row" in dead[0]["dbt_last_error"]
    finally:
        source.close()


def test_sidecar_claims_are_bisected_too(db: TestDatabase, tmp_path: Path) -> None:
    """Sidecar mode claims from the claims table with the same statements."""
    db.execute(
        f"CREATE TABLE {db.qualified('items')} (id integer PRIMARY KEY, version bigint NOT NULL)"
    )
    db.execute(
        f"INSERT INTO {db.qualified('items')} VALUES (:i, :i)", [{"i": i} for i in range(1, 5)]
    )
    source = ClaimSource(
        url=db.url,
        table="items",
        schema=db.schema,
        pk_columns=["id"],
        mode="sidecar",
        cursor_column="version",
    )
    install = ["--url", db.url, "--table", "items", "--mode", "sidecar", "--yes"]
    assert (
        main(["queue", "install", *install, *(["--schema", db.schema] if db.schema else [])]) == 0
    )
    feeder = SidecarFeeder(
        name="items-feeder", source=source, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    try:
        assert feeder.drain() == 4
        assert len(source.claim(limit=10, token="a" * 32, worker="A", visibility=0.2)) == 4
        wait_until_expired(source, 4)
        half = source.claim_batch(limit=10, token="b" * 32, worker="B", visibility=30)
        assert (len(half.rows), half.bisected) == (2, (4, 2))
        assert {r.pk["id"] for r in half.rows} < {1, 2, 3, 4}
        rest = source.claim_batch(limit=10, token="c" * 32, worker="C", visibility=30)
        assert {r.pk["id"] for r in [*half.rows, *rest.rows]} == {1, 2, 3, 4}
    finally:
        feeder.close()
        source.close()


def blocked_by(db: TestDatabase, holder: sa.Connection) -> Callable[[], bool]:
    """Whether a statement of another session waits for a row lock ``holder`` holds
    (MariaDB: any lock wait on the test's own ``jobs`` table)."""
    admin = admin_engine(db.kind)
    if db.kind == "postgresql":
        pid = holder.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        sql = "SELECT count(*) FROM pg_stat_activity WHERE :h = ANY(pg_blocking_pids(pid))"
        params: dict[str, Any] = {"h": pid}
    else:
        sql = (
            "SELECT count(*) FROM information_schema.INNODB_TRX "
            "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE :h"
        )
        params = {"h": f"%{db.qualified('jobs')}%"}

    def blocked() -> bool:
        with admin.connect() as conn:
            return bool(conn.execute(sa.text(sql), params).scalar())

    return blocked


def test_a_claim_seeing_part_of_an_expired_claim_isolates_no_row(server_db: TestDatabase) -> None:
    """Two workers claim at once when a claim of rows 1 and 2 has expired: one
    pick locks row 2 first, the other skips it and sees row 1 alone. Row 1
    never expired alone and its handler was never called since; it must not be
    taken for isolated and go dead (it did, with attempt 2 > max_attempts 1:
    the chaos test's innocent row 1 ending dead). The claim waits for the whole
    group instead, then halves it. (On the servers: SQLite's claims take the
    write lock one at a time, so no pick sees part of a group there.)"""
    db = server_db
    make_jobs(db, 2)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    q = QueueTrigger(name="jobs", source=source, batch_size=10, max_attempts=1)
    called: list[int] = []
    results: list[Any] = []
    try:
        source.claim(limit=10, token="a" * 32, worker="A", visibility=0.2)
        wait_until_expired(source, 2)
        with db.engine.connect() as other:
            other.begin()  # the other worker's pick, holding row 2
            other.execute(sa.text(f"SELECT id FROM {db.qualified('jobs')} WHERE id = 2 FOR UPDATE"))
            blocked = blocked_by(db, other)
            tick = threading.Thread(
                target=lambda: results.append(
                    q.tick_result(lambda events: called.extend(e.pk["id"] for e in events))
                )
            )
            tick.start()
            deadline = time.monotonic() + 30
            while tick.is_alive() and not blocked():
                assert time.monotonic() < deadline, "the claim neither ended nor waited"
                time.sleep(0.2)  # MariaDB refreshes INNODB_TRX only if unread for 0.1 s
            other.rollback()
        tick.join(30)
        assert results, "the tick did not end"
        for _ in range(3):  # the other half, claimed whole
            q.tick_result(lambda events: called.extend(e.pk["id"] for e in events))
        table = rows(db)
        assert {k: r["dbt_status"] for k, r in table.items()} == {1: "done", 2: "done"}, table
        assert sorted(called) == [1, 2]
        assert (results[0].rows, results[0].dead) == (1, 0)  # half of the group: row 1
    finally:
        source.close()
