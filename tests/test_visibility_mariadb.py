"""MariaDB transaction horizon: long transactions lose nothing, on both cursor kinds.

Each workload test runs a long writer transaction (held well past a 1 s safety
window: the point is hold > window) and a burst of short ones, with three
pollers side by side: the horizon (``auto``), a 1 s ``SafetyWindow`` and no
guard. The window and the unguarded poller lose the long writer's rows (so the
workload can fail a poller); the horizon loses none. A read-only transaction is
open the whole time and must never be what holds the horizon back.

The tests are scaled down for CI (3 s holds, ~4 s of writing); the benchmark
(``benchmarks/visibility.py``) runs 8-12 s holds and prints the delays.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, SqlAlchemySource
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.sources.visibility import MariaDbHorizon, SafetyWindow, TransactionHorizon
from tests.databases import TestDatabase
from tests.test_visibility import Poller, make_poller, wait_until

pytestmark = pytest.mark.mariadb

HOLD = 3.0  # the long writer's hold, longer than the window
WINDOW = 1.0


def create_events(db: TestDatabase) -> None:
    """``seq`` AUTO_INCREMENT and ``updated_at`` CURRENT_TIMESTAMP(6): one table, both kinds."""
    db.execute(
        f"CREATE TABLE {db.qualified('events')} ("
        "id BIGINT PRIMARY KEY DEFAULT (UUID_SHORT()), "
        "seq BIGINT NOT NULL AUTO_INCREMENT UNIQUE KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), "
        "writer INT NOT NULL, "
        "KEY ix_events_updated_at_id (updated_at, id))"
    )


def insert_row(conn: sa.Connection, db: TestDatabase, writer: int) -> Any:
    return conn.execute(
        sa.text(
            f"INSERT INTO {db.qualified('events')} (writer) VALUES (:w) "
            "RETURNING id, seq, updated_at"
        ),
        {"w": writer},
    ).one()


def final_rows(db: TestDatabase) -> list[Any]:
    with db.engine.connect() as conn:
        return list(
            conn.execute(sa.text(f"SELECT id, seq, updated_at FROM {db.qualified('events')}"))
        )


def lost(poller: Poller, rows: list[Any], column: str) -> set[tuple[int, Any]]:
    return {(r.id, getattr(r, column)) for r in rows} - poller.delivered


@dataclass
class Burst:
    """Short writer transactions (0-20 ms, 10 % rolled back) from a few threads."""

    db: TestDatabase
    seconds: float
    writers: int = 4
    committed: int = 0
    rows: int = 0
    rolled_back: int = 0
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _enough(self) -> bool:
        """What :meth:`run` asserts was written: writing goes on past ``seconds``
        until it is (bounded), since a loaded machine writes less per second."""
        with self.lock:
            return self.committed > 20 and self.rolled_back > 0 and self.rows > 45

    def _write(self, index: int) -> None:
        rng = random.Random(index)
        deadline = time.monotonic() + self.seconds
        cap = deadline + 60
        try:
            with self.db.engine.connect() as conn:
                while time.monotonic() < deadline or (
                    time.monotonic() < cap and not self._enough()
                ):
                    trans = conn.begin()
                    count = rng.randint(1, 3)
                    for _ in range(count):
                        insert_row(conn, self.db, index)
                    time.sleep(rng.uniform(0, 0.02))
                    if rng.random() < 0.1:
                        trans.rollback()
                        with self.lock:
                            self.rolled_back += 1
                    else:
                        trans.commit()
                        with self.lock:
                            self.committed += 1
                            self.rows += count
        except Exception as exc:
            self.errors.append(exc)

    def run(self) -> None:
        threads = [threading.Thread(target=self._write, args=(i,)) for i in range(self.writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=self.seconds + 90)
        assert not self.errors, repr(self.errors[0])
        assert self.committed > 20
        assert self.rolled_back > 0


@pytest.fixture
def reader(mariadb: TestDatabase) -> Iterator[int]:
    """A long read-only transaction (it has read the table, never writes); its thread id."""
    create_events(mariadb)
    conn = mariadb.engine.connect()
    conn.begin()
    conn.execute(sa.text(f"SELECT count(*) FROM {mariadb.qualified('events')}")).one()
    thread = int(conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())
    try:
        yield thread
    finally:
        conn.rollback()
        conn.close()


@pytest.mark.parametrize("cursor", ["updated_at", "seq"])
@pytest.mark.timeout(120)
def test_long_and_short_transactions_lose_nothing(
    mariadb: TestDatabase, reader: int, cursor: str
) -> None:
    window = (
        SafetyWindow(WINDOW)
        if cursor == "updated_at"
        else SafetyWindow(WINDOW, time_column="updated_at")
    )
    kw: dict[str, Any] = {"schema": mariadb.schema}
    horizon = make_poller("horizon", mariadb.url, cursor, InMemoryCheckpointStore(), **kw)
    windowed = make_poller(
        "window", mariadb.url, cursor, InMemoryCheckpointStore(), visibility=window, **kw
    )
    unguarded = make_poller(
        "none", mariadb.url, cursor, InMemoryCheckpointStore(), visibility="none", **kw
    )
    pollers = (horizon, windowed, unguarded)
    straggler = mariadb.engine.connect()
    try:
        straggler.begin()
        row = insert_row(straggler, mariadb, -1)
        straggler_thread = straggler.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()
        for p in pollers:
            p.start()
        burst = Burst(mariadb, seconds=HOLD + 1.0)
        writers = threading.Thread(target=burst.run)
        writers.start()
        time.sleep(HOLD)
        # Held longer than the window: both the window and no guard move past it.
        value = getattr(row, cursor)
        assert wait_until(lambda: windowed.passed(value, row.id), timeout=30)
        assert wait_until(lambda: unguarded.passed(value, row.id), timeout=30)
        assert not horizon.passed(value, row.id)
        # The horizon has been held back by the straggler, by name (bounded wait).
        named = wait_until(
            lambda: (
                horizon.held_back_ticks > 0
                and (cursor != "updated_at" or straggler_thread in horizon.blocking_pids)
            ),
            timeout=30,
        )
        straggler.commit()
        straggler.close()
        writers.join()
        time.sleep(1.2)  # the last commits clear the horizon's one-second resolution
        for p in pollers:
            p.finish()
        rows = final_rows(mariadb)
        assert named
        assert len(rows) > 40
        # Server-wide: another session's writer open at the drain holds the
        # horizon back a while; delayed, never skipped.
        assert wait_until(
            lambda: (horizon.trigger.drain(horizon.handle), not lost(horizon, rows, cursor))[1], 30
        ), lost(horizon, rows, cursor)
        assert (row.id, value) in lost(windowed, rows, cursor)
        assert (row.id, value) in lost(unguarded, rows, cursor)
        assert horizon.source.visibility_mode == "transaction-horizon"
        assert horizon.held_back_ticks > 0
        if cursor == "updated_at":  # (seq: test_an_auto_increment_horizon_names_its_blocker)
            assert straggler_thread in horizon.blocking_pids
        assert reader not in horizon.blocking_pids, "a read-only transaction held it back"
    finally:
        if not straggler.closed:  # an assertion failed while it was open
            straggler.invalidate()  # (an open writer would hold every horizon on the server)
        for p in pollers:
            p.stop.set()
            p.source.close()


def source(db: TestDatabase, cursor: str = "updated_at", **kwargs: Any) -> SqlAlchemySource:
    kwargs.setdefault("schema", db.schema)
    return SqlAlchemySource(
        url=kwargs.pop("url", db.url),
        table="events",
        cursor_column=cursor,
        pk_columns=["id"],
        **kwargs,
    )


@pytest.mark.timeout(120)
def test_read_only_and_not_yet_written_transactions_do_not_hold_it_back(
    mariadb: TestDatabase, reader: int, caplog: pytest.LogCaptureFixture
) -> None:
    src = source(mariadb, visibility=MariaDbHorizon(precision=6, warn_after_seconds=0.5))
    # A transaction that locked rows (of another table) but has not written yet:
    # whatever it writes later is stamped later.
    other = mariadb.qualified("other")
    mariadb.execute(f"CREATE TABLE {other} (id INT PRIMARY KEY)")
    mariadb.execute(f"INSERT INTO {other} VALUES (1)")
    idle = mariadb.engine.connect()
    idle.begin()
    idle.execute(sa.text(f"SELECT * FROM {other} FOR UPDATE")).all()
    writer: sa.Connection | None = None
    try:
        with mariadb.engine.begin() as conn:
            insert_row(conn, mariadb, 1)
        # The reader and the locking-but-not-writing transaction are open; neither
        # can still commit an older CURRENT_TIMESTAMP, so the row is consumed.
        # (Bounded waits here and below: another session's write transaction on
        # the shared server can hold the horizon, and be named, for a moment.)
        assert wait_until(lambda: len(src.fetch(BEGINNING, 10)) == 1, timeout=30)
        info = src.last_fetch_info
        assert info is not None
        assert not info.held_back
        # A transaction that has written does hold it back, and is named.
        writer = mariadb.engine.connect()
        writer.begin()
        late = insert_row(writer, mariadb, 2)
        thread = writer.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()
        with mariadb.engine.begin() as conn:
            insert_row(conn, mariadb, 3)
        with caplog.at_level(logging.WARNING, logger="dbtrigger.sources.visibility"):

            def named_in_a_warning() -> bool:
                warnings = [
                    r for r in caplog.records if getattr(r, "event", None) == "visibility_held_back"
                ]
                return any(f"thread {thread}" in w.getMessage() for w in warnings)

            def held_long() -> bool:
                assert len(src.fetch(BEGINNING, 10)) == 1
                info = src.last_fetch_info
                assert info is not None
                # Until the warning names it too: an older writer of another session,
                # named in a warning just before it ended, leaves this writer to the
                # next warning, at most warn_after_seconds (0.5 s) later.
                return (
                    info.held_back
                    and info.held_back_seconds > 0.6
                    and info.blocking_pid == thread
                    and named_in_a_warning()
                )

            assert wait_until(held_long, timeout=30)
        info = src.last_fetch_info
        assert info is not None
        assert info.blocking_trx_id
        assert info.blocking_trx_id in (info.blocking_detail or "")
        writer.commit()
        assert wait_until(lambda: len(src.fetch(BEGINNING, 10)) == 3, timeout=30)
        assert late.id in {r["id"] for r in src.fetch(BEGINNING, 10)}
    finally:
        if writer is not None and not writer.closed:
            writer.invalidate()  # an open writer would hold every horizon on the server
        idle.rollback()
        idle.close()
        src.close()


@pytest.mark.timeout(120)
def test_an_auto_increment_horizon_names_its_blocker(mariadb: TestDatabase, reader: int) -> None:
    src = source(mariadb, "seq")
    writer = mariadb.engine.connect()
    try:
        with mariadb.engine.begin() as conn:
            first = insert_row(conn, mariadb, 1)
        # (Server-wide: another session's open writer can hold the first bound back.)
        assert wait_until(lambda: [r["seq"] for r in src.fetch(BEGINNING, 10)] == [first.seq], 30)
        writer.begin()
        pending = insert_row(writer, mariadb, 2)
        thread = writer.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()
        with mariadb.engine.begin() as conn:
            later = insert_row(conn, mariadb, 3)
        for _ in range(4):  # samples taken while the writer is open never cover it
            time.sleep(0.15)
            assert [r["seq"] for r in src.fetch(BEGINNING, 10)] == [first.seq]

        def named() -> bool:  # (until an older writer of another session, if any, ends)
            assert [r["seq"] for r in src.fetch(BEGINNING, 10)] == [first.seq]
            info = src.last_fetch_info
            return info is not None and info.held_back and info.blocking_pid == thread

        assert wait_until(named, 30)
        assert src.last_fetch_info is not None
        assert src.last_fetch_info.blocking_trx_id
        writer.commit()
        want = [first.seq, pending.seq, later.seq]
        assert wait_until(lambda: [r["seq"] for r in src.fetch(BEGINNING, 10)] == want, 30)
    finally:
        writer.close()
        src.close()


@pytest.mark.timeout(120)
def test_a_statement_that_waited_before_it_wrote_is_not_passed(mariadb: TestDatabase) -> None:
    """NOW() is the statement's start; InnoDB's trx_started can be much later.

    The insert waits on a table lock after taking its timestamp, so its
    transaction starts in InnoDB seconds after the value it writes. A bound
    taken from trx_started would move past the value; the horizon saw the
    waiting statement and carries its start forward.
    """
    create_events(mariadb)
    src = source(mariadb, visibility=MariaDbHorizon(precision=6))
    table = mariadb.qualified("events")
    locker = mariadb.engine.connect()
    locker.execute(sa.text(f"LOCK TABLES {table} READ"))
    waiter = mariadb.engine.connect()
    result: list[Any] = []

    def wait_and_insert() -> None:
        waiter.begin()
        result.append(insert_row(waiter, mariadb, 1))  # stamped now, written after the lock

    thread = threading.Thread(target=wait_and_insert)
    try:
        thread.start()
        for _ in range(16):  # the guard observes the waiting statement for 2.4 s
            src.fetch(BEGINNING, 10)
            time.sleep(0.15)
        locker.execute(sa.text("UNLOCK TABLES"))
        thread.join(timeout=10)
        stamp = result[0].updated_at  # taken before the wait; InnoDB started ~2.4 s later
        with mariadb.engine.begin() as conn:
            middle = conn.execute(
                sa.text(f"INSERT INTO {table} (writer, updated_at) VALUES (2, :t) RETURNING id"),
                {"t": stamp + dt.timedelta(seconds=0.3)},
            ).scalar_one()
        for _ in range(4):
            rows = src.fetch(BEGINNING, 10)
            assert middle not in {r["id"] for r in rows}, "passed the waiting writer's value"
            time.sleep(0.15)
        waiter.commit()
        assert wait_until(lambda: len(src.fetch(BEGINNING, 10)) == 2, timeout=30)
    finally:
        locker.invalidate()  # ends LOCK TABLES, whatever failed (a pooled connection keeps it)
        thread.join(timeout=10)
        waiter.invalidate()
        src.close()


@pytest.mark.timeout(120)
def test_the_bound_is_cached_until_a_fetch_reaches_it_and_stays_lossless(
    mariadb: TestDatabase,
) -> None:
    """One observation per drain; a writer that starts meanwhile is still waited for."""
    create_events(mariadb)
    table = mariadb.qualified("events")
    mariadb.execute(
        f"INSERT INTO {table} (writer, updated_at) SELECT seq, NOW(6) - INTERVAL 1 HOUR "
        "FROM (SELECT seq FROM seq_1_to_95) AS s"
    )
    src = source(mariadb, visibility=MariaDbHorizon(precision=6))
    statements: list[str] = []
    sa.event.listen(src.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    position = BEGINNING
    seen: list[Any] = []
    rows = src.fetch(position, 10)
    deadline = time.monotonic() + 30
    while not rows and time.monotonic() < deadline:  # another session's writer was open
        time.sleep(0.2)
        rows = src.fetch(position, 10)
    # (More than one read if another session had just read INNODB_TRX: a
    # stale cache is read again before the first bound exists.)
    first = sum("INNODB_TRX" in s for s in statements)
    writer = mariadb.engine.connect()
    try:
        # A writer begins after the bound was computed; every value it writes is
        # newer than that bound, so the cached bound stays safe while it is open.
        writer.begin()
        pending = insert_row(writer, mariadb, -1)
        with mariadb.engine.begin() as conn:
            newer = insert_row(conn, mariadb, -2)
        while True:
            seen.extend(rows)
            last = rows[-1]
            position = Position(cursor=last["updated_at"], pk={"id": last["id"]})
            if len(rows) < 10:
                break
            rows = src.fetch(position, 10)
        assert len(seen) == 95
        observations = sum("INNODB_TRX" in s for s in statements)
        assert observations == first, "a full batch must not re-read the transactions"
        # The drain reached the bound: the next fetch observes again, sees the
        # open writer and stops below its value.
        time.sleep(1.0)

        def held() -> bool:
            info = src.last_fetch_info
            return src.fetch(position, 10) == [] and info is not None and info.held_back

        assert wait_until(held, timeout=30)
        assert src.fetch(position, 10) == []
        assert sum("INNODB_TRX" in s for s in statements) > first
        writer.commit()
        assert wait_until(lambda: len(src.fetch(position, 10)) == 2, timeout=30)
        assert {r["id"] for r in src.fetch(position, 10)} == {pending.id, newer.id}
    finally:
        writer.close()
        src.close()


@pytest.fixture
def no_process_url(mariadb: TestDatabase) -> Iterator[str]:
    """A MariaDB account with every privilege on the test database but not PROCESS."""
    user = f"dbt_np_{uuid.uuid4().hex[:8]}"
    mariadb.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw-{user}'")
    mariadb.execute(f"GRANT ALL ON `{mariadb.schema}`.* TO '{user}'@'%'")
    url = sa.make_url(mariadb.url).set(
        username=user, password=f"pw-{user}", database=mariadb.schema
    )
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        mariadb.execute(f"DROP USER IF EXISTS '{user}'@'%'")


@pytest.mark.timeout(120)
def test_without_process_auto_keeps_the_window_and_warns_about_overruns(
    mariadb: TestDatabase, no_process_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    create_events(mariadb)
    auto = source(mariadb, url=no_process_url)
    description = auto.describe_guard()
    assert description.mode == "safety-window(5s)"
    assert description.strength == "bounded"
    assert description.needs is not None
    assert "PROCESS" in description.needs
    assert auto.visibility_mode == "safety-window(5s)"
    with pytest.raises(ConfigurationError, match="PROCESS"):
        source(mariadb, url=no_process_url, visibility=MariaDbHorizon()).fetch(BEGINNING, 10)
    # An integer AUTO_INCREMENT cursor without PROCESS has no guard, and says so.
    assert source(mariadb, "seq", url=no_process_url).describe_guard().strength == "none"
    # A writer of the same account runs longer than the window: visible in its
    # PROCESSLIST, so the window says it can no longer vouch for it.
    short = source(mariadb, url=no_process_url, visibility=SafetyWindow(WINDOW))
    engine = sa.create_engine(no_process_url)
    slow_thread: list[int] = []

    def run_slow() -> None:
        # Runs until the check has seen it (then it is killed), so a loaded
        # machine cannot end it before a check ran.
        with contextlib.suppress(sa.exc.DBAPIError), engine.begin() as conn:
            slow_thread.append(int(conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()))
            conn.execute(
                sa.text(f"INSERT INTO {mariadb.qualified('events')} (writer) SELECT SLEEP(60)")
            )

    slow = threading.Thread(target=run_slow)
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger.sources.visibility"):
            slow.start()
            # Checks run at most once a second; the statement overruns the
            # 1 s window after its first second.
            found = wait_until(lambda: _overrun(short), timeout=30)
        assert found
        warnings = [
            r for r in caplog.records if getattr(r, "event", None) == "visibility_window_exceeded"
        ]
        assert warnings
        assert "PROCESS" in warnings[0].getMessage()
    finally:
        if slow_thread:
            mariadb.execute(f"KILL QUERY {slow_thread[0]}")
        slow.join(30)
        engine.dispose()
        for s in (auto, short):
            s.close()


def _overrun(src: SqlAlchemySource) -> bool:
    src.fetch(BEGINNING, 10)
    info = src.last_fetch_info
    return info is not None and info.blocking_pid is not None


@pytest.mark.timeout(120)
def test_window_with_process_names_a_write_transaction_older_than_it(
    mariadb: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    create_events(mariadb)
    src = source(mariadb, visibility=SafetyWindow(WINDOW))
    writer = mariadb.engine.connect()
    writer.begin()
    insert_row(writer, mariadb, 1)
    thread = writer.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()
    try:
        time.sleep(WINDOW + 1.1)
        with caplog.at_level(logging.WARNING, logger="dbtrigger.sources.visibility"):

            def names_it() -> bool:
                # The oldest writer of another session is named: on the shared server
                # another test's writer, open longer than this one, until it ends.
                info = src.last_fetch_info if _overrun(src) else None
                return info is not None and info.blocking_pid == thread

            assert wait_until(names_it, timeout=30)
        info = src.last_fetch_info
        assert info is not None
        assert info.blocking_pid == thread
        assert info.blocking_trx_id
        assert any(
            getattr(r, "event", None) == "visibility_window_exceeded" for r in caplog.records
        )
    finally:
        writer.rollback()
        writer.close()
        src.close()


def test_guard_configuration_is_validated(mariadb: TestDatabase) -> None:
    mariadb.execute(
        f"CREATE TABLE {mariadb.qualified('events')} (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)"
    )
    with pytest.raises(ConfigurationError, match="AUTO_INCREMENT"):
        source(mariadb, "n", visibility=MariaDbHorizon()).fetch(BEGINNING, 10)
    with pytest.raises(ConfigurationError, match="precision"):
        MariaDbHorizon(precision=7)
    # TransactionHorizon is the same promise on MariaDB: it delegates, with the caller's
    # settings (settle_seconds was dropped for MariaDbHorizon's own 2 s).
    create = f"CREATE TABLE {mariadb.qualified('ts')} (id BIGINT PRIMARY KEY, t DATETIME(6))"
    mariadb.execute(create)
    default = MariaDbHorizon()
    for guard, kept in (
        (TransactionHorizon(), (default.settle_seconds, default.warn_after_seconds)),
        (TransactionHorizon(settle_seconds=0.0, warn_after_seconds=7), (0.0, 7)),
        (TransactionHorizon(settle_seconds=5.0), (5.0, default.warn_after_seconds)),
    ):
        src = SqlAlchemySource(
            url=mariadb.url,
            table="ts",
            schema=mariadb.schema,
            cursor_column="t",
            pk_columns=["id"],
            visibility=guard,
        )
        assert src.fetch(BEGINNING, 10) == []
        assert src.visibility_mode == "transaction-horizon"
        active = src._guarding.active
        assert isinstance(active.guard, MariaDbHorizon), active
        assert (active.guard.settle_seconds, active.guard.warn_after_seconds) == kept
        src.close()


def _waiting_on_metadata_lock(db: TestDatabase, threads: set[int]) -> dict[int, float]:
    """The statements of ``threads`` waiting on a metadata lock, with their age in seconds."""
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT ID, TIME_MS FROM information_schema.PROCESSLIST "
                "WHERE STATE LIKE 'Waiting for table metadata lock%'"
            )
        ).all()
    return {int(r.ID): float(r.TIME_MS) / 1000 for r in rows if int(r.ID) in threads}


@pytest.mark.timeout(90)
def test_a_writer_that_waited_on_a_metadata_lock_is_not_passed_after_a_restart(
    mariadb: TestDatabase,
) -> None:
    """A real metadata-lock wait, then a poller restart while the waiter is still open.

    ``LOCK TABLES events READ`` (this test's own table only) makes two inserts
    wait: the waiter's (in a transaction it keeps open) and a queued one
    (autocommit). Both are stamped with ``CURRENT_TIMESTAMP(6)`` when they are
    dispatched, seconds before InnoDB starts their transactions. The poller
    running during the wait sees the waiting statements; the poller that
    starts after the wait sees only an open InnoDB transaction whose
    ``trx_started`` is seconds later than the value it wrote. It must not pass
    that value (a bound of ``trx_started - 1 s`` consumed the queued row and
    lost the waiter's, 3 of 3 times) until the waiter has ended.
    """
    create_events(mariadb)
    table = mariadb.qualified("events")
    store = InMemoryCheckpointStore()
    kw: dict[str, Any] = {"schema": mariadb.schema}
    with mariadb.engine.begin() as conn:
        before = insert_row(conn, mariadb, 0)
    first = make_poller("restarted", mariadb.url, "updated_at", store, **kw)
    locker = mariadb.engine.connect()
    waiter = mariadb.engine.connect()
    queued = mariadb.engine.connect()
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def insert(name: str, conn: sa.Connection, commit: bool) -> None:
        try:
            conn.begin()
            results[name] = insert_row(conn, mariadb, 1 if name == "waiter" else 2)
            if commit:
                conn.commit()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    second: Poller | None = None
    threads: list[threading.Thread] = []
    try:
        # The first poller consumes what was committed before the lock.
        assert wait_until(
            lambda: (first.tick(), (before.id, before.updated_at))[1] in first.delivered, timeout=30
        )
        locker.execute(sa.text(f"LOCK TABLES {table} READ"))
        waiter_thread = int(waiter.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())
        queued_thread = int(queued.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())
        waiter.rollback()
        queued.rollback()
        threads += [
            threading.Thread(target=insert, args=("waiter", waiter, False)),
            threading.Thread(target=insert, args=("queued", queued, True)),
        ]
        threads[0].start()
        assert wait_until(
            lambda: waiter_thread in _waiting_on_metadata_lock(mariadb, {waiter_thread}), 15
        )
        threads[1].start()
        both = {waiter_thread, queued_thread}
        assert wait_until(lambda: set(_waiting_on_metadata_lock(mariadb, both)) == both, 15)
        first.tick()  # sees the waiting statements, consumes nothing
        first.source.close()  # ... and stops
        # Let the wait outlast trx_started's second (and the old 1 s allowance).
        assert wait_until(
            lambda: min(_waiting_on_metadata_lock(mariadb, both).values(), default=0) >= 3.0, 20
        )
        locker.execute(sa.text("UNLOCK TABLES"))
        for t in threads:
            t.join(timeout=30)
        assert not errors, repr(errors[0])
        waited, later = results["waiter"], results["queued"]
        assert waited.updated_at < later.updated_at  # stamped before the queued row
        # The restarted poller: the waiter's transaction is open, its row not committed.
        second = make_poller("restarted", mariadb.url, "updated_at", store, **kw)

        def held_or_passed() -> bool:
            second.tick()
            info = second.source.last_fetch_info
            held = info is not None and info.held_back and info.held_back_seconds >= 1.0
            return held or (later.id, later.updated_at) in second.delivered

        assert wait_until(held_or_passed, timeout=30)
        assert not second.passed(waited.updated_at, waited.id), "passed the waiter's value"
        waiter.commit()
        want = {(r.id, r.updated_at) for r in (waited, later)}
        assert wait_until(lambda: (second.tick(), want <= second.delivered)[1], timeout=30), (
            f"lost {want - second.delivered}"
        )
    finally:
        # Whatever failed: closing the locker's driver connection ends LOCK
        # TABLES (a pooled one would keep it), the waiters finish, and their
        # open transactions end with their connections.
        locker.invalidate()
        for t in threads:
            t.join(timeout=30)
        for conn in (waiter, queued):
            conn.invalidate()
        first.source.close()
        if second is not None:
            second.source.close()
