"""The poller surfaces what the default visibility guard does, as gauges."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.metrics import InMemoryMetrics
from tests.databases import TestDatabase


@pytest.mark.postgresql
def test_default_guard_holds_back_behind_an_open_transaction_and_says_who(pg: TestDatabase) -> None:
    table = pg.qualified("events")
    pg.execute(
        f"CREATE TABLE {table} (id bigserial PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT now(), note text)"
    )
    source = SqlAlchemySource(
        url=pg.url, table="events", schema=pg.schema, cursor_column="updated_at", pk_columns=["id"]
    )
    assert source.describe()["visibility"] == "auto"  # the default: protection on
    metrics = InMemoryMetrics()
    trigger = PollTrigger(
        name="events", source=source, checkpoint_store=InMemoryCheckpointStore(), metrics=metrics
    )
    seen: list[int] = []
    blocker = pg.engine.connect()
    try:
        blocker.begin()
        blocker.execute(sa.text(f"INSERT INTO {table} (note) VALUES ('late')"))
        pid = blocker.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        pg.execute(f"INSERT INTO {table} (note) VALUES ('early')")
        # The committed row's cursor is newer than the open transaction's start:
        # consuming it now could skip 'late' forever, so the guard waits.
        assert trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 0
        assert metrics.gauge("visibility_held_back") == 1.0
        assert metrics.gauge("visibility_blocking_pid") == float(pid)
        blocker.commit()
    finally:
        blocker.close()
    assert trigger.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 2
    assert sorted(seen) == [1, 2]
    assert metrics.gauge("visibility_held_back") == 0.0
