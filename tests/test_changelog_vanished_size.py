"""Rows gone from a watched table with no delete logged, whatever the table's size.

MariaDB/MySQL log no ``TRUNCATE`` (and SQLite's ``INSERT OR REPLACE`` removes the
rows in its way unlogged). The drift check looked for such rows among the keys of
the newest 500 log rows only. A ``TRUNCATE`` of a table of 1,000 rows followed by
a reload of 600 of them (what a nightly reload does) left those 500 rows naming
reloaded keys only: the check found nothing, the poller delivered the reload as
600 inserts, and every reader kept the 400 rows not reloaded for ever, with
nobody told. The check now also compares the latest change of every key the log
holds with the table.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, drift, install
from dbtrigger.changelog.snapshot import snapshot
from dbtrigger.cli.main import main as cli_main
from dbtrigger.errors import ChangeLogDriftError
from tests.databases import TestDatabase

DEADLINE = 60.0


def poller(db: TestDatabase, tmp_path: Path) -> PollTrigger:
    return PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )


class Replica:
    """The replica handler of docs/changes.md."""

    def __init__(self) -> None:
        self.rows: dict[Any, Any] = {}
        self.events = 0

    def __call__(self, events: list[RowChange]) -> None:
        for e in events:
            self.events += 1
            if e.op == "truncate":
                self.rows.clear()
            elif e.op == "delete":
                self.rows.pop(e.pk["id"], None)
            else:
                assert e.after is not None
                self.rows[e.pk["id"]] = e.after["status"]


def drain_until(trigger: PollTrigger, replica: Replica, events: int) -> None:
    """Drain until ``events`` came in all (MariaDB's visibility guard may hold rows back
    a moment), bounded."""
    deadline = time.monotonic() + DEADLINE
    while replica.events < events and time.monotonic() < deadline:
        trigger.drain(replica)
        if replica.events < events:
            time.sleep(0.1)
    assert replica.events == events


def where(db: TestDatabase) -> list[str]:
    return ["--url", db.url, "--table", "orders", *(["--schema", db.schema] if db.schema else [])]


def test_a_truncate_and_a_reload_of_a_big_table_is_reported_then_resync_repairs_it(
    mariadb: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = mariadb.qualified("orders")
    mariadb.execute(f"CREATE TABLE {orders} (id INTEGER PRIMARY KEY, status VARCHAR(20))")
    install(mariadb.engine, "orders", schema=mariadb.schema)
    rows = ", ".join(f"({i}, 'new')" for i in range(1, 1001))
    mariadb.execute(f"INSERT INTO {orders} (id, status) VALUES {rows}")
    replica = Replica()
    drain_until(poller(mariadb, tmp_path), replica, 1000)

    mariadb.execute(f"TRUNCATE TABLE {orders}")  # fires no trigger on MariaDB
    reload = ", ".join(f"({i}, 'again')" for i in range(1, 601))
    mariadb.execute(f"INSERT INTO {orders} (id, status) VALUES {reload}")

    found = drift(mariadb.engine, "orders", schema=mariadb.schema)
    assert found.vanished, "rows 601..1000 left with no delete logged"
    assert "changelog resync" in found.fix
    assert cli_main(["changelog", "check", *where(mariadb)]) == 1
    assert "changelog resync" in capsys.readouterr().out
    # A worker (re)started after the reload stops before it delivers it.
    with pytest.raises(ChangeLogDriftError, match="changelog resync"):
        poller(mariadb, tmp_path).tick(replica)
    assert len(replica.rows) == 1000

    assert cli_main(["changelog", "resync", *where(mariadb), "--yes"]) == 0
    drain_until(poller(mariadb, tmp_path), replica, 1000 + 600 + 1 + 600)
    assert replica.rows == dict.fromkeys(range(1, 601), "again")
    assert not drift(mariadb.engine, "orders", schema=mariadb.schema)


def test_a_row_replaced_away_long_before_the_newest_changes_is_reported(
    sqlite_db: TestDatabase,
) -> None:
    """SQLite: ``INSERT OR REPLACE`` removed row 1 unlogged, then 600 changes to other
    rows were logged; the check found it only while it was among the newest 500."""
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT UNIQUE)")
    install(sqlite_db.engine, "orders")
    sqlite_db.execute("INSERT INTO orders VALUES (1, 'one'), (2, 'two')")
    sqlite_db.execute("INSERT OR REPLACE INTO orders VALUES (3, 'one')")  # row 1 goes unlogged
    for i in range(600):
        sqlite_db.execute(f"UPDATE orders SET status = 'two-{i}' WHERE id = 2")
    source = ChangeLogSource(url=sqlite_db.url, table="orders")
    try:
        with pytest.raises(ChangeLogDriftError, match=r"\(key 1\)"):
            source.check_drift()
    finally:
        source.close()


def test_a_resync_that_stopped_part_way_is_reported(db: TestDatabase, tmp_path: Path) -> None:
    """``changelog resync`` commits its ``truncate`` row, then the table chunk by chunk.
    Stopped part-way (killed, or a chunk that gave up waiting for a lock), the readers
    dropped every row at the truncate and got back only the chunks written: the rest
    was gone from every reader, and no check said so. Every row the table holds has a
    change logged after the last truncate; one that has none is now drift naming the
    resync again."""
    orders = db.qualified("orders")
    db.execute(f"CREATE TABLE {orders} (id INTEGER PRIMARY KEY, status VARCHAR(20))")
    install(db.engine, "orders", schema=db.schema)
    rows = ", ".join(f"({i}, 'new')" for i in range(1, 11))
    db.execute(f"INSERT INTO {orders} (id, status) VALUES {rows}")
    replica = Replica()
    trigger = poller(db, tmp_path)
    drain_until(trigger, replica, 10)
    # What a resync killed after its first chunk of 5 rows left in the log.
    db.execute(f"INSERT INTO {db.qualified('dbt_changelog_orders')} (dbt_op) VALUES ('truncate')")
    snapshot(db.engine, "orders", schema=db.schema, where="id <= 5")
    # While it may still be running (its rows are recent), it is not reported.
    assert not drift(db.engine, "orders", schema=db.schema)
    log = db.qualified("dbt_changelog_orders")
    ago = {
        "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now', '-10 minutes')",
        "postgresql": "clock_timestamp() - interval '10 minutes'",
        "mariadb": "CURRENT_TIMESTAMP(6) - INTERVAL 10 MINUTE",
    }[db.kind]
    db.execute(f"UPDATE {log} SET dbt_changed_at = {ago}")  # it stopped ten minutes ago
    with pytest.raises(ChangeLogDriftError, match="changelog resync") as refused:
        poller(db, tmp_path).tick(replica)
    assert "no change logged since the last truncate" in str(refused.value)
    assert cli_main(["changelog", "resync", *where(db), "--yes"]) == 0
    drain_until(poller(db, tmp_path), replica, 10 + 1 + 5 + 1 + 10)
    assert replica.rows == dict.fromkeys(range(1, 11), "new")
