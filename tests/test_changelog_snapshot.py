"""``dbtrigger changelog snapshot``: a table's existing rows enter its change log,
on SQLite, PostgreSQL and MariaDB, with no change lost or out of order while
writers keep writing; and the log's retention keeps what replays may need.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.changelog.pruning import ChangeLogPruner
from dbtrigger.changelog.snapshot import snapshot
from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError
from tests.databases import TestDatabase

ROWS = 300


def orders(db: TestDatabase, rows: int) -> sa.Table:
    table = sa.Table(
        "orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("amount", sa.Integer),
        schema=db.schema,
    )
    table.create(db.engine)
    if rows:
        with db.engine.begin() as conn:
            conn.execute(
                table.insert(),
                [{"id": i, "status": "old", "amount": i} for i in range(1, rows + 1)],
            )
    return table


def replica(events: list[RowChange]) -> dict[int, dict[str, Any]]:
    """The table as the events say it is: applied in order, key by key."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        key = int(event.pk["id"])
        if event.op == "delete":
            out.pop(key, None)
        else:
            assert event.after is not None
            out[key] = {"status": event.after["status"], "amount": int(event.after["amount"])}
    return out


def table_now(db: TestDatabase, table: sa.Table) -> dict[int, dict[str, Any]]:
    with db.engine.connect() as conn:
        return {
            int(r.id): {"status": r.status, "amount": int(r.amount)}
            for r in conn.execute(sa.select(table))
        }


def test_existing_rows_enter_the_stream_with_no_change_lost_at_the_hand_over(
    db: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = orders(db, ROWS)
    install(db.engine, "orders", schema=db.schema)
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema, visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=100,
    )
    seen: list[RowChange] = []
    assert trigger.drain(seen.extend) == 0  # the log is empty: existing rows are not in it

    stop = threading.Event()
    rng = random.Random(7)
    errors: list[BaseException] = []

    def writer() -> None:
        next_id = ROWS + 1
        while not stop.wait(0.002):  # a busy writer, not one that starves SQLite's readers
            try:
                with db.engine.begin() as conn:
                    key = rng.randint(1, next_id - 1)
                    action = rng.random()
                    if action < 0.6:
                        conn.execute(
                            table.update()
                            .where(table.c.id == key)
                            .values(status="new", amount=table.c.amount + 1000)
                        )
                    elif action < 0.8:
                        conn.execute(table.delete().where(table.c.id == key))
                    else:
                        conn.execute(
                            table.insert().values(id=next_id, status="fresh", amount=next_id)
                        )
                        next_id += 1
            except sa.exc.OperationalError:
                continue  # SQLite: the snapshot holds the write lock for a moment
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.1)
        args = ["changelog", "snapshot", "--url", db.url, "--table", "orders"]
        if db.schema:
            args += ["--schema", db.schema]
        assert main([*args, "--chunk", "37"]) == 0
        assert "would write" in capsys.readouterr().out
        assert main([*args, "--chunk", "37", "--yes"]) == 0
        assert "into its change log" in capsys.readouterr().out
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    assert not errors
    trigger.drain(seen.extend)
    snapshots = [e for e in seen if e.op == "upsert"]
    assert snapshots
    assert all(e.metadata["snapshot"] for e in snapshots)
    assert not any(e.metadata["snapshot"] for e in seen if e.op != "upsert")
    assert replica(seen) == table_now(db, table)


def test_where_limits_the_rows_and_a_second_statement_is_refused(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    orders(sqlite_db, 20)
    install(sqlite_db.engine, "orders")
    done = snapshot(sqlite_db.engine, "orders", where="id BETWEEN 5 AND 8", chunk=3)
    assert (done.rows, done.chunks) == (4, 2)
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=sqlite_db.url, table="orders"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    seen: list[RowChange] = []
    trigger.drain(seen.extend)
    assert [(e.op, e.pk["id"]) for e in seen] == [("upsert", i) for i in (5, 6, 7, 8)]
    with pytest.raises(ConfigurationError, match="one condition"):
        snapshot(sqlite_db.engine, "orders", where="1=1; DROP TABLE orders")


def test_retention_keeps_rows_every_reader_passed_for_a_while(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    orders(sqlite_db, 0)
    install(sqlite_db.engine, "orders")
    for i in range(1, 6):
        sqlite_db.execute(f"INSERT INTO orders VALUES ({i}, 'new', {i})")
    store = FileCheckpointStore(tmp_path / "state")
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=sqlite_db.url, table="orders"),
        checkpoint_store=store,
    )
    trigger.drain(lambda events: None)
    kept = ChangeLogPruner(passed_by=["orders-log"], store=store, keep_seconds=3600)
    assert kept.run(sqlite_db.engine, "orders", schema=None, source="t") == 0
    at_once = ChangeLogPruner(passed_by=["orders-log"], store=store)
    assert at_once.run(sqlite_db.engine, "orders", schema=None, source="t") == 5


def test_the_rows_written_are_counted_on_every_database(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    """On PostgreSQL (SQLAlchemy 2.1, psycopg) an INSERT ... SELECT reports no row count
    unless asked to: the snapshot said it wrote -1 rows (-3 in three chunks)."""
    orders(db, 5)
    install(db.engine, "orders", schema=db.schema)
    done = snapshot(db.engine, "orders", schema=db.schema, chunk=2)
    assert (done.rows, done.chunks) == (5, 3)
    args = ["changelog", "snapshot", "--url", db.url, "--table", "orders", "--yes"]
    assert main(args + (["--schema", db.schema] if db.schema else [])) == 0
    assert "wrote 5 row(s)" in capsys.readouterr().out


def test_install_on_a_table_with_rows_says_how_to_deliver_them(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first install on a table that holds rows says those rows are in no log row,
    and names the snapshot command (a new user would otherwise never see them)."""
    orders(db, 2)
    args = ["changelog", "install", "--url", db.url, "--table", "orders", "--yes"]
    args += ["--schema", db.schema] if db.schema else []
    assert main(args) == 0
    assert "dbtrigger changelog snapshot --url URL --table orders" in capsys.readouterr().out
    snapshot(db.engine, "orders", schema=db.schema)
    assert main(args) == 0  # installed again: the log holds rows now
    assert "snapshot" not in capsys.readouterr().out
