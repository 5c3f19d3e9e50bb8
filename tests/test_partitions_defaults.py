"""A partitioned member at its defaults, as `dbtrigger run` drives it: what its
progress line counts, and what it says when one batch hangs."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.runtime.progress import DrainProgress, Tracker
from tests.databases import TestDatabase


def orders(db: TestDatabase, rows: int) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, updated_at timestamptz NOT NULL)")
    db.execute(f"INSERT INTO {table} SELECT i, now() FROM generate_series(1, {rows}) i")


def member(db: TestDatabase, state: Path, **options: object) -> PartitionedPoller:
    return PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=db.url, table="orders", schema=db.schema,
            cursor_column="updated_at", pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(state),
        **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_members_progress_line_counts_the_rows_behind_its_partitions(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """The worker's progress line said 'an unknown number behind' for every
    partitioned member, while a plain poller's says 'about N behind' and an ETA."""
    orders(pg, 3000)
    poller = member(pg, tmp_path / "state")
    delivered: list[int] = []
    try:
        assert poller.rows_behind() is None  # owns nothing before its first round
        while not delivered:  # the first round may be held back by the visibility guard
            poller.tick(lambda events: delivered.extend(e.pk["id"] for e in events))
        assert len(poller.owned) == 12
        # An estimate (rows after the furthest-behind checkpoint, times the share
        # of the buckets held: all of them here), never below what waits.
        behind = poller.rows_behind()
        assert behind is not None
        assert 3000 - len(delivered) <= behind <= 3000
        lines: list[DrainProgress] = []
        Tracker(poller, lines.append, 0.0, len(delivered))
        assert f"about {lines[0].behind:,} behind" in lines[0].describe()
    finally:
        poller.leave()
        poller.close()


def test_a_hung_batch_names_the_partitions_waiting_behind_it(
    pg: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that never returns holds its partition's lease (by design: no
    timeout by default), and the member's round holds every other partition it
    owns with it: the others see it heartbeat and take none of them. Only the
    hung partition's own batch was named; a third of the table waited unsaid.
    (lease_ttl_seconds is lowered from 120 s so the test does not wait two minutes.)"""
    orders(pg, 400)
    release = threading.Event()
    poller = member(pg, tmp_path / "state", lease_ttl_seconds=2)

    def hang(events: list[RowChange]) -> None:
        release.wait(30)

    def work() -> None:
        while not release.is_set():  # the first round may be held back by the visibility guard
            poller.tick(hang)

    worker = threading.Thread(target=work, daemon=True)
    caplog.set_level(logging.WARNING, logger="dbtrigger.partitions")
    try:
        worker.start()
        deadline = time.monotonic() + 20
        said = []
        while not said and time.monotonic() < deadline:
            said = [r for r in caplog.records if getattr(r, "event", "") == "partitions_waiting"]
            release.wait(0.05)
        assert said, "no WARNING named the partitions waiting behind the hung batch"
        record = said[0]
        assert record.levelno == logging.WARNING
        hung = record.partition  # type: ignore[attr-defined]
        assert set(record.partitions) == set(poller.owned) - {hung}  # type: ignore[attr-defined]
        assert len(record.partitions) == 11  # type: ignore[attr-defined]
        assert "handler_timeout_seconds" in record.getMessage()
    finally:
        release.set()
        worker.join(30)
        poller.leave()
        poller.close()


class Clock:
    """A monotonic clock the test moves by hand (the members' liveness clock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_partition_stolen_from_a_member_before_it_was_declared_dead_is_fenced(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Workers restarted after a crash (kill -9 mid-batch, an OOM kill) steal the
    dead members' partitions one per cycle before the member TTL declares them
    dead. The new owner fenced out a dead member's lease only on partitions it
    took in the very cycle that declared the death, so a partition stolen a
    cycle earlier waited for that lease's own TTL (120 s): the restarted group
    took 130 s for a 20k-row backlog it drains in 25 s, the tick lines saying
    'committed' all along. Every other setting is the default."""
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    sqlite_db.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300) "
        "INSERT INTO orders SELECT i, i FROM n"
    )
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()

    def make(name: str) -> PartitionedPoller:
        return PartitionedPoller(
            name="orders",
            source=SqlAlchemySource(url=sqlite_db.url, table="orders", cursor_column="seq",
                                    pk_columns=["id"]),
            checkpoint_store=store,
            partitions=2,
            member_id=name,
            monotonic=clock,
            background=False,  # the test moves the clock and balances by hand
        )  # fmt: skip

    a, b = make("a"), make("b")
    for _ in range(4):  # a forms the group alone, owns both and holds them a few beats
        a.balance()
        clock.now += 0.6
    assert a.owned == ("p000-128", "p128-256")
    entered, release = threading.Event(), threading.Event()
    seen: set[int] = set()

    def a_hangs(events: list[RowChange], ctx: object) -> None:
        if str(getattr(ctx, "poller_name", "")).endswith("p000-128"):
            entered.set()
            release.wait(30)  # killed mid-batch: a beats no more, its lease stays live
        else:
            seen.update(e.pk["id"] for e in events)

    caplog.set_level(logging.WARNING, logger="dbtrigger.partitions")

    def a_runs() -> None:
        a.drain(a_hangs)  # goes on without the partition taken over (no LostLeaseError)

    crashed = threading.Thread(target=a_runs, daemon=True)
    crashed.start()
    try:
        assert entered.wait(20)
        b.balance()  # b joins and steals from a, which still looks alive
        assert b.owned == ("p000-128",)
        clock.now += 11  # past the member TTL on b's clock: b declares a dead
        b.balance()
        assert b.owned == ("p000-128", "p128-256")
        deadline = time.monotonic() + 10
        while len(seen) < 300 and time.monotonic() < deadline:
            b.tick(lambda events: seen.update(e.pk["id"] for e in events))
        assert len(seen) == 300, f"{300 - len(seen)} rows still wait behind a dead member's lease"
    finally:
        release.set()
        crashed.join(30)
        b.close()
        a.close()
    # its commit, once it woke, was fenced out
    refused = [r for r in caplog.records if getattr(r, "event", "") == "partition_taken_over"]
    assert refused, "the stalled member's commit of its batch in flight was not refused"
    assert getattr(refused[0], "partition", None) == "p000-128"
