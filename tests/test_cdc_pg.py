"""PgLogicalSource in poll mode, end to end on a private wal_level=logical server."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import UNCHANGED, PgLogicalSource
from dbtrigger.cdc.pgoutput import parse_lsn
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import (
    DecodeBacklogError,
    FetchError,
    LeaseAcquireError,
    SchemaChangedError,
    ServerSettingError,
    SlotLostError,
    SourceDefinitionError,
    SourcePermissionError,
)
from dbtrigger.sources.base import position_of
from tests.cdc_servers import CdcDatabase, LogicalPostgres, drop_slot
from tests.databases import TestDatabase

#: Slots are cluster-wide: another test (or a benchmark run) may hold one on this server.
OWN_SLOTS_COUNT = "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def poller(db: CdcDatabase, tables: list[str], **kw: Any) -> tuple[PollTrigger, PgLogicalSource]:
    kw.setdefault("snapshot", "never")
    source = PgLogicalSource(db.url, tables, **kw)
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=50,
        max_batches_per_tick=100,
        retry=RetryPolicy.none(),
    )
    return trigger, source


def drain(trigger: PollTrigger) -> list[RowChange]:
    got: list[RowChange] = []
    trigger.drain(got.extend)
    return got


def slot_row(db: CdcDatabase, slot: str) -> tuple[int, int]:
    with db.connect() as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None
    return parse_lsn(row[0]), parse_lsn(row[1])


def flush_lsn(db: CdcDatabase) -> int:
    return parse_lsn(db.scalar("SELECT pg_current_wal_flush_lsn()::text"))


def test_a_poller_gets_every_change_with_its_images(cdc_db: CdcDatabase) -> None:
    cdc_db.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, status text, doc text, amount numeric);"
        "ALTER TABLE orders ALTER COLUMN doc SET STORAGE EXTERNAL;"
        "CREATE TABLE audit (k int, v text); ALTER TABLE audit REPLICA IDENTITY FULL"
    )
    trigger, source = poller(cdc_db, ["orders", "public.audit"])
    assert drain(trigger) == []  # first use: publication, slot and control row are created
    assert source.slot == source.publication == trigger.name.replace("p_", "dbtrigger_p_")
    big = "x" * 5000
    with cdc_db.connect() as conn:
        conn.execute(
            "INSERT INTO orders VALUES (1, 'new', %s, 9.50), (2, 'new', 'small', NULL)", (big,)
        )
        conn.execute("UPDATE orders SET status = 'paid' WHERE id = 1")  # doc stays in TOAST
        conn.execute("UPDATE orders SET id = 3 WHERE id = 2")
        conn.execute("DELETE FROM orders WHERE id = 3")
        conn.execute("INSERT INTO audit VALUES (1, 'a')")
        conn.execute("UPDATE audit SET v = 'b'")
        conn.execute("DELETE FROM audit")
    events = drain(trigger)
    got = [(e.op, e.metadata["table"], dict(e.pk)) for e in events]
    assert got == [
        ("insert", "public.orders", {"id": 1}),
        ("insert", "public.orders", {"id": 2}),
        ("update", "public.orders", {"id": 1}),
        ("update", "public.orders", {"id": 3}),
        ("delete", "public.orders", {"id": 3}),
        ("insert", "public.audit", {}),
        ("update", "public.audit", {}),
        ("delete", "public.audit", {}),
    ]
    insert, _, toast, rekey, delete, _, full_update, full_delete = events
    assert insert.after == {"id": 1, "status": "new", "doc": big, "amount": pytest.approx(9.5)}
    assert toast.after is not None
    assert toast.after["doc"] is UNCHANGED
    assert toast.metadata["unchanged"] == ("doc",)
    assert toast.before is None  # DEFAULT identity, key unchanged: the log has no old row
    assert rekey.before == {"id": 2}
    assert rekey.metadata["before_image"] == "key"
    assert delete.before == {"id": 3}
    assert delete.after is None
    assert full_update.before == {"k": 1, "v": "a"}
    assert full_update.after == {"k": 1, "v": "b"}
    assert full_update.metadata["before_image"] == "full"
    assert full_delete.before == {"k": 1, "v": "b"}
    assert insert.metadata["commit_time"].tzinfo is not None
    assert isinstance(insert.metadata["transaction_id"], int)
    # Released up to the end of the last transaction once its checkpoint landed.
    confirmed, _ = slot_row(cdc_db, source.slot)
    last = position_of(events[-1]).cursor
    assert confirmed > parse_lsn(last.split("#")[0])
    source.close()


def test_a_quiet_table_on_a_busy_server_does_not_pin_wal(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE quiet (id int PRIMARY KEY); CREATE TABLE busy (id int, v text)")
    trigger, source = poller(cdc_db, ["quiet"])
    drain(trigger)
    start, _ = slot_row(cdc_db, source.slot)
    with cdc_db.connect() as conn:
        for i in range(50):
            conn.execute(
                "INSERT INTO busy SELECT g, repeat('v', 200) FROM generate_series(1, 500) g"
            )
            if i % 10 == 0:
                trigger.tick(lambda events: None)
    written = flush_lsn(cdc_db)
    assert trigger.tick(lambda events: None) == 0  # idle: nothing for us
    confirmed, _ = slot_row(cdc_db, source.slot)
    assert confirmed >= written, "an idle tick releases the WAL it read through"
    # The restart point follows at the next running-transactions record (every 15 s, and
    # at each checkpoint): force one, and the next idle tick moves the slot past it.
    cdc_db.execute("CHECKPOINT")
    trigger.tick(lambda events: None)
    confirmed, restart = slot_row(cdc_db, source.slot)
    assert written - start > 4_000_000  # megabytes of WAL that were none of our business
    assert confirmed >= written, "an idle tick releases the WAL it read through"
    assert restart > start, "and the server may recycle it"
    source.close()


def test_an_added_column_just_appears(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, a text)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1, 'x')")
        conn.execute("ALTER TABLE t ADD COLUMN b int DEFAULT 7")
        conn.execute("INSERT INTO t VALUES (2, 'y', 8)")
    events = drain(trigger)
    assert [dict(e.after or {}) for e in events] == [
        {"id": 1, "a": "x"},
        {"id": 2, "a": "y", "b": 8},
    ]
    source.close()


def test_a_type_change_refuses_until_the_new_shape_is_accepted(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, amount int)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1, 10)")
        conn.execute("ALTER TABLE t ALTER COLUMN amount TYPE text")
        conn.execute("INSERT INTO t VALUES (2, 'twenty')")
    delivered: list[RowChange] = []
    with pytest.raises(SchemaChangedError, match=r"column amount of public\.t changed type"):
        trigger.drain(delivered.extend)
    assert [e.pk["id"] for e in delivered] == [1]  # what came before is delivered
    with pytest.raises(SchemaChangedError):  # and it stays refused
        trigger.tick(lambda events: None)
    source.admin().accept_schema()
    restarted = PgLogicalSource(cdc_db.url, ["t"], slot=source.slot, snapshot="never")
    rows = restarted.fetch(position_of(delivered[-1]), 10)  # the acceptance is remembered
    assert [r["after"] for r in rows] == [{"id": 2, "amount": "twenty"}]
    restarted.close()
    assert [e.after for e in drain(trigger)] == [{"id": 2, "amount": "twenty"}]
    source.close()


def test_wal_level_replica_is_refused_with_what_to_change(pg: TestDatabase) -> None:
    pg.execute(f"CREATE TABLE {pg.schema}.t (id int PRIMARY KEY)")
    source = PgLogicalSource(pg.url, [f"{pg.schema}.t"], slot="never_created")
    with pytest.raises(
        ServerSettingError,
        match=r"wal_level is 'replica'.*ALTER SYSTEM SET wal_level = logical.*restart",
    ):
        source.fetch(BEGINNING, 10)
    source.close()


def test_a_role_without_replication_is_refused_with_the_statement(cdc_db: CdcDatabase) -> None:
    role = f"r_{uuid.uuid4().hex[:8]}"
    cdc_db.execute(
        f"CREATE ROLE {role} LOGIN; CREATE TABLE t (id int PRIMARY KEY);"
        f"GRANT CREATE ON SCHEMA public TO {role}"
    )
    try:
        url = cdc_db.url.replace("postgres@", f"{role}@")
        source = PgLogicalSource(url, ["t"], slot="no_replication")
        with pytest.raises(SourcePermissionError, match=f"ALTER ROLE {role} REPLICATION"):
            source.fetch(BEGINNING, 10)
        source.close()
        cdc_db.execute(f"ALTER ROLE {role} REPLICATION")
        source = PgLogicalSource(url, ["t"], slot="not_owner")
        with pytest.raises(
            SourcePermissionError, match=r"owner may publish it.*CREATE PUBLICATION"
        ):
            source.fetch(BEGINNING, 10)
        source.close()
    finally:
        with cdc_db.connect() as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_a_role_that_may_not_create_the_control_table_is_told_the_grant_and_the_sql(
    cdc_db: CdcDatabase,
) -> None:
    role = f"r_{uuid.uuid4().hex[:8]}"
    cdc_db.execute(  # owner of its table (may publish it), but no CREATE on ctl_ROLE
        f"CREATE ROLE {role} LOGIN REPLICATION; GRANT CREATE ON SCHEMA public TO {role};"
        f'GRANT CREATE ON DATABASE "{cdc_db.name}" TO {role};'
        f"CREATE TABLE t (id int PRIMARY KEY); ALTER TABLE t OWNER TO {role};"
        f"CREATE SCHEMA ctl_{role}; GRANT USAGE ON SCHEMA ctl_{role} TO {role}"
    )
    try:
        url = cdc_db.url.replace("postgres@", f"{role}@")
        source = PgLogicalSource(url, ["t"], slot="no_control", control_schema=f"ctl_{role}")
        with pytest.raises(
            SourcePermissionError,
            match=rf"cannot create ctl_{role}\.dbtrigger_cdc_slots .*GRANT CREATE ON SCHEMA "
            rf"ctl_{role} TO this role.*have an admin run: CREATE TABLE",
        ):
            source.fetch(BEGINNING, 10)
        source.close()
    finally:
        with cdc_db.connect() as conn:
            conn.execute(f"DROP SCHEMA ctl_{role} CASCADE")
            conn.execute(f"DROP OWNED BY {role}")  # (also the publication and the grants)
            conn.execute(f"DROP ROLE {role}")


def test_a_dropped_slot_with_a_checkpoint_is_never_silently_replaced(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    cdc_db.execute("INSERT INTO t VALUES (1)")
    drain(trigger)
    source.close()
    cdc_db.execute("SELECT pg_drop_replication_slot(%s)", (source.slot,))
    with pytest.raises(SlotLostError, match=r"does not exist.*cdc recreate"):
        trigger.tick(lambda events: None)
    assert cdc_db.scalar(OWN_SLOTS_COUNT) == 0


def test_a_dropped_slot_before_the_first_checkpoint_is_never_silently_replaced(
    cdc_db: CdcDatabase,
) -> None:
    # Nothing delivered yet, so no checkpoint: the slot still held a change owed to the poller.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    cdc_db.execute("INSERT INTO t VALUES (1)")
    source.close()
    cdc_db.execute("SELECT pg_drop_replication_slot(%s)", (source.slot,))
    cdc_db.execute("INSERT INTO t VALUES (2)")
    with pytest.raises(SlotLostError, match=r"does not exist.*cdc recreate"):
        trigger.tick(lambda events: None)
    assert cdc_db.scalar(OWN_SLOTS_COUNT) == 0
    source.admin().recreate(snapshot=True)  # what the error says to run
    assert sorted(e.pk["id"] for e in drain(trigger)) == [1, 2]
    source.close()


def test_a_read_that_times_out_is_a_decode_backlog_then_steps_through(
    cdc_db: CdcDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE other (v text)")
    source = PgLogicalSource(
        cdc_db.url,
        ["t"],
        slot="backlog",
        snapshot="never",
        read_timeout_seconds=30.0,
        backlog_step_mb=1,
        heartbeat_interval_seconds=0,
    )
    assert source.fetch(BEGINNING, 10) == []  # (the slot made, under a timeout no load breaks)
    source.read_timeout = 0.01
    with cdc_db.connect() as conn:  # ~60 MB of WAL that holds nothing for this source
        conn.execute("INSERT INTO other SELECT repeat('w', 300) FROM generate_series(1, 150000)")
        conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(DecodeBacklogError, match=r"did not finish within 0.01s.*step forward"):
        source.fetch(BEGINNING, 10)
    source.read_timeout = 30.0  # the windows that follow get time enough
    source.drop_connection()
    start, _ = slot_row(cdc_db, "backlog")
    with caplog.at_level(logging.INFO, logger="dbtrigger.cdc"):
        rows: list[Any] = []
        for _ in range(200):
            rows = list(source.fetch(BEGINNING, 10))
            if rows:
                break
    assert [r["pk"] for r in rows] == [{"id": 1}]
    assert any(r.event == "cdc_backlog_crossed" for r in caplog.records)  # type: ignore[attr-defined]
    confirmed, _ = slot_row(cdc_db, "backlog")
    assert confirmed > start, "windows with nothing for us moved the slot"
    source.close()


def test_a_short_read_timeout_bounds_the_slot_read_alone(cdc_db: CdcDatabase) -> None:
    """``read_timeout_seconds`` is tuned to step through a decode backlog early;
    the catalog, heartbeat and slot-position statements around the read run
    under the standing timeout, so a loaded server cannot cancel one of them
    with an error that names neither the read nor the backlog."""
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source = PgLogicalSource(
        cdc_db.url, ["t"], slot="short", snapshot="never", read_timeout_seconds=0.01
    )
    read: list[Any] = []

    def a_read() -> bool:
        # A read slower than 10 ms on a loaded machine is a DecodeBacklogError, as it
        # should be; the next read tries again. What is checked is what runs around it.
        try:
            read[:] = source.fetch(BEGINNING, 10)
        except DecodeBacklogError:
            return False
        return True

    wait_for(a_read, "a read of the empty slot within 10 ms", timeout=60)
    assert read == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    wait_for(lambda: a_read() and bool(read), "a read of the row within 10 ms", timeout=60)
    assert [r["pk"] for r in read] == [{"id": 1}]
    timeout = source.connection().execute("SHOW statement_timeout").fetchone()
    assert timeout is not None
    assert timeout[0] == "1min", timeout
    source.close()


def test_each_read_writes_a_heartbeat(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    cdc_db.execute("SELECT pg_create_logical_replication_slot('watch', 'test_decoding')")
    source = PgLogicalSource(cdc_db.url, ["t"], slot="beats", snapshot="never")
    source.fetch(BEGINNING, 1)
    source.close()

    def beats() -> bool:  # a non-transactional message is decodable once the WAL is flushed
        with cdc_db.connect() as conn:
            return any(
                "dbtrigger.heartbeat" in r[0]
                for r in conn.execute(
                    "SELECT data FROM pg_logical_slot_peek_changes('watch', NULL, NULL)"
                )
            )

    wait_for(beats, "the heartbeat message in the log")


def test_a_connection_is_set_up_for_utc_text(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, at timestamptz, raw bytea)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    with psycopg.connect(cdc_db.server.conninfo(cdc_db.name), autocommit=True) as conn:
        conn.execute("SET TimeZone = 'Asia/Kolkata'")
        conn.execute("INSERT INTO t VALUES (1, '2024-01-01 12:00:00+05:30', '\\x00ff')")
    (event,) = drain(trigger)
    assert event.after is not None
    assert event.after["at"].isoformat() == "2024-01-01T06:30:00+00:00"
    assert event.after["raw"] == b"\x00\xff"
    source.close()


def test_slot_health_reaches_the_pollers_metrics(cdc_db: CdcDatabase) -> None:
    from dbtrigger.metrics import InMemoryMetrics  # noqa: PLC0415

    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    metrics = InMemoryMetrics()
    source = PgLogicalSource(cdc_db.url, ["t"], snapshot="never")
    trigger = PollTrigger(
        name="health", source=source, checkpoint_store=InMemoryCheckpointStore(), metrics=metrics
    )
    trigger.tick(lambda events: None)
    assert metrics.gauge("cdc_slot_lost", poller="health") == 0.0
    retained = metrics.gauge("cdc_retained_bytes", poller="health")
    assert retained is not None
    assert retained >= 0
    source.close()


def test_lanes_fan_out_retries_and_rejects_work_on_log_events(cdc_db: CdcDatabase) -> None:
    from dbtrigger.testing import MemoryQuarantineSink  # noqa: PLC0415

    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    sink = MemoryQuarantineSink()
    source = PgLogicalSource(cdc_db.url, ["t"], snapshot="never")
    seen: dict[str, list[tuple[int, int]]] = {"audit": [], "sync": []}
    attempts: dict[str, int] = {}

    def audit(events: list[RowChange], ctx: Any) -> None:
        for e in events:
            assert e.after is not None
            seen["audit"].append((e.pk["id"], e.after["v"]))
            if e.pk["id"] == 7:
                ctx.reject(e, "bad row")  # dead-lettered, never redelivered

    def sync(events: list[RowChange], ctx: Any) -> None:
        for e in events:
            assert e.after is not None
            attempts[e.cursor] = attempts.get(e.cursor, 0) + 1
            if e.pk["id"] == 3 and e.after["v"] == 0 and attempts[e.cursor] == 1:
                ctx.retry(e, "later")  # delivered again to this subscriber only
                continue
            seen["sync"].append((e.pk["id"], e.after["v"]))

    trigger = PollTrigger(
        name="fan",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=20,
        max_batches_per_tick=50,
        subscribers={"audit": audit, "sync": sync},
        max_concurrency=4,
        quarantine=sink,
        retry_delay_seconds=0,
        retry_delay_max_seconds=0,
        retry=RetryPolicy.none(),
    )
    trigger.drain()
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 30) g")
        for round_ in range(1, 4):
            conn.execute("UPDATE t SET v = %s", (round_,))
    trigger.drain()
    trigger.drain()  # the retry is due at once (delay 0)
    for name in ("audit", "sync"):
        by_key: dict[int, list[int]] = {}
        for key, value in seen[name]:
            by_key.setdefault(key, []).append(value)
        assert sorted(by_key) == list(range(1, 31)), name
        # Lanes keep each key's changes in commit order, and a retried change
        # holds its key's later changes back until it is settled.
        for key, values in by_key.items():
            assert values == [0, 1, 2, 3], (name, key, values)
    assert list(attempts.values()).count(2) == 1  # the retried change, delivered twice
    assert [r.pk for r in sink.records()] == [{"id": 7}] * 4
    confirmed, _ = slot_row(cdc_db, source.slot)
    assert confirmed >= flush_lsn(cdc_db) - 1_000_000  # released once all settled
    source.close()


def test_a_partitioned_table_is_watched_through_its_partitions(cdc_db: CdcDatabase) -> None:
    cdc_db.execute(
        "CREATE TABLE m (id int, at date, v text, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);"
        "CREATE TABLE m_2024 PARTITION OF m FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');"
        "CREATE TABLE m_2025 PARTITION OF m FOR VALUES FROM ('2025-01-01') TO ('2026-01-01')"
    )
    trigger, source = poller(cdc_db, ["m"])
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO m VALUES (1, '2024-05-01', 'a'), (2, '2025-05-01', 'b')")
        conn.execute("UPDATE m SET v = 'c' WHERE id = 2")
    events = drain(trigger)
    assert [(e.op, e.metadata["table"], e.pk["id"]) for e in events] == [
        ("insert", "public.m", 1),
        ("insert", "public.m", 2),
        ("update", "public.m", 2),
    ]
    source.close()


def test_commit_time_lag_is_measured_from_the_read(cdc_db: CdcDatabase) -> None:
    from dbtrigger.metrics import InMemoryMetrics  # noqa: PLC0415

    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    metrics = InMemoryMetrics()
    source = PgLogicalSource(cdc_db.url, ["t"], snapshot="never")
    trigger = PollTrigger(
        name="lagging",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        metrics=metrics,
        batch_size=2,
    )
    trigger.tick(lambda events: None)
    cdc_db.execute("INSERT INTO t SELECT generate_series(1, 5)")
    trigger.tick(lambda events: None)  # two of five delivered: the rest are pending
    lag = metrics.gauge("lag_seconds", poller="lagging")
    assert lag is not None
    assert lag >= 0
    assert metrics.gauge("lag_basis", poller="lagging", lag_basis="column:commit_time") == 1
    source.close()


@pytest.mark.parametrize("mode", ["poll", "stream"])
def test_a_type_change_accepted_by_another_process_resumes_a_running_poller(
    cdc_db: CdcDatabase, mode: str
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, amount int)")
    trigger, source = poller(cdc_db, ["t"], mode=mode, stream_wait_seconds=0)
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1, 10)")
        conn.execute("ALTER TABLE t ALTER COLUMN amount TYPE numeric")
        conn.execute("INSERT INTO t VALUES (2, 20.5), (3, 30)")
    delivered: list[RowChange] = []
    with pytest.raises(SchemaChangedError):
        trigger.drain(delivered.extend)
    assert [e.pk["id"] for e in delivered] == [1]
    with pytest.raises(SchemaChangedError):  # held, and the slot keeps the rest
        trigger.tick(delivered.extend)
    operator = PgLogicalSource(cdc_db.url, ["t"], slot=source.slot, snapshot="never")
    operator.admin().accept_schema()  # as `dbtrigger cdc accept-schema` from another process
    trigger.drain(delivered.extend)  # the running poller, never closed
    assert [e.pk["id"] for e in delivered] == [1, 2, 3]
    source.close()


@pytest.mark.parametrize("mode", ["poll", "stream"])
@pytest.mark.parametrize("restart", [False, True])
def test_a_watched_table_dropped_and_recreated_stops_delivery_until_republished(
    cdc_db: CdcDatabase, mode: str, restart: bool
) -> None:
    # DROP TABLE takes the table out of the publication, and its new namesake is not in it:
    # pgoutput then sends nothing for it, and the slot was advanced past its changes.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    trigger, source = poller(cdc_db, ["t"], mode=mode, stream_wait_seconds=0)
    drain(trigger)
    cdc_db.execute("INSERT INTO t VALUES (1, 'a')")
    cdc_db.execute("DROP TABLE t; CREATE TABLE t (id int PRIMARY KEY, v text)")
    cdc_db.execute("INSERT INTO t VALUES (3, 'c')")
    if restart:  # a new process: its first use must not quietly publish the new table
        source.close()
    delivered: list[RowChange] = []
    with pytest.raises(SourceDefinitionError, match=r"public\.t ") as refused:
        trigger.drain(delivered.extend)
    assert "dbtrigger cdc install" in str(refused.value)
    assert "dbtrigger cdc snapshot" in str(refused.value)
    with pytest.raises(SourceDefinitionError):  # held, until a person acts
        trigger.drain(delivered.extend)
    operator = PgLogicalSource(cdc_db.url, ["t"], slot=source.slot, snapshot="never")
    assert operator.admin().install()  # as `dbtrigger cdc install --yes`: published again
    operator.admin().request_snapshot("t")
    cdc_db.execute("INSERT INTO t VALUES (4, 'd')")
    trigger.drain(delivered.extend)
    got = [(e.op, e.pk["id"]) for e in delivered]
    assert got[0] == ("insert", 1)  # before the drop: still in the slot, delivered
    assert ("insert", 4) in got  # published again: read on
    assert ("upsert", 3) in got  # the snapshot reads what the log did not carry
    source.close()


@pytest.mark.parametrize("mode", ["poll", "stream"])
@pytest.mark.parametrize("how", ["dropped", "invalidated"])
def test_a_slot_lost_while_the_poller_runs_is_a_slot_lost_error(
    cdc_db: CdcDatabase, logical_pg: LogicalPostgres, mode: str, how: str
) -> None:
    # Not a retry forever (FetchError), nor "fix the source definition": what to run.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE filler (v text)")
    trigger, source = poller(cdc_db, ["t"], mode=mode, stream_wait_seconds=0)
    drain(trigger)
    cdc_db.execute("INSERT INTO t VALUES (1)")
    assert [e.pk["id"] for e in drain(trigger)] == [1]
    cdc_db.execute("INSERT INTO t VALUES (2)")
    if how == "dropped":
        with cdc_db.connect() as conn:
            drop_slot(conn, source.slot)
    else:
        logical_pg.set_config("max_slot_wal_keep_size", "1MB")
        try:
            with cdc_db.connect() as conn:
                for _ in range(4):
                    conn.execute("INSERT INTO filler SELECT 'x' FROM generate_series(1, 100)")
                    conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
                state = "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s"
                assert conn.execute(state, (source.slot,)).fetchone() == ("lost",)
        finally:
            logical_pg.set_config("max_slot_wal_keep_size", None)
    errors: list[BaseException] = []
    for _ in range(3):  # a read-ahead carried from the last tick may answer the first
        try:
            trigger.tick(lambda events: None)
        except Exception as exc:  # collected and checked below
            errors.append(exc)
    assert errors
    assert all(isinstance(e, SlotLostError) for e in errors), errors
    assert "dbtrigger cdc recreate" in str(errors[-1])
    source.close()


def test_a_stream_no_fetch_reads_lets_go_of_the_slot_for_the_worker_with_the_lease(
    cdc_db: CdcDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker that lost the lease stays alive (a pause, a store outage) with its stream
    # open: the slot has one reader, so the worker holding the lease could never read.
    from dbtrigger.cdc import pg_stream  # noqa: PLC0415

    monkeypatch.setattr(pg_stream, "IDLE_SECONDS", 0.5)
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    store = InMemoryCheckpointStore()
    name = f"p_{uuid.uuid4().hex[:8]}"

    def worker() -> tuple[PollTrigger, PgLogicalSource]:
        source = PgLogicalSource(
            cdc_db.url, ["t"], snapshot="never", mode="stream", stream_wait_seconds=0
        )
        t = PollTrigger(
            name=name,
            source=source,
            checkpoint_store=store,
            lease_ttl_seconds=1,
            retry=RetryPolicy.none(),
        )
        return t, source

    first, first_source = worker()
    second, second_source = worker()
    drain(first)  # its stream is open, and stays so: the process lives on without the lease
    cdc_db.execute("INSERT INTO t VALUES (1)")
    got: list[RowChange] = []

    def second_delivered() -> bool:
        # Refused while the first worker's lease lasts, then while its stream holds the slot.
        with contextlib.suppress(LeaseAcquireError, FetchError):
            second.tick(got.extend)
        return bool(got)

    wait_for(second_delivered, "the second worker to read the slot")
    assert [e.pk["id"] for e in got] == [1]
    first_source.close()
    second_source.close()


def test_two_workers_set_up_a_new_slot_at_once_without_an_operator_error(
    cdc_db: CdcDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both find no slot, then both create publication and slot: the loser's "already
    # exists" was a SourceDefinitionError, which stops `dbtrigger run`.
    from dbtrigger.cdc import pg_setup  # noqa: PLC0415

    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)")
    both_looked = threading.Barrier(2, timeout=3)
    slot_state = pg_setup.slot_state

    def looked_together(conn: Any, name: str) -> Any:
        state = slot_state(conn, name)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_looked.wait()  # times out when set-up is one at a time
        return state

    monkeypatch.setattr(pg_setup, "slot_state", looked_together)
    name = f"p_{uuid.uuid4().hex[:8]}"
    sources = [PgLogicalSource(cdc_db.url, ["t"]) for _ in range(2)]
    for source in sources:
        source.bind_poller(name)
    outcomes: list[Any] = [None, None]

    def fetch(k: int) -> None:
        try:
            outcomes[k] = len(sources[k].fetch(BEGINNING, 100))
        except Exception as exc:  # collected and checked below
            outcomes[k] = exc

    threads = [threading.Thread(target=fetch, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.setattr(pg_setup, "slot_state", slot_state)
    for outcome in outcomes:  # the snapshot's two rows, or the slot busy with the other
        assert outcome == 2 or isinstance(outcome, FetchError), outcome
    assert [len(s.fetch(BEGINNING, 100)) for s in sources] == [2, 2]
    for source in sources:
        source.close()
