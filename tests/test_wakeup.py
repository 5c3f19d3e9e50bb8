"""Wake-up hints for poller workers (dbtrigger.wakeup), and the runner's re-poll.

Every test here waits for an *outcome* (a row delivered, a listener
reconnected) with a generous bound. Where a test shows that something other
than the interval woke the worker, the interval is far longer (300 s) than
the bound, so only the hint (or the re-poll) can explain the row arriving.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource
from dbtrigger.changelog import install as install_changelog
from dbtrigger.errors import ConfigurationError, UnsafeIdentifierError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.runtime.runner import Runner
from dbtrigger.wakeup import (
    AdaptivePolling,
    NotifyHint,
    default_channel,
    install,
    installed_channel,
    parse_wake,
    plan_install,
    plan_uninstall,
    uninstall,
)
from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command
from tests.test_cli_worker import run_cli as run_worker
from tests.test_cli_worker import run_until, write_module
from tests.test_source_sqlalchemy import insert, naive, orders_table

ROOT = Path(__file__).resolve().parent.parent
#: Far longer than any wait below: only a hint or a re-poll explains a row before it.
LONG_INTERVAL = 300.0


def wait_until(check: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def make_items(db: TestDatabase) -> None:
    if db.kind == "postgresql":
        db.execute(
            f"CREATE TABLE {db.qualified('items')} (id serial PRIMARY KEY, "
            "updated_at timestamptz NOT NULL DEFAULT clock_timestamp(), note text)"
        )
    else:
        db.execute(
            f"CREATE TABLE {db.qualified('items')} (id INTEGER PRIMARY KEY, "
            "updated_at INTEGER NOT NULL, note TEXT)"
        )
    db.execute(f"CREATE INDEX items_cursor ON {db.qualified('items')} (updated_at, id)")


def add_item(db: TestDatabase, item: int) -> None:
    if db.kind == "postgresql":
        db.execute(f"INSERT INTO {db.qualified('items')} (id, note) VALUES (:i, 'x')", {"i": item})
    else:
        db.execute(
            f"INSERT INTO {db.qualified('items')} (id, updated_at, note) VALUES (:i, :i, 'x')",
            {"i": item},
        )


def poller(db: TestDatabase, name: str = "items", **options: Any) -> PollTrigger:
    source = SqlAlchemySource(
        url=db.url, table="items", schema=db.schema, cursor_column="updated_at", pk_columns=["id"]
    )
    return PollTrigger(
        name=name, source=source, checkpoint_store=InMemoryCheckpointStore(), **options
    )


class Worker:
    """A runner in a thread that records the keys it was handed; stopped on exit."""

    def __init__(
        self,
        trigger: PollTrigger,
        interval: float,
        wake: Any = None,
        on_batch: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.seen: list[int] = []
        self.on_batch = on_batch
        self.runner = Runner(
            trigger, self.handle, interval_seconds=interval, progress=None, wake=wake
        )
        self.thread = threading.Thread(target=self.runner.run, kwargs={"install_signals": False})

    def handle(self, events: list[Any]) -> None:
        keys = [int(e.pk["id"]) for e in events]
        self.seen.extend(keys)
        if self.on_batch is not None:
            self.on_batch(keys)

    def __enter__(self) -> Worker:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


# --- the runner re-polls after a tick that delivered rows -----------------------------------


def test_rows_committed_while_a_tick_ran_are_read_at_once(sqlite_db: TestDatabase) -> None:
    """A tick that delivered a short batch is followed at once by another one: a
    row committed while the handler ran does not wait for the interval."""
    make_items(sqlite_db)
    add_item(sqlite_db, 1)

    def during_first(keys: list[int]) -> None:
        if keys == [1]:
            add_item(sqlite_db, 2)  # committed while the tick is still running

    with Worker(poller(sqlite_db), LONG_INTERVAL, on_batch=during_first) as worker:
        assert wait_until(lambda: worker.seen == [1, 2], 30), worker.seen


# --- adaptive polling ----------------------------------------------------------------------


def test_adaptive_waits_start_short_after_activity_and_double_back_to_the_interval() -> None:
    hint = AdaptivePolling(fastest_seconds=0.05)
    assert hint.delay(5.0, None) == 5.0  # nothing delivered since start: the interval
    assert [hint.delay(5.0, n) for n in range(1, 9)] == [
        0.05,
        0.1,
        0.2,
        0.4,
        0.8,
        1.6,
        3.2,
        5.0,
    ]
    assert hint.delay(5.0, 10_000) == 5.0  # never longer than the interval
    assert hint.delay(0.01, 1) == 0.01  # nor than a shorter one
    assert AdaptivePolling(0.2, factor=1).delay(5.0, 50) == 0.2
    with pytest.raises(ConfigurationError, match="factor"):
        AdaptivePolling(factor=0.5)
    with pytest.raises(ConfigurationError, match="fastest_seconds"):
        AdaptivePolling(fastest_seconds=0)


def test_adaptive_polling_finds_a_row_soon_after_activity(sqlite_db: TestDatabase) -> None:
    make_items(sqlite_db)
    add_item(sqlite_db, 1)
    hint = AdaptivePolling(fastest_seconds=0.05, factor=1)  # stays fast after activity
    with Worker(poller(sqlite_db), LONG_INTERVAL, wake=hint) as worker:
        assert wait_until(lambda: worker.seen == [1], 30)
        ticks = worker.runner.stats.ticks
        assert wait_until(lambda: worker.runner.stats.ticks > ticks + 1, 30)  # idle ticks
        add_item(sqlite_db, 2)
        assert wait_until(lambda: worker.seen == [1, 2], 30), "adaptive polling did not poll"


def test_parse_wake() -> None:
    assert isinstance(parse_wake("adaptive"), AdaptivePolling)
    fast = parse_wake("adaptive:0.2")
    assert isinstance(fast, AdaptivePolling)
    assert fast.fastest == 0.2
    notify = parse_wake("notify")
    assert isinstance(notify, NotifyHint)
    assert notify.channel is None
    named = parse_wake("notify:orders_wake")
    assert isinstance(named, NotifyHint)
    assert named.channel == "orders_wake"
    for bad in ("listen", "adaptive:soon", "adaptive:-1"):
        with pytest.raises(ConfigurationError):
            parse_wake(bad)


def test_default_channel_names() -> None:
    assert default_channel("orders") == "dbt_wake_orders"
    assert default_channel("orders", "sales") == "dbt_wake_sales_orders"
    long = default_channel("t" * 60, "s" * 10)
    assert len(long) == 63
    assert long != default_channel("t" * 61, "s" * 10)


# --- the notify hint: the trigger ----------------------------------------------------------


def notifications_until_marker(conn: psycopg.Connection[Any], channel: str) -> list[str]:
    """Payloads received on ``channel`` up to the ``end`` marker the test sends last
    (notifications arrive in commit order, so this counts exactly what came before)."""
    got: list[str] = []
    for note in conn.notifies(timeout=30):
        if note.channel != channel:
            continue
        if note.payload == "end":
            return got
        got.append(note.payload)
    raise AssertionError(f"no end marker on {channel}; got {got}")


def test_the_trigger_notifies_once_per_writing_transaction(pg: TestDatabase) -> None:
    make_items(pg)
    plan = install(pg.engine, "items", schema=pg.schema)
    assert plan.channel == default_channel("items", pg.schema)
    assert installed_channel(pg.engine, "items", schema=pg.schema) == plan.channel
    dsn = sa.make_url(pg.url).set(drivername="postgresql")
    listen_url = dsn.render_as_string(hide_password=False)
    with psycopg.connect(listen_url, autocommit=True) as conn:
        conn.execute(f'LISTEN "{plan.channel}"')
        with pg.engine.begin() as tx:  # three statements, four rows: one notification
            table = pg.qualified("items")
            tx.execute(sa.text(f"INSERT INTO {table} (id, note) VALUES (1, 'a'), (2, 'b')"))
            tx.execute(sa.text(f"INSERT INTO {table} (id, note) VALUES (3, 'c')"))
            tx.execute(sa.text(f"UPDATE {table} SET note = 'z'"))
        with pg.engine.connect() as tx:  # rolled back: none
            tx.execute(sa.text(f"INSERT INTO {table} (id, note) VALUES (9, 'x')"))
            tx.rollback()
        pg.execute(f"DELETE FROM {table} WHERE id = 3")  # a delete: one more
        pg.execute("SELECT pg_notify(:c, 'end')", {"c": plan.channel})
        assert notifications_until_marker(conn, plan.channel) == ["", ""]


def test_install_is_idempotent_and_uninstall_removes_it(pg: TestDatabase) -> None:
    make_items(pg)
    db = pg
    db.execute(f"CREATE TABLE {db.qualified('other')} (id int PRIMARY KEY)")
    install(db.engine, "items", schema=db.schema)
    install(db.engine, "items", schema=db.schema, channel="items_wake")  # replaced, not doubled
    install(db.engine, "other", schema=db.schema)
    assert installed_channel(db.engine, "items", schema=db.schema) == "items_wake"
    triggers = db.scalar(
        "SELECT count(*) FROM pg_trigger WHERE tgname = 'dbt_wake' AND NOT tgisinternal"
    )
    assert triggers == 2
    # The shared function stays while another table's trigger uses it.
    assert not any(
        "FUNCTION" in s for s in plan_uninstall(db.engine, "items", schema=db.schema).statements
    )
    uninstall(db.engine, "items", schema=db.schema)
    assert installed_channel(db.engine, "items", schema=db.schema) is None
    assert plan_uninstall(db.engine, "items", schema=db.schema).statements == ()
    last = plan_uninstall(db.engine, "other", schema=db.schema)
    assert any("DROP FUNCTION" in s for s in last.statements)
    uninstall(db.engine, "other", schema=db.schema)
    assert installed_channel(db.engine, "other", schema=db.schema) is None


def test_install_refuses_what_it_cannot_serve(pg: TestDatabase, sqlite_db: TestDatabase) -> None:
    make_items(sqlite_db)
    with pytest.raises(ConfigurationError, match="adaptive"):
        plan_install(sqlite_db.engine, "items")
    with pytest.raises(ConfigurationError, match="no table"):
        plan_install(pg.engine, "missing", schema=pg.schema)
    make_items(pg)
    with pytest.raises(UnsafeIdentifierError):
        plan_install(pg.engine, "items", schema=pg.schema, channel="x'); DROP TABLE items; --")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A short ``dbtrigger wake`` command (never signalled): forked from the test
    process's CLI server (tests/doc_cli.py), 0.08 s of CPU instead of 0.4."""
    return subprocess.run(
        [dbtrigger_command(), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_install_is_a_dry_run_until_yes(pg: TestDatabase) -> None:
    make_items(pg)
    where = ["--url", pg.url, "--table", "items", "--schema", str(pg.schema)]
    done = run_cli("wake", "status", *where)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no wake-up trigger" in done.stdout
    done = run_cli("wake", "install", *where)
    assert done.returncode == 0, done.stderr
    assert "CREATE TRIGGER dbt_wake AFTER INSERT OR UPDATE OR DELETE" in done.stdout
    assert "FOR EACH STATEMENT" in done.stdout
    assert "dry run" in done.stdout
    assert installed_channel(pg.engine, "items", schema=pg.schema) is None
    done = run_cli("wake", "install", *where, "--yes")
    assert done.returncode == 0, done.stderr
    assert "--wake notify" in done.stdout
    channel = default_channel("items", pg.schema)
    assert installed_channel(pg.engine, "items", schema=pg.schema) == channel
    done = run_cli("wake", "status", *where)
    assert done.returncode == 0
    assert channel in done.stdout
    done = run_cli("wake", "uninstall", *where)
    assert "dry run" in done.stdout
    assert installed_channel(pg.engine, "items", schema=pg.schema) == channel
    done = run_cli("wake", "uninstall", *where, "--yes")
    assert done.returncode == 0, done.stderr
    assert installed_channel(pg.engine, "items", schema=pg.schema) is None


# --- the notify hint: the worker -----------------------------------------------------------


@pytest.fixture
def items_pg(pg: TestDatabase) -> TestDatabase:
    make_items(pg)
    install(pg.engine, "items", schema=pg.schema)
    return pg


def test_a_commit_wakes_an_idle_poller(items_pg: TestDatabase) -> None:
    metrics = InMemoryMetrics()
    trigger = poller(items_pg, metrics=metrics)
    hint = NotifyHint()
    with Worker(trigger, LONG_INTERVAL, wake=hint) as worker:
        assert hint.listener is not None
        assert hint.listener.listening.wait(60)
        assert wait_until(lambda: worker.runner.stats.ticks >= 1)
        add_item(items_pg, 1)
        assert wait_until(lambda: worker.seen == [1], 30), "the NOTIFY did not wake the worker"
        add_item(items_pg, 2)
        assert wait_until(lambda: worker.seen == [1, 2], 30)
    assert metrics.total("wake_notifications_total") >= 2
    assert not hint.listener.listening.is_set()  # the runner stopped the listener


def test_a_commit_wakes_a_change_log_poller(pg: TestDatabase) -> None:
    make_items(pg)
    install_changelog(pg.engine, "items", schema=pg.schema)
    install(pg.engine, "items", schema=pg.schema)  # on the watched table
    source = ChangeLogSource(url=pg.url, table="items", schema=pg.schema)
    trigger = PollTrigger(
        name="items-log", source=source, checkpoint_store=InMemoryCheckpointStore()
    )
    hint = NotifyHint()  # the watched table's channel
    with Worker(trigger, LONG_INTERVAL, wake=hint) as worker:
        assert hint.channel == default_channel("items", pg.schema)
        assert hint.listener is not None
        assert hint.listener.listening.wait(60)
        assert wait_until(lambda: worker.runner.stats.ticks >= 1)
        add_item(pg, 7)
        assert wait_until(lambda: worker.seen == [7], 30), "the NOTIFY did not wake the worker"


def test_without_notifications_the_interval_poll_still_finds_rows(pg: TestDatabase) -> None:
    """A hint that never comes (no trigger installed, or a producer that bypasses
    it) costs what polling alone costs: the interval poll finds the row."""
    make_items(pg)  # no wake-up trigger
    hint = NotifyHint()
    with Worker(poller(pg), 0.3, wake=hint) as worker:
        assert hint.listener is not None
        assert hint.listener.listening.wait(60)
        add_item(pg, 1)
        assert wait_until(lambda: worker.seen == [1], 30)


def test_a_lost_listener_falls_back_to_the_interval_and_reconnects(
    items_pg: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    hint = NotifyHint()
    with Worker(poller(items_pg), 0.3, wake=hint) as worker:
        listener = hint.listener
        assert listener is not None
        assert listener.listening.wait(60)
        with items_pg.engine.connect() as conn:  # the DBA kills the LISTEN session
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN%' AND datname = current_database()"
                )
            )
        assert wait_until(
            lambda: any(getattr(r, "event", "") == "wake_listen_failed" for r in caplog.records)
        )
        add_item(items_pg, 1)
        assert wait_until(lambda: worker.seen == [1], 30)
        assert listener.listening.wait(60)  # and it reconnected


def test_the_notify_hint_refuses_what_it_cannot_serve(
    sqlite_db: TestDatabase, pg: TestDatabase
) -> None:
    make_items(sqlite_db)
    with pytest.raises(ConfigurationError, match="LISTEN/NOTIFY"):
        Runner(poller(sqlite_db), lambda events: None, wake=NotifyHint())
    query = SqlAlchemySource(
        url=pg.url,
        query="SELECT 1 AS id, now() AS updated_at",
        cursor_column="updated_at",
        pk_columns=["id"],
    )
    trigger = PollTrigger(name="q", source=query, checkpoint_store=InMemoryCheckpointStore())
    with pytest.raises(ConfigurationError, match="name the channel"):
        Runner(trigger, lambda events: None, wake=NotifyHint())
    Runner(trigger, lambda events: None, wake=NotifyHint("my_channel")).wake.close()  # type: ignore[union-attr]


def test_dbtrigger_run_wake_notify(pg: TestDatabase, tmp_path: Path) -> None:
    """``dbtrigger run --wake notify``: the banner says so, the listener starts, and
    a commit on the table is delivered although the interval is 300 s."""
    table = orders_table(pg)
    install(pg.engine, "orders", schema=pg.schema)
    write_module(tmp_path, "wake_app", pg.url, pollers={"orders": "pass"}, schema=pg.schema)
    inserted: list[bool] = []

    def done(lines: list[str]) -> bool:
        if not inserted and any("listening on" in line for line in lines):
            insert(pg, table, [{"id": 1, "updated_at": naive(1), "note": "a"}])
            inserted.append(True)
        return any("orders: committed 1 row " in line for line in lines)

    code, _, err = run_until(
        ["run", "wake_app:orders", "--interval", str(LONG_INTERVAL), "--wake", "notify"],
        tmp_path,
        done,
    )
    assert code == 0, err
    assert "wake-up     notify: a NOTIFY" in err
    assert f"listening on {default_channel('orders', pg.schema)}" in err


def test_dbtrigger_run_refuses_a_bad_wake(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    orders_table(sqlite_db)
    write_module(tmp_path, "bad_wake", sqlite_db.url, pollers={"orders": "pass"})
    done = run_worker(["run", "bad_wake:orders", "--wake", "notify", "--max-ticks", "1"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "LISTEN/NOTIFY" in done.stderr
    done = run_worker(["run", "bad_wake:orders", "--wake", "sometimes"], tmp_path)
    assert done.returncode == 2
    assert "--wake takes" in done.stderr
    done = run_worker(
        [
            "run",
            "bad_wake:orders",
            "--wake",
            "adaptive:0.1",
            "--interval",
            "0.1",
            "--max-ticks",
            "2",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "wake-up     adaptive:0.1: shorter idle waits" in done.stderr


def test_cli_names_what_failed_when_the_database_cannot_be_reached() -> None:
    where = ["--url", "postgresql+psycopg://app:pw@127.0.0.1:1/shop", "--table", "items"]
    done = run_cli("wake", "status", *where)
    assert done.returncode == 2
    assert "error: could not read the triggers of items: OperationalError: " in done.stderr
    done = run_cli("wake", "install", *where, "--yes")
    assert done.returncode == 2
    assert "error: installing the wake-up trigger failed: OperationalError: " in done.stderr
    assert "pw@" not in done.stderr + done.stdout
