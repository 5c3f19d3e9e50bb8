"""A write that gave up waiting for a lock is not poison: its rows are never dead-lettered.

``OutputLockTimeoutError`` (and every other retryable error: a lost connection, a
foreign key whose row may come later) says nothing about the rows: another
session holds a lock. A batch that failed on one ``max_attempts`` times used to
be bisected; the row behind the lock failed alone and was set aside in the
dead-letter sink while its neighbours passed (a single-row batch went straight
there), and a queue row went ``dead``. Now the batch is retried, loudly, until
the lock is gone, and every row is written. Real databases, default engine
settings; the write's bound is 0.2 s (1 s on MariaDB, whose bound is whole
seconds) so that each attempt ends quickly. SQLite locks a whole file, so its
output table lives in a file of its own there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, PollTrigger, QueueTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import DbTriggerError
from dbtrigger.output import OutputTarget
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.databases import TestDatabase
from tests.test_event_outcomes import Clock
from tests.test_queue_columns import make_jobs, rows


class Sink:
    """The output table ``lk_out`` (ids 1..3, v 0) and another session holding
    the lock on its row 2 (SQLite: the file's write lock)."""

    def __init__(self, db: TestDatabase, tmp_path: Path) -> None:
        if db.kind == "sqlite":
            self.url, self.schema = f"sqlite:///{tmp_path / 'out.db'}", None
            self.engine = sa.create_engine(self.url)
            self.name = "lk_out"
        else:
            self.url, self.schema, self.engine = db.url, db.schema, db.engine
            self.name = db.qualified("lk_out")
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {self.name} (id INTEGER PRIMARY KEY, v INTEGER)")
            conn.exec_driver_sql(f"INSERT INTO {self.name} VALUES (1, 0), (2, 0), (3, 0)")
        self.holder = self.engine.connect()
        self.holder.begin()
        self.holder.exec_driver_sql(f"UPDATE {self.name} SET v = 9 WHERE id = 2")
        self.target = OutputTarget(
            url=self.url,
            table="lk_out",
            schema=self.schema,
            action="upsert",
            conflict_columns=["id"],
            lock_timeout_seconds=0.2,
        )

    def write(self, events: list[RowChange]) -> None:
        self.target.write([{"id": e.pk["id"], "v": 7} for e in events])

    def release(self) -> None:
        if not self.holder.closed:
            self.holder.rollback()
            self.holder.close()

    def values(self) -> dict[int, int]:
        with self.engine.connect() as conn:
            got = conn.exec_driver_sql(f"SELECT id, v FROM {self.name}").fetchall()
        return {int(i): int(v) for i, v in got}

    def close(self) -> None:
        self.release()
        self.target.close()
        if self.engine is not None and self.url.startswith("sqlite"):
            self.engine.dispose()


@pytest.fixture
def sink(db: TestDatabase, tmp_path: Path) -> Any:
    made = Sink(db, tmp_path)
    yield made
    made.close()


@pytest.fixture
def source(db: TestDatabase) -> Iterator[SqlAlchemySource]:
    """Three rows polled without a visibility guard (the lock holder's open
    transaction would hold the poller back)."""
    db.execute(f"CREATE TABLE {db.qualified('lk_src')} (id INTEGER PRIMARY KEY, seq INTEGER)")
    db.execute(f"INSERT INTO {db.qualified('lk_src')} VALUES (1, 1), (2, 2), (3, 3)")
    made = SqlAlchemySource(
        url=db.url,
        table="lk_src",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",
    )
    yield made
    made.close()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_poll_batch_behind_a_lock_is_retried_not_dead_lettered(
    source: SqlAlchemySource, sink: Sink, tmp_path: Path, batch_size: int
) -> None:
    dead_letters = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    poller = PollTrigger(
        name="lk",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=batch_size,
        max_attempts=2,
        quarantine=dead_letters,
    )
    try:
        failures = 0
        for _ in range(8):  # well past max_attempts, bisection included
            try:
                poller.tick(sink.write)
            except DbTriggerError:
                failures += 1
        assert failures >= 2
        assert dead_letters.records() == [], "a lock timeout was dead-lettered as poison"
        assert poller.read_state().position.cursor != 3
        sink.release()
        poller.drain(sink.write)
        assert sink.values() == {1: 7, 2: 7, 3: 7}
        assert dead_letters.records() == []
    finally:
        poller.close()


def test_a_queue_row_behind_a_lock_is_retried_not_dead(
    db: TestDatabase, sink: Sink, tmp_path: Path
) -> None:
    make_jobs(db, 3)
    dead_letters = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(
        name="jobs",
        source=source,
        batch_size=1,
        max_attempts=2,
        retry_delay_seconds=0.0,
        retry_delay_max_seconds=0.0,
        quarantine=dead_letters,
        seed=1,
    )
    try:
        for _ in range(8):  # row 2 is claimed, fails and comes back, well past max_attempts
            queue.tick(sink.write)
        assert dead_letters.records() == [], "a lock timeout was dead-lettered as poison"
        assert rows(db)[2]["dbt_status"] != "dead", rows(db)[2]
        sink.release()
        queue.drain(sink.write)
        assert sink.values() == {1: 7, 2: 7, 3: 7}
        assert {r["dbt_status"] for r in rows(db).values()} <= {"done"}
    finally:
        queue.close()
        source.close()


def test_a_fanout_subscriber_behind_a_lock_gives_up_on_nothing(
    source: SqlAlchemySource, sink: Sink, tmp_path: Path
) -> None:
    """A subscriber whose write waits behind the lock fails its events on every
    attempt: its share is not bisected and nothing is dead-lettered in its name;
    the other subscriber's acceptance stands, and the lock gone, every row is written."""
    dead_letters = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    seen: list[int] = []
    clock = Clock()

    def other(events: list[RowChange]) -> None:
        seen.extend(e.pk["id"] for e in events)

    poller = PollTrigger(
        name="lk",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        max_attempts=2,
        quarantine=dead_letters,
        subscribers={"out": sink.write, "other": other},
        clock=clock,
    )
    try:
        for _ in range(6):  # well past max_attempts
            with contextlib.suppress(DbTriggerError):
                poller.tick()
            clock.advance(100)  # past the retry's backoff
        assert dead_letters.records() == [], "a lock timeout was dead-lettered as poison"
        sink.release()
        poller.drain()
        assert sink.values() == {1: 7, 2: 7, 3: 7}
        assert dead_letters.records() == []
        assert sorted(set(seen)) == [1, 2, 3]
    finally:
        poller.close()
