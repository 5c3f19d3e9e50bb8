"""The trigger-maintained change log, on every database: every change, in order."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import (
    MARKER,
    ChangeLogSource,
    install,
    is_installed,
    log_table_name,
    plan_install,
    prune,
    uninstall,
)
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import ConfigurationError, SerializationError
from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command


def make_orders(db: TestDatabase) -> str:
    amount = "NUMERIC(12,2)"
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} ("
        f"id INTEGER PRIMARY KEY, status VARCHAR(20) NOT NULL, amount {amount})"
    )
    return db.qualified("orders")


def source_for(db: TestDatabase, **kwargs: Any) -> ChangeLogSource:
    return ChangeLogSource(url=db.url, table="orders", schema=db.schema, **kwargs)


def poller(db: TestDatabase, tmp_path: Path, name: str = "orders-log") -> PollTrigger:
    return PollTrigger(
        name=name,
        source=source_for(db),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=3,
        max_batches_per_tick=2,
    )


def changes(events: list[RowChange]) -> list[tuple[str, int, Any, Any]]:
    def status(image: Any) -> Any:
        return None if image is None else image["status"]

    return [(e.op, e.pk["id"], status(e.before), status(e.after)) for e in events]


def test_every_change_in_order_with_before_and_after(db: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    with db.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {orders} VALUES (1, 'new', 10.50), (2, 'new', 3)"))
    # An update that changes no cursor-like column, and two updates in one transaction.
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 1")
    with db.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {orders} SET status = 'packed' WHERE id = 1"))
        conn.execute(sa.text(f"UPDATE {orders} SET status = 'shipped' WHERE id = 1"))
    db.execute(f"DELETE FROM {orders} WHERE id = 2")
    db.execute(f"INSERT INTO {orders} VALUES (2, 'again', NULL)")  # re-insert of a deleted key

    trigger = poller(db, tmp_path)
    seen: list[RowChange] = []
    assert trigger.drain(seen.extend) == 7
    assert changes(seen) == [
        ("insert", 1, None, "new"),
        ("insert", 2, None, "new"),
        ("update", 1, "new", "paid"),
        ("update", 1, "paid", "packed"),
        ("update", 1, "packed", "shipped"),
        ("delete", 2, "new", None),
        ("insert", 2, None, "again"),
    ]
    per_key: dict[int, list[tuple[str, Any, Any]]] = {}
    for op, key, before, after in changes(seen):
        per_key.setdefault(key, []).append((op, before, after))
    assert per_key[1] == [
        ("insert", None, "new"),
        ("update", "new", "paid"),
        ("update", "paid", "packed"),
        ("update", "packed", "shipped"),
    ]
    assert per_key[2] == [
        ("insert", None, "new"),
        ("delete", "new", None),
        ("insert", None, "again"),
    ]
    assert [e.cursor for e in seen] == sorted(e.cursor for e in seen)
    assert len({e.event_id for e in seen}) == 7
    first = seen[0]
    assert first.after is not None
    assert Decimal(str(first.after["amount"])) == Decimal("10.50")
    assert isinstance(first.after["amount"], (Decimal, int))
    assert trigger.tick(seen.extend) == 0


def test_crash_mid_drain_loses_nothing(db: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    for i in range(1, 11):
        db.execute(f"INSERT INTO {orders} VALUES ({i}, 'new', {i})")
    for i in range(1, 11, 2):
        db.execute(f"DELETE FROM {orders} WHERE id = {i}")

    class Crash(Exception):
        pass

    calls = 0
    delivered: list[RowChange] = []

    def flaky(events: list[RowChange]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Crash("handler died mid-drain")
        delivered.extend(events)

    trigger = poller(db, tmp_path)
    with pytest.raises(Exception, match="handler died"):
        trigger.drain(flaky)
    # A new process: new trigger object, same state directory. (Drained until
    # everything came, bounded: on MariaDB another session's open writer holds
    # the server-wide horizon back a while, and a held-back drain ends early.)
    again = poller(db, tmp_path)
    deadline = time.monotonic() + 60
    again.drain(flaky)
    while len({e.event_id for e in delivered}) < 15 and time.monotonic() < deadline:
        time.sleep(0.05)
        again.drain(flaky)
    ids = [e.event_id for e in delivered]
    assert len(set(ids)) == 15, "every change delivered"
    assert sorted(e.cursor for e in delivered) == sorted({e.cursor for e in delivered})
    deletes = sorted(e.pk["id"] for e in delivered if e.op == "delete")
    assert deletes == [1, 3, 5, 7, 9]


def test_install_is_idempotent_and_uninstall_removes_the_triggers(db: TestDatabase) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    install(db.engine, "orders", schema=db.schema)  # again: no error, no second trigger
    assert is_installed(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} VALUES (1, 'new', 1)")
    log = db.qualified(log_table_name("orders"))
    assert db.scalar(f"SELECT count(*) FROM {log}") == 1  # one row: one trigger fired

    uninstall(db.engine, "orders", schema=db.schema)
    uninstall(db.engine, "orders", schema=db.schema)
    assert not is_installed(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} VALUES (2, 'new', 1)")
    assert db.scalar(f"SELECT count(*) FROM {log}") == 1  # no trigger any more, log kept

    uninstall(db.engine, "orders", schema=db.schema, drop_log=True)
    assert not sa.inspect(db.engine).has_table(log_table_name("orders"), schema=db.schema)


def test_install_refuses_to_replace_a_foreign_trigger(db: TestDatabase) -> None:
    orders = make_orders(db)
    db.execute(f"CREATE TABLE {db.qualified('audit')} (n INTEGER)")
    audit = db.qualified("audit")
    if db.kind == "postgresql":
        db.execute(
            f"CREATE FUNCTION {db.qualified('audit_fn')}() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN INSERT INTO {audit} VALUES (1); RETURN NEW; END $$"
        )
        db.execute(
            f"CREATE TRIGGER dbt_cl_orders AFTER INSERT ON {orders} "
            f"FOR EACH ROW EXECUTE FUNCTION {db.qualified('audit_fn')}()"
        )
    else:
        name = db.qualified("dbt_cl_orders_ins")
        db.execute(
            f"CREATE TRIGGER {name} AFTER INSERT ON {orders} FOR EACH ROW "
            + (
                f"BEGIN INSERT INTO {audit} VALUES (1); END"
                if db.kind == "sqlite"
                else f"INSERT INTO {audit} VALUES (1)"
            )
        )
    with pytest.raises(ConfigurationError, match="did not create"):
        install(db.engine, "orders", schema=db.schema)
    with pytest.raises(ConfigurationError, match="not created by the change log"):
        uninstall(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} VALUES (1, 'new', 1)")
    assert db.scalar(f"SELECT count(*) FROM {audit}") == 1  # the foreign trigger still works


def test_generated_triggers_carry_the_marker(db: TestDatabase) -> None:
    make_orders(db)
    plan = plan_install(db.engine, "orders", schema=db.schema)
    triggers = [s for s in plan.statements if "TRIGGER" in s or "FUNCTION" in s]
    assert triggers
    assert any(MARKER in s for s in plan.statements)


def test_prune_by_checkpoint_and_by_age_in_chunks(db: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    for i in range(1, 13):
        db.execute(f"INSERT INTO {orders} VALUES ({i}, 'new', {i})")
    trigger = poller(db, tmp_path)
    # 2 batches of 3: checkpoint at the 6th change. The first ticks can consume
    # nothing yet, reporting it held back: MariaDB's AUTO_INCREMENT bound needs a
    # sample older than every writer open at a later observation, and other
    # sessions of a shared, loaded server can take longer than its 2 s settle.
    deadline = time.monotonic() + 60
    while trigger.tick(lambda events: None) == 0:
        last = trigger.last_result
        assert last is not None
        assert last.held_back, last  # waiting, never silently idle
        assert time.monotonic() < deadline, last
    state = trigger.read_state()
    assert state is not None
    passed = state.position.cursor
    log = db.qualified(log_table_name("orders"))
    # Its own checkpoint stands for its registered position (recorded at most every 2 s
    # while it drains a backlog, so behind it here).
    at = {"orders-log": passed}
    assert prune(db.engine, "orders", schema=db.schema, up_to_seq=passed, apply=False) <= 6
    assert (
        prune(db.engine, "orders", schema=db.schema, up_to_seq=passed, readers_at=at, apply=False)
        == 6
    )
    assert (
        prune(db.engine, "orders", schema=db.schema, up_to_seq=passed, readers_at=at, chunk=4) == 6
    )
    assert db.scalar(f"SELECT count(*) FROM {log}") == 6
    delivered: list[RowChange] = []
    trigger.drain(delivered.extend)
    assert sorted(e.pk["id"] for e in delivered) == list(range(7, 13))  # nothing lost
    assert prune(db.engine, "orders", schema=db.schema, older_than=dt.timedelta(hours=1)) == 0
    assert (
        prune(
            db.engine,
            "orders",
            schema=db.schema,
            older_than=dt.timedelta(0),
            now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5),
            chunk=5,
        )
        == 6
    )
    with pytest.raises(ConfigurationError, match="refusing to delete all"):
        prune(db.engine, "orders", schema=db.schema)


def test_source_without_a_log_names_the_install_command(sqlite_db: TestDatabase) -> None:
    make_orders(sqlite_db)
    with pytest.raises(ConfigurationError, match="dbtrigger changelog install"):
        ChangeLogSource(url=sqlite_db.url, table="orders").fingerprint()


def test_table_without_primary_key_is_refused(sqlite_db: TestDatabase) -> None:
    sqlite_db.execute("CREATE TABLE nokey (a INTEGER)")
    with pytest.raises(ConfigurationError, match="no primary key"):
        install(sqlite_db.engine, "nokey")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [dbtrigger_command(), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_install_dry_run_then_apply_then_prune(db: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(db)
    where = ["--url", db.url, "--table", "orders"] + (["--schema", db.schema] if db.schema else [])
    dry = run_cli("changelog", "install", *where)
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"CREATE (OR REPLACE )?TRIGGER", dry.stdout)
    assert "dry run" in dry.stdout
    assert not is_installed(db.engine, "orders", schema=db.schema)

    done = run_cli("changelog", "install", *where, "--yes")
    assert done.returncode == 0, done.stderr
    assert is_installed(db.engine, "orders", schema=db.schema)
    for i in range(1, 5):
        db.execute(f"INSERT INTO {orders} VALUES ({i}, 'new', {i})")
    trigger = poller(db, tmp_path)
    delivered: list[RowChange] = []
    deadline = time.monotonic() + 30
    # Commits 2 batches of 3 (the first 3 changes, then 1). On a MariaDB server
    # shared with other sessions, the visibility guard may hold the rows back
    # for a moment while another session's transaction is open: tick again.
    while len(delivered) < 4 and time.monotonic() < deadline:
        trigger.tick(delivered.extend)
        if len(delivered) < 4:
            time.sleep(0.2)
    assert len(delivered) == 4
    store = ["--store", str(tmp_path / "state"), "--passed-by", "orders-log"]
    would = run_cli("changelog", "prune", *where, *store)
    assert would.returncode == 0, would.stderr
    assert "would delete 4" in would.stdout
    pruned = run_cli("changelog", "prune", *where, *store, "--yes")
    assert "deleted 4" in pruned.stdout, pruned.stdout + pruned.stderr

    bad = run_cli("changelog", "prune", *where, "--older-than", "soon")
    assert bad.returncode == 2
    assert "not a duration" in bad.stderr

    gone = run_cli("changelog", "uninstall", *where, "--drop-log", "--yes")
    assert gone.returncode == 0, gone.stderr
    assert not sa.inspect(db.engine).has_table(log_table_name("orders"), schema=db.schema)


@pytest.mark.postgresql
def test_write_overhead_benchmark_prints_its_table(pg: TestDatabase, tmp_path: Path) -> None:
    from tests.test_benchmarks_smoke import run_benchmark, table_rows  # noqa: PLC0415

    out = run_benchmark(
        "changelog",
        ["--dialects", "postgresql,sqlite", "--rows", "20", "--rounds", "2"],
        pg,
        tmp_path,
    )
    rows = table_rows(out, "Change log write overhead")
    assert [r[:2] for r in rows] == [
        [d, op]
        for d in ("postgresql", "sqlite")
        for op in ("insert", "update", "delete", "log rows")
    ]
    assert rows[3][2] == "120"  # 3 operations x 20 rows x 2 rounds, one log row per change


def test_soft_delete_mapping(db: TestDatabase, tmp_path: Path) -> None:
    table = db.qualified("accounts")
    flag = "BOOLEAN" if db.kind != "mariadb" else "TINYINT(1)"
    false, true = ("false", "true") if db.kind == "postgresql" else ("0", "1")
    db.execute(
        f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, "
        f"name VARCHAR(20), deleted_at VARCHAR(30), is_gone {flag} NOT NULL DEFAULT {false}, "
        "status VARCHAR(10) NOT NULL DEFAULT 'live')"
    )
    db.execute(f"INSERT INTO {table} (id, seq, name) VALUES (1, 1, 'a'), (2, 2, 'b'), (3, 3, 'c')")
    db.execute(
        f"UPDATE {table} SET seq = 4, deleted_at = '2026-11-23T10:00:00', "
        f"is_gone = {true}, status = 'deleted' WHERE id = 2"
    )

    def ops(**mapping: Any) -> list[tuple[int, str, bool]]:
        source = SqlAlchemySource(
            url=db.url,
            table="accounts",
            schema=db.schema,
            cursor_column="seq",
            pk_columns=["id"],
            visibility="none",
            **mapping,
        )
        trigger = PollTrigger(
            name="accounts",
            source=source,
            checkpoint_store=FileCheckpointStore(tmp_path / str(sorted(mapping.items()))),
        )
        seen: list[RowChange] = []
        trigger.drain(seen.extend)
        for e in seen:
            if e.op == "delete":
                assert e.after is None
                assert e.before is not None
                assert e.before["name"] == "b"
        return [(e.pk["id"], e.op, e.before is None) for e in seen]

    expected = [(1, "upsert", True), (3, "upsert", True), (2, "delete", False)]
    assert ops(deleted_column="deleted_at") == expected
    assert ops(deleted_column="is_gone") == expected
    assert ops(deleted_column="status", deleted_value="deleted") == expected
    assert ops() == [(1, "upsert", True), (3, "upsert", True), (2, "upsert", True)]
    with pytest.raises(SerializationError, match="no column"):
        ops(deleted_column="removed")
    with pytest.raises(ConfigurationError, match="needs deleted_column"):
        SqlAlchemySource(
            url=db.url, table="accounts", cursor_column="seq", pk_columns=["id"], deleted_value=1
        )


def test_soft_delete_mapping_is_in_the_fingerprint_only_when_set(sqlite_db: TestDatabase) -> None:
    def fp(**mapping: Any) -> str:
        return SqlAlchemySource(
            url=sqlite_db.url, table="t", cursor_column="c", pk_columns=["id"], **mapping
        ).fingerprint()

    assert fp() != fp(deleted_column="deleted_at")
    assert fp(deleted_column="status", deleted_value="x") != fp(deleted_column="status")


def test_automatic_pruning_of_rows_every_poller_passed(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    orders = make_orders(sqlite_db)
    install(sqlite_db.engine, "orders")
    for i in range(1, 11):
        sqlite_db.execute(f"INSERT INTO {orders} VALUES ({i}, 'new', {i})")
    store = FileCheckpointStore(tmp_path / "state")

    def reader(name: str) -> PollTrigger:
        return PollTrigger(
            name=name,
            source=ChangeLogSource(
                url=sqlite_db.url,
                table="orders",
                prune_passed_by=["fast", "slow"],
                prune_store=store,
                prune_every_seconds=0.001,
            ),
            checkpoint_store=store,
            batch_size=4,
        )

    fast, slow = reader("fast"), reader("slow")
    log = sqlite_db.qualified(log_table_name("orders"))
    seen: dict[str, list[int]] = {"fast": [], "slow": []}
    fast.drain(lambda events: seen["fast"].extend(e.pk["id"] for e in events))
    assert sqlite_db.scalar(f"SELECT count(*) FROM {log}") == 10  # slow has no checkpoint yet
    slow.tick(lambda events: seen["slow"].extend(e.pk["id"] for e in events))  # first 4
    fast.tick(lambda events: None)  # a fetch: prunes up to slow's checkpoint
    assert sqlite_db.scalar(f"SELECT count(*) FROM {log}") == 6
    slow.drain(lambda events: seen["slow"].extend(e.pk["id"] for e in events))
    assert seen == {"fast": list(range(1, 11)), "slow": list(range(1, 11))}
    fast.tick(lambda events: None)
    assert sqlite_db.scalar(f"SELECT count(*) FROM {log}") == 0
    with pytest.raises(ConfigurationError, match="needs prune_store"):
        ChangeLogSource(url=sqlite_db.url, table="orders", prune_passed_by=["x"])


def test_a_fetch_never_reads_other_pollers_state(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """Pruning reads the readers' checkpoints when the runtime acknowledges one, not at a fetch."""
    orders = make_orders(sqlite_db)
    install(sqlite_db.engine, "orders")
    for i in range(1, 6):
        sqlite_db.execute(f"INSERT INTO {orders} VALUES ({i}, 'new', {i})")
    reads: list[str] = []

    class WatchedStore(FileCheckpointStore):
        def read(self, key: str) -> Any:
            reads.append(key)
            return super().read(key)

    store = WatchedStore(tmp_path / "state")
    source = ChangeLogSource(
        url=sqlite_db.url,
        table="orders",
        prune_passed_by=["reader"],
        prune_store=store,
        prune_every_seconds=0.001,
    )
    rows = source.fetch(BEGINNING, 10)
    assert len(rows) == 5
    assert reads == []  # the fetch read no state document
    PollTrigger(name="reader", source=source, checkpoint_store=store).drain(lambda events: None)
    log = sqlite_db.qualified(log_table_name("orders"))
    assert "reader" in reads
    assert sqlite_db.scalar(f"SELECT count(*) FROM {log}") == 0  # pruned after the commit
    source.close()


@pytest.mark.parametrize("lanes", [1, 4])
def test_key_changes_leave_the_documented_replica_with_the_tables_keys(
    db: TestDatabase, tmp_path: Path, lanes: int
) -> None:
    """A primary-key update is a delete of the old key, then an insert of the new one."""
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    db.execute(
        f"INSERT INTO {orders} VALUES (1, 'a', 1), (2, 'b', 2), (3, 'c', 3), (4, 'd', 4), "
        "(5, 'e', 5)"
    )
    db.execute(f"UPDATE {orders} SET id = 10 WHERE id = 1")
    with db.engine.begin() as conn:  # swap two keys through a free one, in one transaction
        for old, new in ((2, 100), (3, 2), (100, 3)):
            conn.execute(sa.text(f"UPDATE {orders} SET id = {new} WHERE id = {old}"))
    db.execute(f"UPDATE {orders} SET id = 40, status = 'moved' WHERE id = 4")
    db.execute(f"UPDATE {orders} SET id = id + 1000 WHERE id IN (5, 10)")  # several rows at once
    db.execute(f"INSERT INTO {orders} VALUES (1, 'again', 1)")  # a freed key, reused
    db.execute(f"DELETE FROM {orders} WHERE id = 40")
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 2")  # no key change: an update

    replica: dict[int, dict[str, Any]] = {}

    def handle(events: list[RowChange]) -> None:  # the handler of docs/changes.md
        for e in events:
            if e.op == "delete":
                replica.pop(e.pk["id"], None)
            else:
                assert e.after is not None
                replica[e.pk["id"]] = dict(e.after)

    trigger = PollTrigger(
        name="orders-log",
        source=source_for(db, visibility="none" if db.kind == "mariadb" else "auto"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=4,
        max_concurrency=lanes,
    )
    seen: list[RowChange] = []
    trigger.drain(lambda events: (seen.extend(events), handle(events)))
    with db.engine.connect() as conn:
        table = {r.id: r.status for r in conn.execute(sa.text(f"SELECT id, status FROM {orders}"))}
    assert {k: v["status"] for k, v in replica.items()} == table
    assert sorted(table) == [1, 2, 3, 1005, 1010]
    # In order per key; across the two keys only without lanes (``seen`` is in the
    # order the lanes' calls ran, and keys 4 and 40 may be in two lanes of a batch).
    for key in (4, 40):
        assert [e.op for e in seen if e.pk["id"] == key] == ["insert", "delete"]
    if lanes == 1:
        moved = [(e.op, e.pk["id"]) for e in seen if e.pk["id"] in (4, 40)]
        assert moved == [("insert", 4), ("delete", 4), ("insert", 40), ("delete", 40)]
    move = next(e for e in seen if e.op == "delete" and e.pk["id"] == 4)
    assert move.before is not None
    assert move.before["status"] == "d"
    assert move.after is None
    arrival = next(e for e in seen if e.op == "insert" and e.pk["id"] == 40)
    assert arrival.before is None
    assert arrival.after is not None
    assert arrival.after["status"] == "moved"
    assert arrival.metadata["txid"] == move.metadata["txid"]
    assert arrival.cursor > move.cursor
