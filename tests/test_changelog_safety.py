"""The change log never loses a change silently: TRUNCATE, prune by age, old triggers.

Each test provokes one way a subscriber could lose a change with nobody told,
at default settings, on the databases where it can happen.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, drift, install, log_table_name, prune
from dbtrigger.changelog import ddl as cl_ddl
from dbtrigger.changelog.triggers import trigger_ddl
from dbtrigger.cli.main import main as cli_main
from dbtrigger.errors import ChangeLogDriftError, HandlerError
from tests.databases import TestDatabase

DEADLINE = 30.0


def make_orders(db: TestDatabase) -> str:
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, status VARCHAR(20), "
        "note TEXT)"
    )
    install(db.engine, "orders", schema=db.schema)
    return db.qualified("orders")


def poller(db: TestDatabase, tmp_path: Path, name: str = "orders-log") -> PollTrigger:
    """A poller at default settings but for small batches."""
    return PollTrigger(
        name=name,
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=3,
        max_batches_per_tick=2,
    )


def drain_until(trigger: PollTrigger, wanted: int) -> list[RowChange]:
    """Tick until ``wanted`` events came (MariaDB's visibility guard may hold rows a moment)."""
    got: list[RowChange] = []
    deadline = time.monotonic() + DEADLINE
    while len(got) < wanted and time.monotonic() < deadline:
        trigger.drain(got.extend)
        if len(got) < wanted:
            time.sleep(0.1)
    assert len(got) == wanted, [(e.op, dict(e.pk)) for e in got]
    return got


def where(db: TestDatabase) -> list[str]:
    return ["--url", db.url, "--table", "orders", *(["--schema", db.schema] if db.schema else [])]


# --- 1. TRUNCATE -------------------------------------------------------------------------


def test_postgresql_truncate_is_delivered_as_an_event(pg: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(pg)
    for i in (1, 2, 3):
        pg.execute(f"INSERT INTO {orders} (id, status) VALUES ({i}, 'new')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} (id, status) VALUES (9, 'new')")
    batches: list[list[str]] = []
    trigger = poller(pg, tmp_path)
    trigger.drain(lambda events: batches.append([e.op for e in events]))
    assert ["truncate"] in batches  # alone in its batch: after every change before it
    events = drain_until(poller(pg, tmp_path, "orders-log-2"), 5)
    assert [(e.op, e.pk["id"]) for e in events] == [
        ("insert", 1),
        ("insert", 2),
        ("insert", 3),
        ("truncate", None),
        ("insert", 9),
    ]
    truncate = events[3]
    assert truncate.before is None
    assert truncate.after is None
    assert truncate.metadata["txid"] is not None
    assert not drift(pg.engine, "orders", schema=pg.schema)


def test_mariadb_truncate_is_reported_and_resync_repairs_it(
    mariadb: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = make_orders(mariadb)
    for i in (1, 2, 3):
        mariadb.execute(f"INSERT INTO {orders} (id, status) VALUES ({i}, 'new')")
    trigger = poller(mariadb, tmp_path)
    drain_until(trigger, 3)
    mariadb.execute(f"TRUNCATE TABLE {orders}")  # fires no trigger on MariaDB
    mariadb.execute(f"INSERT INTO {orders} (id, status) VALUES (9, 'new')")

    found = drift(mariadb.engine, "orders", schema=mariadb.schema)
    assert found.vanished == 3, found.problems
    assert "TRUNCATE" in found.problems[0]
    assert "changelog resync" in found.fix
    assert cli_main(["changelog", "check", *where(mariadb)]) == 1
    assert "changelog resync" in capsys.readouterr().out
    with pytest.raises(ChangeLogDriftError, match="changelog resync"):
        poller(mariadb, tmp_path).tick(lambda events: None)

    assert cli_main(["changelog", "resync", *where(mariadb), "--yes"]) == 0
    assert not drift(mariadb.engine, "orders", schema=mariadb.schema)
    events = drain_until(poller(mariadb, tmp_path), 3)
    assert [(e.op, e.pk["id"]) for e in events] == [
        ("insert", 9),
        ("truncate", None),
        ("upsert", 9),
    ]
    replica: dict[Any, Any] = {1: "new", 2: "new", 3: "new"}
    for e in events:
        if e.op == "truncate":
            replica.clear()
        else:
            replica[e.pk["id"]] = e.after["status"] if e.after else None
    assert replica == {9: "new"}


def test_sqlite_delete_of_every_row_is_logged_row_by_row(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """SQLite has no TRUNCATE; its whole-table DELETE (the 'truncate optimisation') fires
    the triggers once triggers exist, and nothing vanishes."""
    orders = make_orders(sqlite_db)
    for i in (1, 2, 3):
        sqlite_db.execute(f"INSERT INTO {orders} (id, status) VALUES ({i}, 'new')")
    sqlite_db.execute(f"DELETE FROM {orders}")
    events = drain_until(poller(sqlite_db, tmp_path), 6)
    assert [e.op for e in events] == ["insert"] * 3 + ["delete"] * 3
    assert not drift(sqlite_db.engine, "orders")


# --- 2. prune by age ---------------------------------------------------------------------


def test_prune_by_age_never_takes_rows_a_reader_has_not_read(
    db: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: Any
) -> None:
    orders = make_orders(db)
    for i in range(1, 7):
        db.execute(f"INSERT INTO {orders} (id, status) VALUES ({i}, 'new')")
    drain_until(poller(db, tmp_path), 6)
    for i in range(7, 11):  # written, not read yet
        db.execute(f"INSERT INTO {orders} (id, status) VALUES ({i}, 'new')")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    older = dt.timedelta(0)

    from dbtrigger.changelog.operations import plan_prune  # noqa: PLC0415 - new with the fix

    plan = plan_prune(db.engine, "orders", schema=db.schema, older_than=older, now=later)
    assert (plan.rows, plan.kept_unread) == (6, {"orders-log": 4})
    assert prune(db.engine, "orders", schema=db.schema, older_than=older, now=later) == 6
    log = db.qualified(log_table_name("orders"))
    assert db.scalar(f"SELECT count(*) FROM {log}") == 4

    # From the shell: the dry run says who keeps what; naming the reader drops its rows.
    assert cli_main(["changelog", "prune", *where(db), "--older-than", "0s"]) == 0
    out = capsys.readouterr().out
    assert "would delete 0 change log row(s)" in out
    assert "4 row(s) unread by orders-log" in out
    assert "--drop-unread-of orders-log" in out
    typo = ["--older-than", "0s", "--drop-unread-of", "x"]
    assert cli_main(["changelog", "prune", *where(db), *typo, "--yes"]) == 2
    assert "x is not a registered reader" in capsys.readouterr().err
    dropping = ["--older-than", "0s", "--drop-unread-of", "orders-log"]
    assert cli_main(["changelog", "prune", *where(db), *dropping]) == 0
    assert "reader orders-log loses 4 row(s)" in capsys.readouterr().out
    assert db.scalar(f"SELECT count(*) FROM {log}") == 4  # a dry run
    assert cli_main(["changelog", "prune", *where(db), *dropping, "--yes"]) == 0
    assert "deleted 4" in capsys.readouterr().out
    assert db.scalar(f"SELECT count(*) FROM {log}") == 0

    # The reader is told at its next start what it lost.
    with caplog.at_level(logging.WARNING, logger="dbtrigger.changelog"):
        poller(db, tmp_path).drain(lambda events: None)
    lost = [r for r in caplog.records if getattr(r, "event", None) == "changelog_rows_lost"]
    assert lost, caplog.text
    assert cli_main(["changelog", "readers", *where(db)]) == 0
    assert re.search(
        r"orders-log: at sequence \d+, seen .*lost rows up to", capsys.readouterr().out
    )


def test_a_reader_registers_before_its_first_commit(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A poller that has fetched once holds its rows, even before it committed anything."""
    orders = make_orders(sqlite_db)
    for i in (1, 2):
        sqlite_db.execute(f"INSERT INTO {orders} (id, status) VALUES ({i}, 'new')")

    def fail(events: list[RowChange]) -> None:
        raise RuntimeError("handler down")

    with pytest.raises(HandlerError):
        poller(sqlite_db, tmp_path).tick(fail)
    from dbtrigger.changelog.readers import registered  # noqa: PLC0415 - new with the fix

    with sqlite_db.engine.connect() as conn:
        readers = registered(conn, "orders", None)
    assert readers is not None
    assert [(r.name, r.seq) for r in readers] == [("orders-log", 0)]
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    assert prune(sqlite_db.engine, "orders", older_than=dt.timedelta(0), now=later) == 0


# --- 3. triggers of an older release -----------------------------------------------------


def _install_v2(db: TestDatabase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the triggers with what a v2 release wrote: its marker, no TRUNCATE trigger
    (PostgreSQL), no hex for bytes in a text column (SQLite), no 4038 handler (MariaDB)."""
    monkeypatch.setattr(cl_ddl, "MARKER", "dbtrigger-changelog v2")
    with db.engine.connect() as conn:
        info = cl_ddl.reflect_table(conn, "orders", db.schema)
    quote = db.engine.dialect.identifier_preparer.quote
    statements = trigger_ddl(info, quote)
    monkeypatch.undo()
    old = []
    for new in statements:
        if "_trunc" in new:
            continue
        plain = re.sub(r"CASE WHEN typeof\((\S+)\) = 'blob' THEN hex\(\1\) ELSE \1 END", r"\1", new)
        old.append(plain.replace(", 4038 ", " "))
    with db.engine.begin() as conn:
        if db.kind == "postgresql":
            trunc = quote("dbt_cl_orders_trunc")
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {trunc} ON {db.qualified('orders')}")
        for statement in old:
            conn.exec_driver_sql(statement)


def test_an_older_install_is_reported_and_upgraded_in_place(
    db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    orders = make_orders(db)
    _install_v2(db, monkeypatch)
    if db.kind == "sqlite":  # what the v2 triggers did to a write of bytes into a TEXT column
        with pytest.raises(sa.exc.OperationalError, match="BLOB"):
            db.execute(f"INSERT INTO {orders} (id, note) VALUES (50, x'00ff')")

    assert cli_main(["changelog", "check", *where(db)]) == 1
    out = capsys.readouterr().out
    assert "older dbtrigger (dbtrigger-changelog v2" in out, out
    assert "dbtrigger changelog install --url URL --table orders" in out
    source = ChangeLogSource(url=db.url, table="orders", schema=db.schema)
    [finding] = source.self_check()  # what `dbtrigger status --source` shows
    assert finding.severity == "error"
    assert "dbtrigger-changelog v2" in finding.message
    assert finding.fix is not None
    assert "changelog install" in finding.fix
    source.close()

    # The upgrade runs while another connection writes: that write waits for it or is
    # logged, never lands between the old triggers and the new ones unlogged.
    written: list[int] = []
    blocked: list[int] = []

    def write_during(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.startswith("CREATE TRIGGER") or len(written) + len(blocked) > 0:
            return
        key = 100
        try:
            _write_elsewhere(db, orders, key)
            written.append(key)
        except (sa.exc.OperationalError, sa.exc.DBAPIError, sqlite3.OperationalError):
            blocked.append(key)  # waited on the upgrade's lock: written after it below

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", write_during)
    try:
        assert cli_main(["changelog", "install", *where(db), "--yes"]) == 0
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", write_during)
    for key in blocked:
        db.execute(f"INSERT INTO {orders} (id, status) VALUES ({key}, 'new')")
    if db.kind != "mariadb":  # MariaDB replaces each trigger in one statement: no DROP
        assert written + blocked == [100]
    capsys.readouterr()
    assert cli_main(["changelog", "check", *where(db)]) == 0
    if db.kind == "sqlite":
        db.execute(f"INSERT INTO {orders} (id, note) VALUES (50, x'00ff')")
    log = db.qualified(log_table_name("orders"))
    unlogged = db.scalar(
        f"SELECT count(*) FROM {orders} o WHERE NOT EXISTS "
        f"(SELECT 1 FROM {log} l WHERE l.id = o.id)"
    )
    assert unlogged == 0


def _write_elsewhere(db: TestDatabase, orders: str, key: int) -> None:
    """One insert on a connection of its own that gives up quickly on a lock."""
    if db.kind == "sqlite":
        path = sa.engine.make_url(db.url).database
        assert path is not None
        other = sqlite3.connect(path, timeout=0.2)
        try:
            other.execute(f"INSERT INTO {orders} (id, status) VALUES ({key}, 'new')")
            other.commit()
        finally:
            other.close()
        return
    engine = sa.create_engine(db.url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            if db.kind == "postgresql":
                conn.exec_driver_sql("SET LOCAL lock_timeout = '200ms'")
            else:
                conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
                conn.exec_driver_sql("SET SESSION lock_wait_timeout = 1")
            conn.exec_driver_sql(f"INSERT INTO {orders} (id, status) VALUES ({key}, 'new')")
    finally:
        engine.dispose()


def test_sqlite_replace_removing_a_row_is_reported_naming_the_cause(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """``INSERT OR REPLACE`` deletes the rows in its way without firing their delete
    triggers (SQLite's rule while ``recursive_triggers`` is off). The vanished check
    found the lost delete but blamed "triggers missing or disabled", which they were
    not; it now names REPLACE and the two ways to have it logged."""
    sqlite_db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT UNIQUE)")
    install(sqlite_db.engine, "users")
    sqlite_db.execute("INSERT INTO users VALUES (1, 'a@x')")
    sqlite_db.execute("INSERT OR REPLACE INTO users VALUES (2, 'a@x')")  # row 1 goes unlogged
    source = ChangeLogSource(url=sqlite_db.url, table="users")
    try:
        with pytest.raises(ChangeLogDriftError) as caught:
            source.check_drift()
        message = str(caught.value)
        assert "(key 1)" in message
        assert "INSERT OR REPLACE" in message
        assert "PRAGMA recursive_triggers = ON" in message
        # With recursive triggers on, the same REPLACE logs its delete.
        with sqlite_db.engine.begin() as conn:
            conn.exec_driver_sql("PRAGMA recursive_triggers = ON")
            conn.exec_driver_sql("INSERT OR REPLACE INTO users VALUES (3, 'b@x')")
            conn.exec_driver_sql("INSERT OR REPLACE INTO users VALUES (4, 'b@x')")
            conn.exec_driver_sql("PRAGMA recursive_triggers = OFF")
        logged = sqlite_db.scalar(
            "SELECT count(*) FROM dbt_changelog_users WHERE dbt_op = 'delete' AND id = 3"
        )
        assert logged == 1
    finally:
        source.close()
