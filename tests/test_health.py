"""The health check: one state read plus the source's pending count, judged stale only
when the last success is old *and* rows are waiting; errors become answers."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.storage.blob import BlobServiceClient

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cursor import Position
from dbtrigger.faults import Fault, FaultPlan, FaultyStore
from dbtrigger.health import ERROR, NO_STATE, OK, STALE, UNKNOWN, check_health, measure_lag
from dbtrigger.sources.visibility import SafetyWindow
from dbtrigger.state.stores.factory import open_store
from dbtrigger.testing import CountingStore
from tests.azurite import KEY, Azurite
from tests.databases import TestDatabase

LIMIT = 600.0


def later(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)


def seq_source(db: TestDatabase, rows: int) -> SqlAlchemySource:
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
        schema=db.schema,
    )
    metadata.create_all(db.engine)
    if rows:
        with db.engine.begin() as conn:
            conn.execute(table.insert(), [{"id": i, "seq": i} for i in range(1, rows + 1)])
    return SqlAlchemySource(
        url=db.url, table="events", schema=db.schema, cursor_column="seq", pk_columns=["id"]
    )


@pytest.fixture
def source(sqlite_db: TestDatabase) -> Iterator[SqlAlchemySource]:
    src = seq_source(sqlite_db, 25)
    yield src
    src.close()


def ignore(events: list[RowChange]) -> None:
    del events


def test_no_state_yet(source: SqlAlchemySource, tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    report = check_health(store, "orders")
    assert (report.status, report.healthy, report.http_status) == (UNKNOWN, False, 503)
    assert "no state document for poller 'orders'" in report.reason
    assert report.pending_rows is None

    report = check_health(store, "orders", source=source)
    assert (report.status, report.http_status, report.pending_rows) == (UNKNOWN, 503, 25)
    assert "no state document for poller 'orders'" in report.reason
    assert "25 rows are pending" in report.reason


def test_unknown_poller_is_unhealthy_and_names_the_known_ones(
    source: SqlAlchemySource, tmp_path: Path
) -> None:
    store = FileCheckpointStore(tmp_path)
    PollTrigger(name="orders", source=source, checkpoint_store=store).tick(ignore)
    report = check_health(store, "ordres")  # a typo in the probe's configuration
    assert (report.status, report.healthy, report.http_status) == (UNKNOWN, False, 503)
    assert "pollers in the store: orders" in report.reason
    # The same typo with a source whose table has rows: a name, not a slow poller.
    typo = check_health(store, "ordres", source=source)
    assert (typo.status, typo.http_status) == (UNKNOWN, 503)
    assert "pollers in the store: orders" in typo.reason
    assert check_health(store, "orders").healthy


def test_no_state_with_an_empty_source_is_healthy(pg: TestDatabase, tmp_path: Path) -> None:
    empty = seq_source_on(pg)
    with pg.engine.begin() as conn:
        conn.execute(sa.text(f'DELETE FROM "{pg.schema}"."{empty.describe()["table"]}"'))
    report = check_health(FileCheckpointStore(tmp_path), "fresh", source=empty)
    assert (report.status, report.healthy, report.pending_rows) == (NO_STATE, True, 0)


def test_stale_only_while_rows_are_pending(source: SqlAlchemySource, tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=10, max_batches_per_tick=1
    )
    trigger.tick(ignore)

    fresh = check_health(store, "orders", source=source, stale_after_seconds=LIMIT)
    assert (fresh.status, fresh.pending_rows, fresh.http_status) == (OK, 15, 200)
    assert fresh.seconds_since_success is not None
    assert fresh.seconds_since_success < LIMIT

    old = check_health(store, "orders", source=source, stale_after_seconds=LIMIT, now=later(900))
    assert (old.status, old.healthy, old.http_status) == (STALE, False, 503)
    assert "15 rows are pending" in old.reason
    assert old.seconds_since_success is not None
    assert old.seconds_since_success >= 900
    hours = check_health(store, "orders", source=source, now=later(12300))
    assert hours.reason.startswith("no successful commit for 3h 25m (limit ")  # not "12300s"

    trigger.drain(ignore)
    quiet = check_health(store, "orders", source=source, stale_after_seconds=LIMIT, now=later(9e5))
    assert (quiet.status, quiet.pending_rows, quiet.lag_seconds) == (OK, 0, 0.0)
    assert quiet.reason == "caught up"


def test_without_a_source_a_recorded_failure_stands_for_pending_rows(
    source: SqlAlchemySource, tmp_path: Path
) -> None:
    store = FileCheckpointStore(tmp_path)
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=10, max_batches_per_tick=1
    )
    trigger.tick(ignore)
    assert check_health(store, "orders", now=later(900)).status == OK

    def broken(events: list[RowChange]) -> None:
        raise RuntimeError("sink down")

    with pytest.raises(Exception, match="sink down"):
        trigger.tick(broken)
    report = check_health(store, "orders", stale_after_seconds=LIMIT, now=later(900))
    assert (report.status, report.failing_attempts) == (STALE, 1)
    assert "batch failed 1 times" in report.reason
    assert check_health(store, "orders", stale_after_seconds=LIMIT).status == OK


def test_costs_one_state_read(source: SqlAlchemySource, tmp_path: Path) -> None:
    store = CountingStore(FileCheckpointStore(tmp_path))
    PollTrigger(name="orders", source=source, checkpoint_store=store).tick(ignore)
    store.reset()
    check_health(store, "orders", source=source)
    assert (store.counts.reads, store.counts.writes, store.counts.lists) == (1, 0, 0)


def test_report_is_json_for_a_probe(source: SqlAlchemySource, tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    PollTrigger(name="orders", source=source, checkpoint_store=store).tick(ignore)
    body = json.loads(check_health(store, "orders", source=source).to_json())
    assert body["status"] == OK
    assert body["healthy"] is True
    assert body["pending_rows"] == 0
    assert body["last_success_at"].endswith("Z")
    assert body["lease"].startswith("released by")


def test_errors_are_answers_not_exceptions(source: SqlAlchemySource, tmp_path: Path) -> None:
    plan = FaultPlan()
    plan.add("read", Fault.UNAVAILABLE)
    store = FaultyStore(FileCheckpointStore(tmp_path), plan)
    report = check_health(store, "orders", source=source)
    assert (report.status, report.http_status) == (ERROR, 503)
    assert report.reason.startswith("StoreUnavailableError")


@pytest.mark.postgresql
def test_lag_seconds_from_the_oldest_pending_row(pg: TestDatabase, tmp_path: Path) -> None:
    metadata = sa.MetaData()
    table = sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        schema=pg.schema,
    )
    metadata.create_all(pg.engine)
    now = dt.datetime.now(dt.timezone.utc)
    with pg.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "updated_at": now - dt.timedelta(seconds=500 - i)} for i in range(1, 6)],
        )
    source = SqlAlchemySource(
        url=pg.url,
        table="orders",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",  # other sessions on the shared server must not hold rows back
    )
    guarded = SqlAlchemySource(
        url=pg.url,
        table="orders",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility=SafetyWindow(3600),  # every row is younger than the window
    )
    try:
        held = measure_lag(guarded, Position(), now)
        assert (held.rows, held.seconds) == (5, None)
        assert "visibility guard" in held.note
        store = FileCheckpointStore(tmp_path)
        trigger = PollTrigger(
            name="orders",
            source=source,
            checkpoint_store=store,
            batch_size=2,
            max_batches_per_tick=1,
        )
        trigger.tick(ignore)
        lag = measure_lag(source, trigger.read_state().position, now)  # type: ignore[union-attr]
        assert lag.rows == 3
        assert lag.seconds == pytest.approx(497, abs=0.01)  # row 3 is the oldest pending
        report = check_health(store, "orders", source=source, now=now)
        assert report.lag_seconds == pytest.approx(497, abs=0.01)
        counter = seq_source_on(pg)
        try:
            untimed = measure_lag(counter, Position(0, {"id": 0}), now)
        finally:
            counter.close()
        assert (untimed.rows, untimed.seconds, untimed.basis) == (1, None, "observed")
        assert "declare lag_column=" in untimed.note
    finally:
        source.close()
        guarded.close()


def seq_source_on(db: TestDatabase) -> SqlAlchemySource:
    """A source over an integer cursor: lag in seconds cannot be known."""
    name = f"seq_{uuid.uuid4().hex[:6]}"
    with db.engine.begin() as conn:
        conn.execute(sa.text(f'CREATE TABLE "{db.schema}"."{name}" (id int primary key, seq int)'))
        conn.execute(sa.text(f'INSERT INTO "{db.schema}"."{name}" VALUES (9, 9)'))
    return SqlAlchemySource(
        url=db.url,
        table=name,
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",
    )


@pytest.mark.azurite
def test_refused_credentials_are_reported_without_the_key(azurite: Azurite) -> None:
    container = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    try:
        bad = azurite.connection_string.replace(KEY, "QmFkS2V5QmFkS2V5QmFkS2V5QmFkS2V5QmFkS2V5")
        store = open_store(bad, app="shop", container=container)
        report = check_health(store, "orders")
        assert (report.status, report.http_status) == (ERROR, 503)
        assert report.reason.startswith("StoreAuthError")
        assert "QmFkS2V5" not in report.to_json()
        assert KEY not in report.to_json()
        good = open_store(azurite.connection_string, app="shop", container=container)
        assert check_health(good, "orders").status == UNKNOWN
    finally:
        service.delete_container(container)
        service.close()
