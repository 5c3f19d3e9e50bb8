"""Late commits: no row is lost when transactions commit out of cursor order.

The workload tests run real concurrent writers against real databases while
pollers drain continuously, and compare what was delivered with what was
committed. Every workload includes a *straggler*: a transaction that takes the
smallest cursor values first and commits only after the unguarded pollers have
checkpointed past them. The same run therefore shows both sides: the guarded
pollers lose nothing, the unguarded ones lose the straggler (which proves the
workload can make a poller fail). On PostgreSQL a second, *silent* straggler
holds ``now()`` and a sequence value without writing (so without a transaction
id) while the horizons move: the case an xid-only view of open transactions
gets wrong.

Each test is bounded to a few seconds of writing (plus the safety window on
MariaDB). PostgreSQL workloads run in a database of their own, because the
transaction horizon looks at every open transaction of the database and other
tests share the default one.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql

from dbtrigger import (
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.sources.visibility import (
    DEFAULT_WINDOW_SECONDS,
    XID_COLUMN_MARKER,
    NoGuard,
    SafetyWindow,
    SnapshotHorizon,
    TransactionHorizon,
    choose,
    install_visibility_trigger,
    parse_visibility,
    visibility_trigger_ddl,
    window_predicate,
)
from tests.databases import PG_ADMIN_URL, TestDatabase, admin_engine

UTC = dt.timezone.utc


# --- harness ---------------------------------------------------------------------


@dataclass
class Poller:
    """A PollTrigger ticking in a thread, recording what it delivered."""

    label: str
    trigger: PollTrigger
    source: SqlAlchemySource
    interval: float = 0.03
    delivered: set[tuple[int, Any]] = field(default_factory=set)
    blocking_pids: set[int] = field(default_factory=set)
    held_back_ticks: int = 0
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def handle(self, events: list[RowChange]) -> None:
        self.delivered.update((e.pk["id"], e.cursor) for e in events)

    def tick(self) -> None:
        self.trigger.tick(self.handle)
        info = self.source.last_fetch_info
        if info is not None and info.held_back:
            self.held_back_ticks += 1
            if info.blocking_pid is not None:
                self.blocking_pids.add(info.blocking_pid)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.tick()
            except Exception as exc:
                self.errors.append(exc)
                return
            self.stop.wait(self.interval)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"poller-{self.label}", daemon=True)
        self.thread.start()

    def finish(self, until: Callable[[], bool] | None = None, timeout: float = 30) -> None:
        """Stop the thread, then drain whatever is left from the main thread.

        With ``until``, drain again until it holds (bounded by ``timeout``): a
        horizon may be held back a little longer by another session's
        transaction on a shared server, and a loaded machine must not fail a
        poller that is only late.
        """
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        assert not self.errors, f"{self.label}: {self.errors[0]!r}"
        self.trigger.drain(self.handle)
        if until is not None:
            wait_until(lambda: until() or (self.trigger.drain(self.handle), until())[1], timeout)

    def position(self) -> Position:
        state = self.trigger.read_state()
        return state.position if state else BEGINNING

    def passed(self, cursor: Any, pk: int) -> bool:
        position = self.position()
        if position.is_beginning:
            return False
        return (position.cursor, position.pk["id"]) > (cursor, pk)


def make_poller(
    label: str, url: str, cursor: str, store: Any, schema: str | None = None, **kwargs: Any
) -> Poller:
    source = SqlAlchemySource(
        url=url, table="events", schema=schema, cursor_column=cursor, pk_columns=["id"], **kwargs
    )
    trigger = PollTrigger(
        name=label, source=source, checkpoint_store=store, batch_size=25, max_batches_per_tick=4
    )
    return Poller(label, trigger, source)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def lost_rows(poller: Poller, final: list[Any], column: str) -> set[tuple[int, Any]]:
    """Committed row versions (final state) the poller never delivered."""
    expected = {(row.id, getattr(row, column)) for row in final}
    return expected - poller.delivered


Insert = Callable[[sa.Connection, random.Random, int], int]


def simple_insert(sql: str) -> Insert:
    def insert(conn: sa.Connection, rng: random.Random, writer: int) -> int:
        del rng
        return int(conn.execute(sa.text(sql), {"w": writer}).scalar_one())

    return insert


@dataclass
class Workload:
    """Writers that insert, update and roll back with random delays.

    The first half of the run holds some transactions open across several
    poller ticks; the second half has only short transactions. Long holds keep
    a horizon parked, so flaws that only show while the horizon moves (a writer
    that took its value but has not written yet) need the short phase.
    """

    engine: sa.Engine
    insert: Insert
    update_sql: str
    writers: int = 8
    seconds: float = 3.0
    long_hold: tuple[float, float] = (0.3, 0.9)
    seed: int = 7
    committed_ids: list[int] = field(default_factory=list)
    rolled_back: int = 0
    committed_txns: int = 0
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _enough(self) -> bool:
        """Has the workload written what :meth:`check` needs? (Writing goes on past
        ``seconds`` until it has, bounded: a loaded machine writes less per second.)"""
        with self.lock:
            return (
                self.committed_txns > 20 and self.rolled_back > 0 and len(self.committed_ids) > 60
            )

    def _writer(self, index: int) -> None:
        rng = random.Random(self.seed * 100 + index)
        deadline = time.monotonic() + self.seconds
        cap = deadline + 60
        short_phase = time.monotonic() + self.seconds / 2
        try:
            with self.engine.connect() as conn:
                while time.monotonic() < deadline or (
                    time.monotonic() < cap and not self._enough()
                ):
                    long = time.monotonic() < short_phase and rng.random() < 0.12
                    hold = rng.uniform(*self.long_hold) if long else rng.uniform(0, 0.02)
                    rollback = rng.random() < 0.12
                    trans = conn.begin()
                    ids = [self.insert(conn, rng, index) for _ in range(rng.randint(1, 3))]
                    with self.lock:
                        target = rng.choice(self.committed_ids) if self.committed_ids else None
                    if target is not None and rng.random() < 0.3:
                        conn.execute(sa.text(self.update_sql), {"id": target, "w": index})
                    time.sleep(hold)
                    if rollback:
                        trans.rollback()
                        with self.lock:
                            self.rolled_back += 1
                    else:
                        trans.commit()
                        with self.lock:
                            self.committed_ids.extend(ids)
                            self.committed_txns += 1
        except Exception as exc:
            self.errors.append(exc)

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._writer, args=(i,), name=f"writer-{i}")
            for i in range(self.writers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=self.seconds + 90)

    def check(self) -> None:
        assert not self.errors, repr(self.errors[0])
        assert self.committed_txns > 20, "the workload barely wrote anything"
        assert self.rolled_back > 0, "the workload rolled nothing back"


# --- PostgreSQL -----------------------------------------------------------------------


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A throw-away PostgreSQL database (URL) with nobody else's transactions in it."""
    admin = admin_engine("postgresql")
    name = f"vis_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


PG_SCHEMA = """
CREATE SEQUENCE events_seq;
CREATE TABLE events (
    id bigserial PRIMARY KEY,
    seq bigint NOT NULL DEFAULT nextval('events_seq'),
    updated_at timestamptz NOT NULL DEFAULT now(),
    writer int NOT NULL
);
CREATE INDEX ix_events_updated_at_id ON events (updated_at, id);
CREATE INDEX ix_events_seq_id ON events (seq, id);
"""


def pg_insert(conn: sa.Connection, rng: random.Random, writer: int) -> int:
    """Insert a row; sometimes take the cursor values first and write a little later.

    A transaction that has read ``now()`` or ``nextval()`` but not written yet has
    no transaction id: it is invisible to any xid-based filter, yet it already
    holds an old timestamp / sequence value.
    """
    roll = rng.random()
    if roll < 0.2:  # now() is fixed at the transaction's start; the row comes later
        conn.execute(sa.text("SELECT now()"))
        time.sleep(rng.uniform(0, 0.05))
    elif roll < 0.4:  # a sequence value taken early, used later
        seq = conn.execute(sa.text("SELECT nextval('events_seq')")).scalar_one()
        time.sleep(rng.uniform(0, 0.05))
        sql = "INSERT INTO events (writer, seq) VALUES (:w, :s) RETURNING id"
        return int(conn.execute(sa.text(sql), {"w": writer, "s": seq}).scalar_one())
    sql = "INSERT INTO events (writer) VALUES (:w) RETURNING id"
    return int(conn.execute(sa.text(sql), {"w": writer}).scalar_one())


PG_UPDATE = (
    "UPDATE events SET updated_at = now(), seq = nextval('events_seq'), writer = :w WHERE id = :id"
)


@pytest.mark.postgresql
@pytest.mark.timeout(120)
def test_postgresql_concurrent_late_commits_lose_nothing_with_guards(
    pg_database: str, tmp_path: Path
) -> None:
    engine = sa.create_engine(pg_database, pool_size=12)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(PG_SCHEMA)
        install_visibility_trigger(engine, "events", index_columns=["id"])
        url = pg_database
        guarded = [
            make_poller("ts-auto", url, "updated_at", InMemoryCheckpointStore()),
            make_poller("seq-auto", url, "seq", InMemoryCheckpointStore()),
            make_poller("xid-auto", url, "dbtrigger_xid", FileCheckpointStore(tmp_path / "xid")),
        ]
        unguarded = [
            make_poller("ts-none", url, "updated_at", InMemoryCheckpointStore(), visibility="none"),
            make_poller("seq-none", url, "seq", InMemoryCheckpointStore(), visibility="none"),
            make_poller(
                "xid-none",
                url,
                "dbtrigger_xid",
                FileCheckpointStore(tmp_path / "xid-none"),
                visibility="none",
            ),
        ]
        pollers = guarded + unguarded
        columns = {
            "ts": "updated_at",
            "seq": "seq",
            "xid": "dbtrigger_xid",
        }

        # The straggler writes first, so it holds the smallest timestamp, sequence
        # value and transaction id, and stays open while everyone else commits.
        straggler = engine.connect()
        straggler.begin()
        row = straggler.execute(
            sa.text(
                "INSERT INTO events (writer) VALUES (-1) "
                "RETURNING id, seq, updated_at, dbtrigger_xid, pg_backend_pid() AS pid"
            )
        ).one()
        # The silent straggler takes now() and a sequence value but writes
        # nothing until the writers are done: no transaction id all that time,
        # while the short-transaction phase moves the horizons along.
        silent = engine.connect()
        for _ in range(5):
            silent.begin()
            quiet = silent.execute(
                sa.text(
                    "SELECT now() AS updated_at, nextval('events_seq') AS seq, "
                    "pg_backend_pid() AS pid, pg_current_xact_id_if_assigned() AS xid"
                )
            ).one()
            if quiet.xid is None:  # nextval() sometimes takes an xid to WAL-log
                break
            silent.rollback()
        assert quiet.xid is None
        for p in pollers:
            p.start()
        workload = Workload(engine, pg_insert, PG_UPDATE)
        writers = threading.Thread(target=workload.run)
        writers.start()
        time.sleep(1.0)  # several poller ticks with the straggler open
        # Commit only once every unguarded poller has checkpointed past it, and
        # every guarded one has been held back by it, by name (bounded waits).
        passed = wait_until(
            lambda: all(
                p.passed(getattr(row, columns[p.label.split("-")[0]]), row.id) for p in unguarded
            ),
            timeout=30,
        )
        named = wait_until(
            lambda: all(p.held_back_ticks >= 3 and row.pid in p.blocking_pids for p in guarded),
            timeout=30,
        )
        straggler.commit()
        straggler.close()
        ts_none, seq_none = unguarded[0], unguarded[1]
        passed_silent = wait_until(
            lambda: (
                ts_none.position().cursor > quiet.updated_at
                and seq_none.position().cursor > quiet.seq
            ),
            timeout=30,
        )
        writers.join()
        workload.check()
        named_silent = wait_until(
            lambda: all(quiet.pid in p.blocking_pids for p in guarded[:2]), timeout=30
        )
        silent_row = silent.execute(
            sa.text(
                "INSERT INTO events (writer, seq) VALUES (-2, :seq) "
                "RETURNING id, seq, updated_at, dbtrigger_xid"
            ),
            {"seq": quiet.seq},
        ).one()
        silent.commit()
        silent.close()
        with engine.connect() as conn:
            final = conn.execute(sa.text("SELECT id, seq, updated_at, dbtrigger_xid FROM events"))
            final_rows = list(final)
        for p in unguarded:
            p.finish()
        for p in guarded:
            column = columns[p.label.split("-")[0]]
            p.finish(until=lambda p=p, c=column: not lost_rows(p, final_rows, c))  # type: ignore[misc]

        assert len(final_rows) > 50
        assert named, "a guarded poller was never held back by the straggler, by name"
        assert named_silent, "a transaction horizon never named the silent straggler"
        for p in guarded:
            column = columns[p.label.split("-")[0]]
            assert lost_rows(p, final_rows, column) == set(), f"{p.label} lost rows"
            assert p.held_back_ticks >= 3, f"{p.label} was never held back"
            assert row.pid in p.blocking_pids, f"{p.label} never named the straggler's backend"
        for p in guarded[:2]:  # the transaction horizons also waited for the silent one
            assert quiet.pid in p.blocking_pids, f"{p.label} never named the silent straggler"
        assert passed, "the unguarded pollers never moved past the straggler"
        assert passed_silent, "the unguarded pollers never moved past the silent straggler"
        for p in unguarded:
            column = columns[p.label.split("-")[0]]
            lost = lost_rows(p, final_rows, column)
            assert (row.id, getattr(row, column)) in lost, f"{p.label} did not lose the straggler"
        for p in (ts_none, seq_none):
            column = columns[p.label.split("-")[0]]
            lost = lost_rows(p, final_rows, column)
            assert (silent_row.id, getattr(silent_row, column)) in lost, p.label
        assert guarded[0].source.visibility_mode == "transaction-horizon"
        assert guarded[1].source.visibility_mode == "transaction-horizon"
        assert guarded[2].source.visibility_mode == "snapshot-horizon"
        assert unguarded[0].source.visibility_mode == "none"
    finally:
        for p in locals().get("pollers", []):
            p.stop.set()
            p.source.close()
        engine.dispose()


# --- MariaDB -----------------------------------------------------------------------------


def mariadb_events(db: TestDatabase) -> tuple[str, str]:
    db.execute(
        f"CREATE TABLE {db.qualified('events')} ("
        "id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT NOW(6), "
        "writer INT NOT NULL, "
        "KEY ix_events_updated_at_id (updated_at, id))"
    )
    table = db.qualified("events")
    insert = f"INSERT INTO {table} (writer) VALUES (:w) RETURNING id"
    update = f"UPDATE {table} SET updated_at = NOW(6), writer = :w WHERE id = :id"
    return insert, update


def mariadb_final(db: TestDatabase) -> list[Any]:
    with db.engine.connect() as conn:
        return list(conn.execute(sa.text(f"SELECT id, updated_at FROM {db.qualified('events')}")))


def start_mariadb_straggler(db: TestDatabase) -> tuple[sa.Connection, Any]:
    conn = db.engine.connect()
    conn.begin()
    row = conn.execute(
        sa.text(
            f"INSERT INTO {db.qualified('events')} (writer) VALUES (-1) RETURNING id, updated_at"
        )
    ).one()
    return conn, row


@pytest.mark.mariadb
@pytest.mark.timeout(120)
def test_mariadb_concurrent_late_commits_within_the_window_lose_nothing(
    mariadb: TestDatabase,
) -> None:
    window = 3.0
    insert, update = mariadb_events(mariadb)
    guarded = make_poller(
        "window",
        mariadb.url,
        "updated_at",
        InMemoryCheckpointStore(),
        schema=mariadb.schema,
        visibility=SafetyWindow(window),
    )
    unguarded = make_poller(
        "none",
        mariadb.url,
        "updated_at",
        InMemoryCheckpointStore(),
        schema=mariadb.schema,
        visibility="none",
    )
    try:
        straggler, row = start_mariadb_straggler(mariadb)
        guarded.start()
        # Every transaction, the straggler included, commits well inside the window.
        workload = Workload(mariadb.engine, simple_insert(insert), update, long_hold=(0.2, 0.6))
        writers = threading.Thread(target=workload.run)
        writers.start()
        # The straggler must commit inside the window, so this wait has a fixed
        # budget; the unguarded poller ticks right here (one tick past a later
        # row is all it needs), not in a thread a loaded machine may not schedule.
        passed = wait_until(
            lambda: (unguarded.tick(), unguarded.passed(row.updated_at, row.id))[1], timeout=2.2
        )
        straggler.commit()
        straggler.close()
        unguarded.start()
        writers.join()
        workload.check()
        time.sleep(window + 0.3)  # the last commits age past the window
        final = mariadb_final(mariadb)
        guarded.finish(until=lambda: not lost_rows(guarded, final, "updated_at"))
        unguarded.finish()
        assert len(final) > 50
        assert lost_rows(guarded, final, "updated_at") == set()
        assert passed, "the unguarded poller never moved past the straggler"
        lost = lost_rows(unguarded, final, "updated_at")
        assert (row.id, row.updated_at) in lost
        assert guarded.source.visibility_mode == "safety-window(3s)"
    finally:
        for p in (guarded, unguarded):
            p.stop.set()
            p.source.close()


@pytest.mark.mariadb
@pytest.mark.timeout(60)
def test_mariadb_transaction_longer_than_the_window_is_the_residual_risk(
    mariadb: TestDatabase,
) -> None:
    """A writer that holds its timestamp longer than the window can still be skipped."""
    insert, _ = mariadb_events(mariadb)
    guarded = make_poller(
        "window",
        mariadb.url,
        "updated_at",
        InMemoryCheckpointStore(),
        schema=mariadb.schema,
        visibility=SafetyWindow(1.0),
    )
    try:
        straggler, row = start_mariadb_straggler(mariadb)
        time.sleep(0.05)
        mariadb.execute(insert.replace(" RETURNING id", ""), {"w": 1})
        guarded.start()
        # The later row ages past the 1 s window and is consumed while the
        # straggler is still open: the guard's documented limit.
        assert wait_until(lambda: guarded.passed(row.updated_at, row.id), timeout=15)
        straggler.commit()
        straggler.close()
        time.sleep(1.2)
        guarded.finish()
        lost = lost_rows(guarded, mariadb_final(mariadb), "updated_at")
        assert lost == {(row.id, row.updated_at)}
    finally:
        guarded.stop.set()
        guarded.source.close()


@pytest.mark.mariadb
def test_mariadb_auto_modes_and_window_options(
    mariadb: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    table = mariadb.qualified("items")
    mariadb.execute(
        f"CREATE TABLE {table} (id BIGINT PRIMARY KEY, n BIGINT NOT NULL, "
        "created_at DATETIME(6) NOT NULL, updated_at TIMESTAMP(6) NOT NULL)"
    )
    mariadb.execute(
        f"INSERT INTO {table} VALUES (1, 1, NOW(6) - INTERVAL 1 HOUR, NOW(6) - INTERVAL 1 HOUR), "
        "(2, 2, NOW(6), NOW(6))"
    )

    def source(cursor: str, **kwargs: Any) -> SqlAlchemySource:
        return SqlAlchemySource(
            url=mariadb.url,
            table="items",
            schema=mariadb.schema,
            cursor_column=cursor,
            pk_columns=["id"],
            **kwargs,
        )

    timestamped = source("updated_at")
    assert timestamped.visibility_mode == "auto"
    # With PROCESS (root here) auto is the exact transaction horizon; without
    # it, the 5 s window (tests/test_visibility_mariadb.py).
    # (Bounded: another session's open writer on the shared server holds the
    # server-wide horizon back for a moment.)
    assert wait_until(lambda: [r["id"] for r in timestamped.fetch(BEGINNING, 10)][:1] == [1], 30)
    assert timestamped.visibility_mode == "transaction-horizon"
    assert timestamped.describe()["visibility_guarantee"].startswith("exact")
    windowed = source("updated_at", visibility=SafetyWindow())
    assert [r["id"] for r in windowed.fetch(BEGINNING, 10)] == [1]  # row 2 is inside 5 s
    assert windowed.visibility_mode == f"safety-window({DEFAULT_WINDOW_SECONDS:g}s)"
    assert windowed.describe()["visibility_guarantee"].startswith("bounded")

    with caplog.at_level(logging.INFO, logger="dbtrigger.sources"):
        integer = source("n")
        assert [r["id"] for r in integer.fetch(BEGINNING, 10)] == [1, 2]
    assert integer.visibility_mode == "none"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "auto without a guard must say so"
    assert getattr(warnings[0], "event", None) == "visibility_mode"
    assert "time_column" in warnings[0].getMessage()

    # An integer cursor written together with a timestamp: window on the timestamp.
    paired = source("n", visibility=SafetyWindow(5, time_column="created_at"))
    assert [r["id"] for r in paired.fetch(BEGINNING, 10)] == [1]

    # Naive UTC values read by a session in another time zone: utc=True.
    shifted = {"connect_args": {"init_command": "SET time_zone = '+05:00'"}}
    mariadb.execute(f"UPDATE {table} SET created_at = UTC_TIMESTAMP(6) WHERE id = 2")
    local = source("created_at", visibility=SafetyWindow(5), engine_kwargs=shifted)
    utc = source("created_at", visibility=SafetyWindow(5, utc=True), engine_kwargs=shifted)
    assert [r["id"] for r in local.fetch(BEGINNING, 10)] == [1, 2]  # 5 h "old": unsafe
    assert [r["id"] for r in utc.fetch(BEGINNING, 10)] == [1]
    for s in (timestamped, windowed, integer, paired, local, utc):
        s.close()


# --- SQLite ---------------------------------------------------------------------------------


def sqlite_events(db: TestDatabase) -> sa.Table:
    table = sa.Table(
        "events",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    table.metadata.create_all(db.engine)
    return table


def utcnow() -> dt.datetime:
    return dt.datetime.now(UTC).replace(tzinfo=None)


def sqlite_pollers(db: TestDatabase, window: float) -> tuple[Poller, Poller]:
    guarded = make_poller(
        "window", db.url, "updated_at", InMemoryCheckpointStore(), visibility=SafetyWindow(window)
    )
    unguarded = make_poller(
        "none", db.url, "updated_at", InMemoryCheckpointStore(), visibility="none"
    )
    return guarded, unguarded


def test_sqlite_window_waits_for_a_late_application_timestamp(sqlite_db: TestDatabase) -> None:
    """A writer that stamped its row before waiting for the write lock commits late.

    The window is 5 s, not 1 s: the first tick must come while row 2 is inside it,
    and a loaded machine took longer than 1 s between the insert and the tick."""
    table = sqlite_events(sqlite_db)
    guarded, unguarded = sqlite_pollers(sqlite_db, window=5.0)
    late_stamp = utcnow()  # taken, then the writer waits for the lock
    time.sleep(0.01)
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.insert(), {"id": 2, "updated_at": utcnow()})
    guarded.tick()
    unguarded.tick()
    assert unguarded.delivered
    assert not guarded.delivered  # row 2 is inside the window
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.insert(), {"id": 1, "updated_at": late_stamp})
    unguarded.tick()
    # Both rows once they age past the window (bounded wait, not a sleep and a tick).
    assert wait_until(lambda: (guarded.tick(), len(guarded.delivered) >= 2)[1], timeout=30)
    assert sorted(pk for pk, _ in guarded.delivered) == [1, 2]
    assert sorted(pk for pk, _ in unguarded.delivered) == [2]  # row 1 fell behind the checkpoint
    with sqlite_db.engine.connect() as conn:  # as stored text, as the source reads it
        final = list(conn.execute(sa.text("SELECT id, updated_at FROM events")))
    guarded.finish()
    unguarded.finish()
    assert lost_rows(guarded, final, "updated_at") == set()
    assert {pk for pk, _ in lost_rows(unguarded, final, "updated_at")} == {1}


def test_sqlite_writer_later_than_the_window_is_the_residual_risk(
    sqlite_db: TestDatabase,
) -> None:
    table = sqlite_events(sqlite_db)
    guarded, _ = sqlite_pollers(sqlite_db, window=0.5)
    late_stamp = utcnow()
    time.sleep(0.01)
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.insert(), {"id": 2, "updated_at": utcnow()})
    time.sleep(0.6)
    guarded.tick()  # row 2 is older than the window: consumed
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.insert(), {"id": 1, "updated_at": late_stamp})
    time.sleep(0.6)
    guarded.finish()
    assert sorted(pk for pk, _ in guarded.delivered) == [2]


def test_sqlite_window_reads_every_text_timestamp_format(sqlite_db: TestDatabase) -> None:
    sqlite_db.execute("CREATE TABLE stamps (id INTEGER PRIMARY KEY, ts DATETIME NOT NULL)")
    fresh = utcnow().isoformat(timespec="microseconds")
    sqlite_db.execute(
        "INSERT INTO stamps VALUES (1, '2020-01-01T00:00:00Z'), (2, '2020-01-01 00:00:01'), "
        "(3, '2020-01-01T00:00:02.500000'), (4, :fresh), (5, CURRENT_TIMESTAMP)",
        {"fresh": fresh},
    )
    source = SqlAlchemySource(
        url=sqlite_db.url, table="stamps", cursor_column="ts", pk_columns=["id"]
    )
    # (Mixed formats sort as text, so only the set is meaningful here.)
    assert {r["id"] for r in source.fetch(BEGINNING, 10)} == {1, 2, 3}
    assert source.visibility_mode == f"safety-window({DEFAULT_WINDOW_SECONDS:g}s)"
    none = SqlAlchemySource(
        url=sqlite_db.url, table="stamps", cursor_column="ts", pk_columns=["id"], visibility="none"
    )
    assert len(none.fetch(BEGINNING, 10)) == 5


def test_sqlite_auto_modes(sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture) -> None:
    sqlite_db.execute("CREATE TABLE seqs (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, ts TEXT)")
    sqlite_db.execute("INSERT INTO seqs VALUES (1, 1, CURRENT_TIMESTAMP)")
    with caplog.at_level(logging.INFO, logger="dbtrigger.sources"):
        integer = SqlAlchemySource(
            url=sqlite_db.url, table="seqs", cursor_column="n", pk_columns=["id"]
        )
        assert len(integer.fetch(BEGINNING, 10)) == 1
    assert integer.visibility_mode == "none"
    assert "one writer at a time" in (integer.visibility_guarantee or "")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Query mode has no declared types: auto looks at a value (here a text timestamp).
    query = SqlAlchemySource(
        url=sqlite_db.url, query="SELECT id, ts FROM seqs", cursor_column="ts", pk_columns=["id"]
    )
    assert query.visibility_mode == "auto"
    assert query.fetch(BEGINNING, 10) == []  # the only row is inside the window
    assert query.visibility_mode.startswith("safety-window")
    empty = SqlAlchemySource(
        url=sqlite_db.url,
        query="SELECT id, ts FROM seqs WHERE id > 100",
        cursor_column="ts",
        pk_columns=["id"],
    )
    assert empty.fetch(BEGINNING, 10) == []
    assert empty.visibility_mode == "auto"  # nothing to decide on yet


def test_sqlite_window_never_holds_back_a_value_it_cannot_place(sqlite_db: TestDatabase) -> None:
    """Held back while later rows flow, a row is skipped once the checkpoint passes it.

    Integers in query mode were taken for Julian day numbers (3,000,000 is a
    day in the year 3501) and every row above today's day number waited for
    ever; a text stamp julianday() cannot read made the window's test NULL.
    """
    sqlite_db.execute("CREATE TABLE seqs (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
    sqlite_db.execute("INSERT INTO seqs VALUES (1, 10), (2, 3000000), (3, 6000000)")
    query = SqlAlchemySource(
        url=sqlite_db.url, query="SELECT id, n FROM seqs", cursor_column="n", pk_columns=["id"]
    )
    assert [r["id"] for r in query.fetch(BEGINNING, 10)] == [1, 2, 3]
    assert query.visibility_mode == "none"

    sqlite_db.execute("CREATE TABLE stamps (id INTEGER PRIMARY KEY, ts DATETIME NOT NULL)")
    recent = utcnow() - dt.timedelta(seconds=10)
    sqlite_db.execute(
        "INSERT INTO stamps VALUES (1, 1577836800), (2, '2020/01/01 00:00:00'), "
        "(3, '2020-01-01 00:00:00'), (4, :recent), (5, :recent_epoch)",
        {
            "recent": recent.isoformat(sep=" ", timespec="microseconds"),
            "recent_epoch": int(recent.replace(tzinfo=dt.timezone.utc).timestamp()),
        },
    )
    source = SqlAlchemySource(
        url=sqlite_db.url,
        table="stamps",
        cursor_column="ts",
        pk_columns=["id"],
        visibility=SafetyWindow(3600),
    )
    # Unix time 2020 and the unreadable format are released; both recent rows wait.
    assert {r["id"] for r in source.fetch(BEGINNING, 10)} == {1, 2, 3}


# --- PostgreSQL: the transaction-id column, reporting, privileges ---------------------------


def pg_table(url: str, ddl: str) -> sa.Engine:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(ddl)
    return engine


@pytest.mark.postgresql
def test_install_visibility_trigger_stamps_the_writing_transaction(pg: TestDatabase) -> None:
    pg.execute(f"CREATE TABLE {pg.qualified('items')} (id int PRIMARY KEY, note text)")
    pg.execute(f"INSERT INTO {pg.qualified('items')} VALUES (1, 'before install')")
    for _ in range(2):  # idempotent
        install_visibility_trigger(pg.engine, "items", schema=pg.schema, index_columns=["id"])
    table = pg.qualified("items")
    with pg.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (2, 'new'), (3, 'new')"))
        xid = conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
    with pg.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {table} SET note = 'moved' WHERE id = 3"))
        later = conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
    with pg.engine.connect() as conn:
        rows = dict(conn.execute(sa.text(f"SELECT id, dbtrigger_xid FROM {table}")).all())
        comment = conn.execute(
            sa.text("SELECT col_description(CAST(:t AS regclass), 3)"), {"t": table}
        ).scalar_one()
    assert rows == {1: 0, 2: xid, 3: later}
    assert comment.startswith(XID_COLUMN_MARKER)
    source = SqlAlchemySource(
        url=pg.url,
        table="items",
        schema=pg.schema,
        cursor_column="dbtrigger_xid",
        pk_columns=["id"],
    )
    # The snapshot horizon is cluster-wide: a transaction of some other session on
    # this server can hold it back for a moment. Wait (bounded) for it to pass.
    deadline = time.monotonic() + 30
    while [r["id"] for r in source.fetch(BEGINNING, 10)] != [1, 2, 3]:
        assert time.monotonic() < deadline, f"still held back: {source.last_fetch_info}"
        time.sleep(0.1)
    assert source.visibility_mode == "snapshot-horizon"
    info = source.last_fetch_info
    assert info is not None
    assert info.horizon > later
    assert not info.held_back
    source.close()


@pytest.mark.postgresql
def test_snapshot_horizon_refuses_a_column_that_is_not_a_transaction_id(
    pg: TestDatabase,
) -> None:
    pg.execute(f"CREATE TABLE {pg.qualified('items')} (id int PRIMARY KEY, n bigint NOT NULL)")
    pg.execute(f"INSERT INTO {pg.qualified('items')} VALUES (1, 1)")

    def source(guard: SnapshotHorizon) -> SqlAlchemySource:
        return SqlAlchemySource(
            url=pg.url,
            table="items",
            schema=pg.schema,
            cursor_column="n",
            pk_columns=["id"],
            visibility=guard,
        )

    with pytest.raises(ConfigurationError, match="install_visibility_trigger"):
        source(SnapshotHorizon()).fetch(BEGINNING, 10)
    trusted = source(SnapshotHorizon(require_marker=False))
    assert len(trusted.fetch(BEGINNING, 10)) == 1  # 1 < any live transaction id
    trusted.close()


@pytest.mark.postgresql
@pytest.mark.parametrize("cursor", ["updated_at", "dbtrigger_xid"])
def test_horizon_held_back_names_the_blocking_backend(
    pg_database: str, cursor: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = pg_table(
        pg_database,
        "CREATE TABLE events (id bigserial PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT now(), writer int NOT NULL)",
    )
    install_visibility_trigger(engine, "events", index_columns=["id"])
    guard = (
        TransactionHorizon(warn_after_seconds=0.3)
        if cursor == "updated_at"
        else SnapshotHorizon(warn_after_seconds=0.3)
    )
    source = SqlAlchemySource(
        url=pg_database, table="events", cursor_column=cursor, pk_columns=["id"], visibility=guard
    )
    blocker = engine.connect()
    try:
        blocker.begin()
        blocker.execute(sa.text("INSERT INTO events (writer) VALUES (1)"))
        pid = blocker.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO events (writer) VALUES (2)"))
        with caplog.at_level(logging.INFO, logger="dbtrigger.sources"):
            assert source.fetch(BEGINNING, 10) == []
            time.sleep(0.5)
            # The snapshot horizon is cluster-wide: while another test's older
            # transaction is open on this server, that one is named. Wait (with a
            # bound) until ours is the oldest, rather than assuming it at once.
            # The warning is rate-limited to one per warn_after_seconds, so the
            # one naming ours comes within a few fetches of ours being the oldest.
            deadline = time.monotonic() + 30

            def ours() -> list[logging.LogRecord]:
                return [
                    r
                    for r in caplog.records
                    if r.levelno == logging.WARNING and getattr(r, "blocking_pid", None) == pid
                ]

            while True:
                assert source.fetch(BEGINNING, 10) == []
                info = source.last_fetch_info
                assert info is not None
                assert info.held_back
                if info.blocking_pid == pid and ours():
                    break
                assert time.monotonic() < deadline, f"blocker never named: {info}"
                time.sleep(0.1)
            assert info.held_back_seconds >= 0.3
            assert info.blocking_xact_age_seconds is not None
            assert info.blocking_xact_age_seconds >= 0.5
            for warning in caplog.records:
                if warning.levelno == logging.WARNING:
                    assert getattr(warning, "event", None) == "visibility_held_back"
            for warning in ours():
                assert f"pid {pid}" in warning.getMessage()
            blocker.commit()
            # (The snapshot horizon is cluster-wide: allow another session's
            # transaction on this server a moment to finish.)
            deadline = time.monotonic() + 30
            while [r["id"] for r in source.fetch(BEGINNING, 10)] != [1, 2]:
                assert time.monotonic() < deadline, f"still held back: {source.last_fetch_info}"
                time.sleep(0.1)
            info = source.last_fetch_info
            assert info is not None
            assert not info.held_back
        assert any(getattr(r, "event", None) == "visibility_released" for r in caplog.records)
    finally:
        blocker.close()
        source.close()
        engine.dispose()


@pytest.mark.postgresql
@pytest.mark.parametrize(
    ("cursor", "take_value"),
    [("updated_at", "SELECT now()"), ("seq", "SELECT nextval('events_seq')")],
)
def test_transaction_horizon_waits_for_a_writer_that_has_not_written_yet(
    pg_database: str, cursor: str, take_value: str
) -> None:
    """A transaction that holds a cursor value but no transaction id yet still counts.

    ``now()`` is fixed when the transaction starts and ``nextval()`` is taken
    before the row is written; until the row is written the transaction has no
    xid, so an xid-based view of "open transactions" would not see it.
    """
    engine = pg_table(pg_database, PG_SCHEMA)
    source = SqlAlchemySource(
        url=pg_database, table="events", cursor_column=cursor, pk_columns=["id"]
    )
    early = engine.connect()
    try:
        for _ in range(5):
            # nextval() takes an xid when it WAL-logs the sequence (first call,
            # then every 32nd, or after a checkpoint): retry until it did not.
            early.begin()
            value = early.execute(sa.text(take_value)).scalar_one()
            xid = early.execute(sa.text("SELECT pg_current_xact_id_if_assigned()")).scalar()
            if xid is None:
                break
            early.rollback()
        assert xid is None, "could not hold a cursor value without a transaction id"
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO events (writer) VALUES (2)"))
        assert source.fetch(BEGINNING, 10) == []  # row 2 may not pass the early writer
        params = {"w": 1, "s": value} if cursor == "seq" else {"w": 1, "s": None}
        early.execute(
            sa.text(
                "INSERT INTO events (writer, seq) VALUES (:w, COALESCE(:s, nextval('events_seq')))"
            ),
            params,
        )
        early.commit()
        rows = source.fetch(BEGINNING, 10)
        assert [r["writer"] for r in rows] == [1, 2]
    finally:
        early.close()
        source.close()
        engine.dispose()


@pytest.mark.postgresql
def test_transaction_horizon_refuses_to_guess_about_sessions_it_cannot_see(
    pg_database: str,
) -> None:
    engine = pg_table(
        pg_database,
        "CREATE TABLE events (id bigserial PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT now()); INSERT INTO events DEFAULT VALUES",
    )
    admin = admin_engine("postgresql")
    prefix = f"vis_{uuid.uuid4().hex[:8]}"
    poller_role, writer_role = f"{prefix}_poll", f"{prefix}_write"
    with admin.connect() as conn:
        for role in (poller_role, writer_role):
            conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
    with engine.begin() as conn:
        conn.execute(sa.text(f'GRANT SELECT ON events TO "{poller_role}"'))
    url = sa.make_url(pg_database)
    other = sa.create_engine(url.set(username=writer_role))
    source = SqlAlchemySource(
        url=url.set(username=poller_role).render_as_string(hide_password=False),
        table="events",
        cursor_column="updated_at",
        pk_columns=["id"],
    )
    try:
        with other.connect() as idle:
            idle.execute(sa.text("SELECT 1"))
            idle.commit()  # connected, not even in a transaction: still invisible to us
            with pytest.raises(ConfigurationError, match="pg_read_all_stats"):
                source.fetch(BEGINNING, 10)
            with admin.connect() as conn:
                conn.execute(sa.text(f'GRANT pg_read_all_stats TO "{poller_role}"'))
            assert len(source.fetch(BEGINNING, 10)) == 1
    finally:
        source.close()
        other.dispose()
        with engine.begin() as conn:  # the grant lives in the test's own database
            conn.execute(sa.text(f'DROP OWNED BY "{poller_role}"'))
        engine.dispose()
        with admin.connect() as conn:
            for role in (poller_role, writer_role):
                conn.execute(sa.text(f'DROP ROLE "{role}"'))


@pytest.mark.postgresql
def test_postgresql_safety_window_on_request(pg: TestDatabase) -> None:
    table = pg.qualified("items")
    pg.execute(
        f"CREATE TABLE {table} (id int PRIMARY KEY, aware timestamptz NOT NULL, "
        "naive timestamp NOT NULL)"
    )
    pg.execute(
        f"INSERT INTO {table} VALUES (1, now() - interval '1 hour', "
        "timezone('UTC', now()) - interval '1 hour'), (2, now(), timezone('UTC', now()))"
    )
    for column, guard in (
        ("aware", SafetyWindow(2)),
        ("naive", SafetyWindow(2, utc=True)),
    ):
        source = SqlAlchemySource(
            url=pg.url,
            table="items",
            schema=pg.schema,
            cursor_column=column,
            pk_columns=["id"],
            visibility=guard,
        )
        assert [r["id"] for r in source.fetch(BEGINNING, 10)] == [1], column
        assert source.visibility_mode == "safety-window(2s)"
        source.close()


# --- configuration, choice and description (no database) -----------------------------------


@pytest.mark.parametrize(
    ("dialect", "cursor_type", "comment", "sample", "expected"),
    [
        ("postgresql", sa.DateTime(timezone=True), None, None, "transaction-horizon"),
        ("postgresql", sa.BigInteger(), None, None, "transaction-horizon"),
        ("postgresql", None, None, None, "transaction-horizon"),
        ("postgresql", sa.BigInteger(), f"{XID_COLUMN_MARKER} ...", None, "snapshot-horizon"),
        ("mariadb", sa.DateTime(), None, None, "safety-window(5s)"),
        ("mysql", sa.TIMESTAMP(), None, None, "safety-window(5s)"),
        ("mariadb", sa.BigInteger(), None, None, "none"),
        ("mariadb", sa.Date(), None, None, "none"),
        ("mariadb", None, None, True, "safety-window(5s)"),
        ("mariadb", None, None, False, "none"),
        ("sqlite", sa.DateTime(), None, None, "safety-window(5s)"),
        ("sqlite", sa.Integer(), None, None, "none"),
        ("mssql", sa.DateTime(), None, None, "safety-window(5s)"),
        ("oracle", sa.DateTime(), None, None, "none"),
    ],
)
def test_auto_chooses_the_strongest_guard(
    dialect: str,
    cursor_type: sa.types.TypeEngine[Any] | None,
    comment: str | None,
    sample: bool | None,
    expected: str,
) -> None:
    guard = choose(
        dialect, cursor_type=cursor_type, cursor_comment=comment, sample_is_timestamp=sample
    )
    assert guard.label() == expected
    assert guard.guarantee(dialect)


def test_visibility_argument_validation() -> None:
    assert parse_visibility("auto") == "auto"
    assert parse_visibility(None) == "auto"
    assert isinstance(parse_visibility("none"), NoGuard)
    window = SafetyWindow(2)
    assert parse_visibility(window) is window
    for bad in ("off", "snapshot", 5):
        with pytest.raises(ConfigurationError, match="visibility must be"):
            parse_visibility(bad)  # type: ignore[arg-type]
    for seconds in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError, match="safety window"):
            SafetyWindow(seconds)
    with pytest.raises(ConfigurationError, match="not a safe SQL identifier"):
        SafetyWindow(5, time_column="created_at; drop table x")
    with pytest.raises(ConfigurationError, match="visibility must be"):
        SqlAlchemySource(
            url="sqlite://", table="t", cursor_column="c", pk_columns=["id"], visibility="off"
        )


def test_guards_refuse_dialects_they_do_not_support(sqlite_db: TestDatabase) -> None:
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, c DATETIME)")
    sqlite_db.execute("INSERT INTO t VALUES (1, '2020-01-01 00:00:00')")
    for guard in (SnapshotHorizon(), TransactionHorizon()):
        source = SqlAlchemySource(
            url=sqlite_db.url, table="t", cursor_column="c", pk_columns=["id"], visibility=guard
        )
        with pytest.raises(ConfigurationError, match="PostgreSQL"):
            source.fetch(BEGINNING, 10)
    missing = SqlAlchemySource(
        url=sqlite_db.url,
        table="t",
        cursor_column="c",
        pk_columns=["id"],
        visibility=SafetyWindow(5, time_column="nope"),
    )
    with pytest.raises(ConfigurationError, match="time_column 'nope'"):
        missing.fetch(BEGINNING, 10)


def test_mode_is_described_but_not_fingerprinted() -> None:
    def make(**kwargs: Any) -> SqlAlchemySource:
        return SqlAlchemySource(
            url="postgresql+psycopg://u:secret@h/db",
            table="t",
            cursor_column="c",
            pk_columns=["id"],
            **kwargs,
        )

    auto, off, window = make(), make(visibility="none"), make(visibility=SafetyWindow(7))
    # A guard changes when rows are consumed, never what a position means.
    assert auto.fingerprint() == off.fingerprint() == window.fingerprint()
    assert auto.describe()["visibility"] == "auto"
    assert auto.describe()["visibility_mode"] == "auto"
    assert auto.describe()["visibility_guarantee"] is None
    assert off.describe()["visibility_mode"] == "none"
    assert off.describe()["visibility_guarantee"].startswith("none")
    assert window.describe()["visibility_mode"] == "safety-window(7s)"
    assert "7s" in window.describe()["visibility_guarantee"]


def test_sql_server_window_expression_compiles() -> None:
    """Compiled only: no SQL Server runs here (docs/visibility.md has the design)."""
    column = sa.column("updated_at", sa.DateTime())
    predicate = window_predicate(SafetyWindow(5, utc=True), "mssql", column, sa.DateTime())
    sql = str(predicate.compile(dialect=mssql.dialect(), compile_kwargs={"literal_binds": True}))
    assert sql == "updated_at < dateadd(millisecond, -5000, sysutcdatetime())"


def test_trigger_ddl_is_quoted_and_marked() -> None:
    ddl = visibility_trigger_ddl("orders", schema="sales", index_columns=["id"])
    text = "\n".join(ddl)
    assert 'ALTER TABLE "sales"."orders" ADD COLUMN IF NOT EXISTS "dbtrigger_xid" bigint' in text
    assert "pg_current_xact_id()::text::bigint" in text
    assert "BEFORE INSERT OR UPDATE" in text
    assert f"IS '{XID_COLUMN_MARKER}" in text
    assert '("dbtrigger_xid", "id")' in text
    with pytest.raises(ConfigurationError, match="not a safe SQL identifier"):
        visibility_trigger_ddl("orders; drop table x")
    long_ddl = "\n".join(visibility_trigger_ddl("t" * 60, column="c" * 60))
    assert all(
        len(name) <= 63 for name in long_ddl.replace('"', " ").split() if "dbtrigger_" in name
    )
