"""Rows committed past a guard's bound that a full batch reached do not wait an interval.

A full batch keeps the visibility guard's bound (it stays valid), so the next
fetch reads with it. When that batch ended exactly at the bound (the rows
between the checkpoint and the bound a multiple of the batch size), the next
fetch found nothing and the tick reported neither rows nor rows held back:
``dbtrigger run`` then slept its whole interval while the rows committed
meanwhile waited (commit -> handler latency, issue #26; it happened about
once in a hundred drains of a busy table, on both servers, both sources).
Now the guard looks again when its checkpoint has reached the bound: the rows
are delivered at once, or the tick says they are held back (a short wait).

What a tick reports is asserted (what the runner decides its wait by), not a clock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.runtime.runner import Runner
from tests.databases import TestDatabase

BATCH = 100  # the default batch size
INTERVAL = 5.0  # dbtrigger run's default


def create_orders(db: TestDatabase) -> None:
    if db.kind == "postgresql":
        db.execute(
            f"CREATE TABLE {db.qualified('orders')} (id bigserial PRIMARY KEY, "
            "updated_at timestamptz NOT NULL DEFAULT clock_timestamp(), payload text)"
        )
    else:
        db.execute(
            f"CREATE TABLE {db.qualified('orders')} (id bigint AUTO_INCREMENT PRIMARY KEY, "
            "updated_at datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), payload text)"
        )
    db.execute(f"CREATE INDEX orders_cursor ON {db.qualified('orders')} (updated_at, id)")


def insert(db: TestDatabase, rows: int, tag: str) -> None:
    db.execute(
        f"INSERT INTO {db.qualified('orders')} (payload) VALUES (:p)",
        [{"p": tag} for _ in range(rows)],
    )


@pytest.mark.parametrize("source_kind", ["polling", "changelog"])
def test_rows_after_a_full_batch_that_reached_the_bound_do_not_wait_an_interval(
    server_db: TestDatabase, source_kind: str
) -> None:
    db = server_db
    create_orders(db)
    source: Any
    if source_kind == "changelog":
        install(db.engine, "orders", schema=db.schema)
        source = ChangeLogSource(url=db.url, table="orders", schema=db.schema)
    else:
        source = SqlAlchemySource(
            url=db.url,
            table="orders",
            schema=db.schema,
            cursor_column="updated_at",
            pk_columns=["id"],
        )
    assert source.describe()["visibility"] == "auto"  # the default guard
    insert(db, BATCH, "first")
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen: list[str] = []
    batches: list[int] = []

    def handle(events: Sequence[Any]) -> None:
        if not seen:
            # Committed while the first batch is handled: after the guard's bound.
            insert(db, 5, "later")
        seen.extend(str(e.after["payload"]) for e in events)
        batches.append(len(events))

    runner = Runner(trigger, handle, interval_seconds=INTERVAL, progress=None)
    ticks: list[Any] = []

    def record(result: Any) -> None:
        ticks.append(result)
        if len(seen) == BATCH + 5:
            runner.stop()

    runner.on_tick = record
    # Waits of at most half a second: what is asserted is what the ticks report.
    pause = threading.Event()
    runner._idle = lambda seconds: pause.wait(min(seconds, 0.5))  # type: ignore[method-assign]
    try:
        # Bounded: a tick that delivers nothing either says so (the bug) or that the
        # rows are held back (on MariaDB, by any session of the server); a hold
        # longer than 200 ticks fails the test, not hangs it.
        runner.run(max_ticks=200, install_signals=False)
    finally:
        source.close()
    assert seen == ["first"] * BATCH + ["later"] * 5
    assert batches == [BATCH, 5]  # the first batch was full and ended at the bound
    first = next(i for i, tick in enumerate(ticks) if tick.rows)
    # After it, no tick reported an idle table (what makes the worker sleep its
    # interval): each delivered the rows or said they were held back.
    idle = [i for i, tick in enumerate(ticks[first + 1 :]) if not (tick.rows or tick.held_back)]
    assert idle == [], [(t.rows, t.more, t.held_back) for t in ticks]
