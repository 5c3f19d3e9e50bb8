"""Partitioned workers as a new user meets them: ``dbtrigger run`` at defaults, the
cases people hit first (a paused member, a partition key that changes, skewed keys).

Outcomes only, each waited for with a bound: every row's latest state is delivered,
no partition's checkpoint moves back, per key the deliveries come in cursor order,
and the only repeats are what the docs allow (a stalled member's batch in flight).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.errors import DbTriggerError
from dbtrigger.partitions import PartitionedPoller
from tests.databases import TestDatabase
from tests.test_partitions_processes import Workers, fair, wait_for


def per_key_in_order(workers: Workers) -> list[str]:
    """Within each process's output, a key's cursors never go down."""
    bad = []
    for path in workers.out.glob("*.out"):
        last: dict[int, int] = {}
        for line in path.read_text().splitlines():
            key, _, seq = line.partition(",")
            if not seq:
                continue
            k, s = int(key), int(seq)
            if s < last.get(k, 0):
                bad.append(f"{path.name}: key {k} {last[k]} then {s}")
            last[k] = s
    return bad


@pytest.mark.postgresql
@pytest.mark.slow
def test_a_member_paused_past_its_ttl_commits_nothing_after_the_others_took_over(
    pg: TestDatabase, tmp_path: Path
) -> None:
    rows = 3000
    table = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)")
    pg.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, {rows}) g")
    (tmp_path / "state").mkdir()
    workers = Workers(pg, str(tmp_path / "state"), tmp_path)
    workers.env["DBT_SCALEOUT_HANDLER_MS"] = "3"
    regressions: list[str] = []
    done = threading.Event()

    def watch() -> None:
        seen: dict[str, int] = {}
        while not done.is_set():
            for key, cursor in workers.checkpoints().items():
                if cursor < seen.get(key, 0):
                    regressions.append(f"{key}: {seen[key]} -> {cursor}")
                seen[key] = max(cursor, seen.get(key, 0))
            done.wait(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for name in ("w1", "w2", "w3"):
            workers.start(name)
        wait_for("three fair shares", lambda: workers.shares() == fair(3), 90, workers.show)
        wait_for("w1 to deliver", lambda: workers.got_work("w1"), 60, workers.show)
        workers.procs["w1"].send_signal(signal.SIGSTOP)
        try:
            wait_for(
                "the paused member's partitions owned by the others",
                lambda: workers.shares() == fair(2),
                90,
                workers.show,
            )
            # the others go on delivering w1's partitions for a while
            time.sleep(2)
        finally:
            workers.procs["w1"].send_signal(signal.SIGCONT)
        expected = {(i, i) for i in range(1, rows + 1)}
        wait_for(
            "every row delivered",
            lambda: expected <= set(workers.deliveries()),
            120,
            lambda: f"{len(expected - set(workers.deliveries()))} missing\n{workers.show()}",
        )
        wait_for("w1 back in the group", lambda: len(workers.shares()) == 3, 60, workers.show)
    finally:
        done.set()
        watcher.join()
        workers.stop()
    assert not regressions, regressions
    assert not per_key_in_order(workers)
    twice = sum(n - 1 for n in workers.deliveries().values())
    assert twice <= 100, f"{twice} repeated deliveries"


def _nullable_key_table(db: TestDatabase) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (ext VARCHAR(20) UNIQUE, seq INTEGER NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (ext, seq) VALUES (:ext, :seq)"),
            [{"ext": f"k{i}", "seq": i} for i in range(1, 21)] + [{"ext": None, "seq": 21}],
        )


def _source(db: TestDatabase) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url, table="orders", schema=db.schema, cursor_column="seq", pk_columns=["ext"]
    )


def test_a_null_key_is_refused_as_the_plain_poller_refuses_it(
    db: TestDatabase, tmp_path: Path
) -> None:
    """A NULL key hashes to NULL in SQL: the row was in no partition's range, so
    every partition went past it and it was never delivered, with no error. The
    plain poller refuses such a row (SerializationError, naming it); so must a
    partition."""
    _nullable_key_table(db)
    plain = PollTrigger(
        name="plain", source=_source(db), checkpoint_store=FileCheckpointStore(tmp_path / "a")
    )
    with pytest.raises(DbTriggerError) as plain_error:
        plain.tick(lambda events: None)
    poller = PartitionedPoller(
        name="orders",
        source=_source(db),
        checkpoint_store=FileCheckpointStore(tmp_path / "b"),
        partitions=4,
        join_window_seconds=0,
        background=False,
    )
    seen: list[str] = []
    with pytest.raises(DbTriggerError) as error:
        poller.drain(lambda events: seen.extend(e.pk["ext"] for e in events))
    assert type(error.value) is type(plain_error.value), error.value
