"""Whole drains through the public API, on every database."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import (
    FileCheckpointStore,
    HandlerError,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.metrics import InMemoryMetrics
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table


def test_ten_thousand_rows_with_ties_across_batch_boundaries(
    db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(db)
    n = 10_000
    # 37 rows share each cursor value, so ties straddle nearly every batch boundary.
    insert(db, table, [{"id": (i * 7919) % n, "updated_at": naive(i // 37)} for i in range(n)])
    source = SqlAlchemySource(
        url=db.url, table="orders", schema=db.schema, cursor_column="updated_at", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=100,
        max_batches_per_tick=7,
    )
    delivered: list[tuple[object, int]] = []
    batches: list[int] = []

    def handle(events: list[RowChange]) -> None:
        batches.append(len(events))
        delivered.extend((e.cursor, e.pk["id"]) for e in events)

    assert trigger.drain(handle) == n
    assert len(delivered) == n
    assert len({pk for _, pk in delivered}) == n, "a row was delivered twice"
    assert delivered == sorted(delivered), "not in (cursor, pk) order"
    assert set(batches) == {100}
    assert trigger.tick(handle) == 0  # nothing left, nothing redelivered
    state = trigger.read_state()
    assert state is not None
    assert state.lease is not None
    assert state.lease.released
    assert state.position.pk == {"id": delivered[-1][1]}


def test_new_rows_after_a_drain_are_picked_up(sqlite_db: TestDatabase) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(5)])
    source = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen: list[int] = []
    assert trigger.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 5
    insert(sqlite_db, table, [{"id": 100, "updated_at": naive(50)}])
    with sqlite_db.engine.begin() as conn:  # an update moves a row past the checkpoint
        conn.execute(table.update().where(table.c.id == 2).values(updated_at=naive(60)))
    assert trigger.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 2
    assert seen == [0, 1, 2, 3, 4, 100, 2]


def test_no_secret_reaches_logs_state_or_fingerprint(
    pg: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "Sup3r-S3cret-Pa55"  # noqa: S105 - a planted secret to look for
    url = sa.make_url(pg.url).set(password=secret).render_as_string(hide_password=False)
    assert secret in url  # trust auth accepts any password, so the URL works
    table = orders_table(pg)
    insert(pg, table, [{"id": i, "updated_at": naive(i)} for i in range(30)])
    source = SqlAlchemySource(
        url=url, table="orders", schema=pg.schema, cursor_column="updated_at", pk_columns=["id"]
    )
    store = FileCheckpointStore(tmp_path / "state")
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=10, max_batches_per_tick=2
    )
    calls = {"n": 0}

    def flaky(events: list[RowChange]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("downstream refused")

    with caplog.at_level(logging.DEBUG):
        with pytest.raises(HandlerError):
            trigger.tick(flaky)  # first batch commits, the second fails
        assert trigger.drain(flaky) == 20
        bad = SqlAlchemySource(
            url=url.replace("127.0.0.1:5432", "127.0.0.1:1"),
            table="orders",
            cursor_column="updated_at",
            pk_columns=["id"],
        )
        with pytest.raises(Exception, match="fetch from") as info:
            PollTrigger(name="bad", source=bad, checkpoint_store=store).tick(flaky)
        assert secret not in str(info.value)
    assert calls["n"] >= 3
    for record in caplog.records:
        assert secret not in record.getMessage()
        assert secret not in json.dumps(record.__dict__, default=str)
    for path in (tmp_path / "state").iterdir():
        assert secret not in path.read_text()
    assert secret not in source.fingerprint()
    assert secret not in str(source.describe())


def test_commit_metrics_are_reported(sqlite_db: TestDatabase) -> None:
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    metadata.create_all(sqlite_db.engine)
    insert(sqlite_db, table, [{"id": i, "seq": i} for i in range(3)])
    metrics = InMemoryMetrics()
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    trigger = PollTrigger(
        name="events",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="events", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=InMemoryCheckpointStore(),
        metrics=metrics,
        clock=lambda: now,
    )
    assert trigger.tick(lambda events: None) == 3
    assert metrics.total("events_total") == 3
    assert metrics.total("batches_total", result="committed") == 1
    assert metrics.gauge("last_success_timestamp") == now.timestamp()
