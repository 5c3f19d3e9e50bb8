"""Many guarded pollers on one MariaDB server: every row still gets through.

InnoDB refills ``information_schema.INNODB_TRX`` only when nobody has read it
for 100 ms, server-wide, and the MariaDB transaction horizon consumes nothing
without proof that the cache was filled after its own process-list read. Sixteen
pollers at default settings, each reading as often as its guard allows, kept
it stale for one another: rows waited for a chance gap of 100 ms, 15-30 s and
more. Here the same sixteen pollers and a writer run on the shared server (in a
database of their own): every committed row must reach every poller (bounded
wait), and the guards' own counters must show that their observations found
the cache fresh, not that they got lucky (counted, not timed). The benchmark
``benchmarks/guard_contention.py`` prints the delays for 1-32 pollers.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, SqlAlchemySource
from dbtrigger.cursor import BEGINNING
from dbtrigger.sources.visibility import MariaDbHorizon, SafetyWindow
from dbtrigger.sources.visibility import mariadb as mariadb_guard
from dbtrigger.sources.visibility import window as window_guard
from tests.databases import TestDatabase
from tests.test_visibility import Poller, make_poller, wait_until

pytestmark = pytest.mark.mariadb

POLLERS = 16
ROWS = 8


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def guard_state(poller: Poller) -> Any:
    active = poller.source._guarding.active
    assert active is not None
    return active._state


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cursor", ["updated_at", "id"])
def test_sixteen_guarded_pollers_on_one_server_deliver_every_row(
    mariadb: TestDatabase, cursor: str
) -> None:
    table = mariadb.qualified("events")
    mariadb.execute(
        f"CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), "
        "KEY ix_events_updated_at_id (updated_at, id))"
    )
    pollers = [
        make_poller(f"p{i}", mariadb.url, cursor, InMemoryCheckpointStore(), mariadb.schema)
        for i in range(POLLERS)
    ]
    committed: set[tuple[int, Any]] = set()
    try:
        for p in pollers:
            p.start()
        assert wait_until(lambda: all(p.source._guarding.active for p in pollers), 60)
        with mariadb.engine.connect() as conn:
            for _ in range(ROWS):
                conn.execute(sa.text(f"INSERT INTO {table} () VALUES ()"))
                conn.commit()
                time.sleep(0.25)
            rows = conn.execute(sa.text(f"SELECT id, {cursor} AS c FROM {table}")).all()
        committed = {(r.id, r.c) for r in rows}
        assert len(committed) == ROWS
        # Generous: a loaded machine may be slow, but a guard that waits for
        # a chance gap between sixteen readers is slower still.
        everyone = wait_until(lambda: all(committed <= p.delivered for p in pollers), 90)
        for p in pollers:
            p.stop.set()
        late = {p.label: len(committed - p.delivered) for p in pollers if committed - p.delivered}
        assert everyone, f"rows not delivered within 90 s: {late}"
        assert all(not p.errors for p in pollers), [p.errors for p in pollers]
        # Measured: the guards' observations found INNODB_TRX refilled after
        # their own process-list reads (a stale read waited out within a turn
        # counts as a stale read, not as a failed observation), rather than
        # giving up on a stale cache again and again: before they took turns,
        # hundreds failed for each fresh one; alone on the server, none fails.
        # (Loose: sessions of other test runs on the shared server that do not
        # take turns, e.g. an older checkout's guards, make some fail.)
        states = [guard_state(p) for p in pollers]
        fresh = sum(s.observations for s in states)
        failed = sum(s.stale_observations for s in states)
        reads = sum(s.stale_reads for s in states)
        assert fresh >= POLLERS * 2, fresh
        assert failed <= fresh, (failed, fresh, reads)
    finally:
        for p in pollers:
            p.stop.set()
        for p in pollers:
            if p.thread is not None:
                p.thread.join(timeout=30)
            p.source.close()


@pytest.mark.timeout(120)
def test_a_reader_that_does_not_take_turns_is_named_at_warning(
    mariadb: TestDatabase, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session reading INNODB_TRX every 20 ms (a monitoring tool) keeps the cache
    stale even for a guard holding the turn: the guard holds the row back and
    says why at WARNING, then delivers it once the reader stops (INFO)."""
    monkeypatch.setattr(mariadb_guard, "STALE_WARN_SECONDS", 1.0)
    table = mariadb.qualified("events")
    mariadb.execute(
        f"CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6))"
    )
    src = SqlAlchemySource(
        url=mariadb.url,
        table="events",
        schema=mariadb.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility=MariaDbHorizon(precision=6, warn_after_seconds=1.0),
    )
    stop = threading.Event()

    def monitor() -> None:
        with mariadb.engine.connect() as conn:
            while not stop.is_set():
                conn.execute(sa.text("SELECT COUNT(*) FROM information_schema.INNODB_TRX")).one()
                conn.rollback()
                stop.wait(0.02)

    reader = threading.Thread(target=monitor, daemon=True)
    try:
        assert wait_until(lambda: src.fetch(BEGINNING, 10) == [], 30)  # the guard is active
        with caplog.at_level(logging.INFO, logger="dbtrigger.sources.visibility"):
            reader.start()
            mariadb.execute(f"INSERT INTO {table} () VALUES ()")

            def warned() -> bool:
                assert src.fetch(BEGINNING, 10) == []  # held back, not guessed
                return bool(events(caplog, "visibility_trx_cache_stale"))

            assert wait_until(warned, 60)
            warning = events(caplog, "visibility_trx_cache_stale")[0]
            assert warning.levelno == logging.WARNING
            assert "other sessions read it more often than every 100 ms" in warning.getMessage()
            assert warning.stale_reads > 0  # type: ignore[attr-defined]
            src.fetch(BEGINNING, 10)
            info = src.last_fetch_info  # what status and the metrics show
            assert info is not None
            assert info.held_back
            assert "INNODB_TRX not refreshed" in (info.blocking_detail or "")
            stop.set()
            reader.join(timeout=10)
            assert wait_until(lambda: len(src.fetch(BEGINNING, 10)) == 1, 30)
        assert events(caplog, "visibility_trx_cache_fresh")
    finally:
        stop.set()
        src.close()


@pytest.mark.timeout(120)
def test_the_windows_overrun_check_reads_innodb_trx_only_holding_the_turn(
    mariadb: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SafetyWindow with PROCESS looks for overrunning writers in INNODB_TRX
    once a second; it does not read it while a horizon holds the turn (waiting
    out a stale cache, which that read would keep stale), and reads again
    once the turn is free."""
    monkeypatch.setattr(window_guard, "TURN_BUSY_READ_SECONDS", 600.0)
    table = mariadb.qualified("events")
    mariadb.execute(
        f"CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6))"
    )
    src = SqlAlchemySource(
        url=mariadb.url,
        table="events",
        schema=mariadb.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility=SafetyWindow(1),
    )
    statements: list[str] = []
    sa.event.listen(src.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))

    def reads() -> int:
        return sum("INNODB_TRX" in s for s in statements)

    def tries() -> int:
        return sum("GET_LOCK('dbtrigger:innodb_trx', 0)" in s for s in statements)

    holder = mariadb.engine.connect()
    try:
        assert wait_until(lambda: (src.fetch(BEGINNING, 10), reads() >= 1)[1], 30)
        assert holder.execute(sa.text("SELECT GET_LOCK('dbtrigger:innodb_trx', 10)")).scalar()
        before, tried = reads(), tries()
        assert wait_until(lambda: (src.fetch(BEGINNING, 10), tries() >= tried + 2)[1], 30)
        assert reads() == before  # the turn was busy at every check
        holder.execute(sa.text("SELECT RELEASE_LOCK('dbtrigger:innodb_trx')"))
        assert wait_until(lambda: (src.fetch(BEGINNING, 10), reads() > before)[1], 30)
        # ... and gave the turn back: a horizon's guard takes it at once.
        assert holder.execute(sa.text("SELECT GET_LOCK('dbtrigger:innodb_trx', 5)")).scalar()
    finally:
        holder.close()
        src.close()
