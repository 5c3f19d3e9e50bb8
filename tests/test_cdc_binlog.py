"""BinlogSource on a private MariaDB with a ROW binary log: settings, privileges, snapshot,
schema changes, retention, read-through, and losslessness under late commits."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pymysql
import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cdc import BinlogSource
from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.assembly import Assembly
from dbtrigger.cdc.binlog_setup import default_server_id
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import (
    ConfigurationError,
    SchemaChangedError,
    ServerSettingError,
    SlotLostError,
    SourcePermissionError,
)
from dbtrigger.sources.visibility import SafetyWindow
from tests.cdc_servers import BinlogDatabase, BinlogMariadb

pytestmark = pytest.mark.timeout(120)


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def make_table(db: BinlogDatabase, name: str = "items") -> str:
    db.execute(f"CREATE TABLE {name} (id INT PRIMARY KEY, note VARCHAR(100), n INT)")
    return name


class Collector:
    def __init__(self) -> None:
        self.events: list[RowChange] = []

    def __call__(self, events: list[RowChange]) -> None:
        self.events.extend(events)

    def state(self) -> dict[int, dict[str, Any] | None]:
        """Each key's row as the events leave it (None: deleted)."""
        out: dict[int, dict[str, Any] | None] = {}
        for e in self.events:
            out[e.pk["id"]] = None if e.op == "delete" else dict(e.after or {})
        return out


def trigger(source: BinlogSource, store: Any = None, name: str | None = None) -> PollTrigger:
    return PollTrigger(
        name=name or f"p_{uuid.uuid4().hex[:8]}",
        source=source,
        checkpoint_store=store or InMemoryCheckpointStore(),
        batch_size=50,
    )


def drain(t: PollTrigger, handler: Callable[[list[RowChange]], None]) -> None:
    t.drain(handler)


def rows(db: BinlogDatabase, table: str) -> dict[int, dict[str, Any]]:
    conn = db.connect(cursorclass=pymysql.cursors.DictCursor)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {table}")
            return {r["id"]: dict(r) for r in cur.fetchall()}
    finally:
        conn.close()


def purge_all_but_newest(db: BinlogDatabase) -> None:
    """Rotate and purge until the server keeps one binlog file (MariaDB keeps the previous
    file until its binlog checkpoint is written, so a purge right after a rotate may skip it)."""
    server = db.server
    server.execute("FLUSH BINARY LOGS")
    newest = server.scalar("SHOW MASTER STATUS")

    def purged() -> bool:
        server.execute(f"PURGE BINARY LOGS TO '{newest}'")
        return server.scalar("SHOW BINARY LOGS") == newest

    assert wait_until(purged, 30)


# --- settings and privileges ---------------------------------------------------------------


@pytest.mark.mariadb
def test_a_server_without_a_binary_log_is_refused_naming_log_bin() -> None:
    """The shared MariaDB runs without --log-bin: the error says what to change (nothing is
    changed on it)."""
    source = BinlogSource("mysql+pymysql://root@127.0.0.1:3306/mysql", ["user"], reader="r")
    with pytest.raises(ServerSettingError, match="log_bin is OFF") as caught:
        source.fetch(BEGINNING, 10)
    assert "--log-bin" in str(caught.value)
    source.close()


def test_statement_format_and_minimal_images_are_refused_each_named(
    binlog_db: BinlogDatabase,
) -> None:
    table = make_table(binlog_db)
    server = binlog_db.server
    server.execute("SET GLOBAL binlog_format = 'STATEMENT'")
    server.execute("SET GLOBAL binlog_row_image = 'MINIMAL'")
    source = BinlogSource(binlog_db.url, [table], reader="r1")
    try:
        with pytest.raises(ServerSettingError) as caught:
            source.fetch(BEGINNING, 10)
        text = str(caught.value)
        assert "binlog_format is STATEMENT" in text
        assert "SET GLOBAL binlog_format = 'ROW'" in text
        assert "binlog_row_image is MINIMAL" in text
        assert "SET GLOBAL binlog_row_image = 'FULL'" in text
    finally:
        server.execute("SET GLOBAL binlog_format = 'ROW'")
        server.execute("SET GLOBAL binlog_row_image = 'FULL'")
        source.close()


@pytest.mark.parametrize(
    ("grants", "missing"),
    [
        ("REPLICATION CLIENT", "GRANT REPLICATION SLAVE ON *.*"),
        ("REPLICATION SLAVE", "GRANT REPLICATION CLIENT ON *.*"),
    ],
)
def test_missing_replication_privileges_name_the_grant(
    binlog_db: BinlogDatabase, grants: str, missing: str
) -> None:
    table = make_table(binlog_db)
    user = f"u{uuid.uuid4().hex[:8]}"
    server = binlog_db.server
    server.execute(f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw'")
    server.execute(f"GRANT {grants} ON *.* TO '{user}'@'127.0.0.1'")
    server.execute(f"GRANT ALL ON `{binlog_db.name}`.* TO '{user}'@'127.0.0.1'")
    source = BinlogSource(
        server.url(binlog_db.name, user, "pw"), [table], reader="r", snapshot="never"
    )
    try:
        binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
        with pytest.raises(SourcePermissionError, match=missing.replace("*", r"\*")) as caught:
            source.fetch(BEGINNING, 10)
        assert "'pw'" not in str(caught.value)
    finally:
        source.close()
        server.execute(f"DROP USER '{user}'@'127.0.0.1'")


def test_server_id_is_derived_from_the_poller_and_the_servers_own_is_refused(
    binlog_db: BinlogDatabase,
) -> None:
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table])
    trigger(source, name="orders")
    assert source.server_id == default_server_id("orders")
    assert source.server_id != default_server_id("orders2")
    assert source.server_id >= 1 << 24
    clash = BinlogSource(binlog_db.url, [table], reader="x", server_id=1)  # the server's own
    with pytest.raises(ConfigurationError, match="server_id 1 is the server's own"):
        clash.fetch(BEGINNING, 1)
    with pytest.raises(ConfigurationError):
        BinlogSource(binlog_db.url, [table], server_id=0)
    clash.close()
    source.close()


# --- delivery through the runtime ------------------------------------------------------------


def test_initial_snapshot_then_changes_with_no_gap_while_writers_run(
    binlog_db: BinlogDatabase,
) -> None:
    """Existing rows arrive as upserts in chunks, changes made during the snapshot are
    interleaved in commit order, and each key ends as the table has it."""
    table = make_table(binlog_db)
    binlog_db.execute(
        f"INSERT INTO {table} VALUES " + ", ".join(f"({i}, 'old', 0)" for i in range(1, 301))
    )
    source = BinlogSource(binlog_db.url, [table], snapshot_chunk_size=40)
    t = trigger(source)
    seen = Collector()
    stop = threading.Event()

    def writer() -> None:
        n = 0
        conn = binlog_db.connect()
        try:
            while not stop.is_set() and n < 400:
                n += 1
                with conn.cursor() as cur:
                    cur.execute(
                        f"UPDATE {table} SET n = n + 1, note = 'w' WHERE id = %s", (n % 300 + 1,)
                    )
                    cur.execute(f"INSERT INTO {table} VALUES (%s, 'new', 0)", (1000 + n,))
                    if n % 7 == 0:
                        cur.execute(f"DELETE FROM {table} WHERE id = %s", (n % 300 + 1,))
        finally:
            conn.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            t.tick(seen)
        thread.join()

        def caught_up() -> bool:
            t.drain(seen)
            table_now = rows(binlog_db, table)
            expected = {k: table_now.get(k) for k in set(seen.state()) | set(table_now)}
            return seen.state() == expected

        assert wait_until(caught_up, 60)
    finally:
        stop.set()
        thread.join()
        source.close()
    snapshot = [e for e in seen.events if e.metadata["snapshot"]]
    assert {e.op for e in snapshot} == {"upsert"}
    assert len({e.pk["id"] for e in snapshot}) >= 250
    status = source.admin().status()
    assert [s["done"] for s in status["snapshots"]] == [True]
    assert status["snapshots"][0]["chunks"] >= 8


def test_added_column_appears_and_a_type_change_waits_for_accept(
    binlog_db: BinlogDatabase,
) -> None:
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source)
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    binlog_db.execute(f"ALTER TABLE {table} ADD COLUMN extra VARCHAR(20) NULL")
    binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 2, 'x')")
    t.drain(seen)
    assert [e.after.get("extra", "-") for e in seen.events] == ["-", "x"]
    binlog_db.execute(f"ALTER TABLE {table} MODIFY COLUMN n BIGINT")
    binlog_db.execute(f"INSERT INTO {table} VALUES (3, 'c', 3, 'y')")
    with pytest.raises(SchemaChangedError, match=r"column n of .* changed type"):
        source.fetch(t.read_state().position, 10)  # type: ignore[union-attr]
    admin = source.admin()
    assert admin.schema_changes()
    assert "LONG -> LONGLONG" in admin.schema_changes()[0]
    assert admin.status()["healthy"] is False
    assert admin.accept_schema()
    t.drain(seen)
    assert [e.pk["id"] for e in seen.events] == [1, 2, 3]
    assert seen.events[-1].after["n"] == 3
    source.close()


def test_a_purged_checkpoint_is_a_typed_error_and_recreate_snapshot_goes_on(
    binlog_db: BinlogDatabase,
) -> None:
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source, store, name="purged")
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    t.drain(seen)
    source.close()
    binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 2)")  # never read
    purge_all_but_newest(binlog_db)
    again = BinlogSource(binlog_db.url, [table], snapshot="never")
    t2 = trigger(again, store, name="purged")
    with pytest.raises(SlotLostError, match="was purged by the server") as caught:
        t2.tick(seen)
    assert "dbtrigger cdc recreate" in str(caught.value)
    assert any("purged" in w for w in again.admin().status()["warnings"])
    again.admin().recreate(snapshot=True)
    t2.drain(seen)
    assert seen.state() == {1: {"id": 1, "note": "a", "n": 1}, 2: {"id": 2, "note": "b", "n": 2}}
    assert [e.metadata["snapshot"] for e in seen.events[1:]] == [True, True]
    again.close()


@pytest.mark.mariadb
@pytest.mark.parametrize("lose_row", ["cdc drop", "control table emptied"])
def test_a_lost_control_row_resumes_at_the_checkpoint_never_from_now(
    binlog_db: BinlogDatabase, lose_row: str
) -> None:
    # The checkpoint says where reading stopped; a control row created at the server's
    # position now (as on first use) would skip everything written since then.
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source, store, name="lost_row")
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    t.drain(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 2)")
    source.close()
    if lose_row == "cdc drop":
        source.admin().drop()
    else:
        binlog_db.execute(f"DELETE FROM {control.TABLE}")
    binlog_db.execute(f"INSERT INTO {table} VALUES (3, 'c', 3)")
    t.drain(seen)
    assert [e.pk["id"] for e in seen.events] == [1, 2, 3]
    source.close()


def test_a_quiet_table_records_read_through_and_resumes_there(
    binlog_db: BinlogDatabase,
) -> None:
    """Another table's traffic moves the recorded position (after a durable checkpoint), so a
    restarted poller of the quiet table does not read that traffic again."""
    quiet = make_table(binlog_db, "quiet")
    busy = make_table(binlog_db, "busy")
    store = InMemoryCheckpointStore()
    source = BinlogSource(binlog_db.url, [quiet], snapshot="never", heartbeat_interval_seconds=0)
    t = trigger(source, store, name="quiet")
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {quiet} VALUES (1, 'a', 1)")
    t.drain(seen)
    for i in range(50):
        binlog_db.execute(f"INSERT INTO {busy} VALUES ({i}, 'x', 0)")
    t.tick(seen)
    t.tick(seen)  # idle tick: acknowledges the stored checkpoint
    conn = binlog_db.connect()
    try:
        row = control.read(conn, binlog_db.name, "quiet")
    finally:
        conn.close()
    assert row is not None
    checkpoint = t.read_state().position  # type: ignore[union-attr]
    assert row.through_after == checkpoint.cursor
    end = binlog_db.server.connect().cursor()
    end.execute("SHOW MASTER STATUS")
    file, pos = end.fetchone()[:2]
    assert (row.through_file, row.through_pos) >= (file, pos - 2000)
    source.close()
    again = BinlogSource(binlog_db.url, [quiet], snapshot="never")
    trigger(again, store, name="quiet")
    again.prepare(None)
    start = again.new_reader().start_for(LogPosition.of(checkpoint))
    assert start[:2] == (row.through_file, row.through_pos)
    binlog_db.execute(f"INSERT INTO {quiet} VALUES (2, 'b', 2)")
    t2 = trigger(again, store, name="quiet")
    more = Collector()
    t2.drain(more)
    assert [e.pk["id"] for e in more.events] == [2]
    again.close()


def test_a_large_transaction_is_read_in_parts_and_resumes_inside_it(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    source = BinlogSource(binlog_db.url, [table], snapshot="never", read_ahead=300)
    t = trigger(source, store, name="big")
    seen = Collector()
    t.tick(seen)
    conn = binlog_db.connect(autocommit=False)
    with conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {table} VALUES (%s, 'big', %s)", [(i, i) for i in range(1, 2001)]
        )
    conn.commit()
    conn.close()
    skipped = 0
    step = Assembly.delivered_already

    def counting(self: Assembly) -> bool:
        nonlocal skipped
        found = step(self)
        skipped += found
        return found

    monkeypatch.setattr(Assembly, "delivered_already", counting)
    for _ in range(7):
        t.tick(seen)
    assert 300 < len(seen.events) < 2000  # past the first read of 300, in parts ...
    assert skipped == 0  # ... each read going on where the last one stopped, none read again
    source.close()  # a restart inside the transaction
    again = BinlogSource(binlog_db.url, [table], snapshot="never", read_ahead=300)
    t2 = trigger(again, store, name="big")
    t2.drain(seen)
    assert [e.pk["id"] for e in seen.events] == list(range(1, 2001))
    assert len({e.metadata["commit"] for e in seen.events}) == 1
    assert seen.events[-1].metadata["last_in_transaction"]
    again.close()


# --- late commits -------------------------------------------------------------------------


def test_a_late_commit_that_a_safety_window_loses_is_delivered_from_the_binlog(
    binlog_db: BinlogDatabase,
) -> None:
    """The scenario of test_visibility's residual risk: a writer holds its timestamp longer
    than the window. The polled cursor skips its row; the binlog delivers every row."""
    binlog_db.execute(
        "CREATE TABLE events (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT NOW(6), writer INT NOT NULL, "
        "KEY ix (updated_at, id))"
    )
    polled = PollTrigger(
        name="window",
        source=SqlAlchemySource(
            url=binlog_db.url,
            table="events",
            cursor_column="updated_at",
            pk_columns=["id"],
            visibility=SafetyWindow(1.0),
        ),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=25,
    )
    logged_source = BinlogSource(binlog_db.url, ["events"], snapshot="never")
    logged = trigger(logged_source, name="binlog")
    by_window, by_log = Collector(), Collector()
    logged.tick(by_log)
    straggler = binlog_db.connect(autocommit=False)
    with straggler.cursor() as cur:
        cur.execute("INSERT INTO events (writer) VALUES (-1)")
        late_id = cur.lastrowid
    time.sleep(0.05)
    for w in range(20):
        binlog_db.execute("INSERT INTO events (writer) VALUES (%s)", (w,))
    # The later rows age past the 1 s window and are consumed while the straggler is open.
    assert wait_until(lambda: (polled.tick(by_window), len(by_window.events) >= 20)[1], timeout=30)
    straggler.commit()
    straggler.close()
    time.sleep(1.2)
    polled.drain(by_window)
    logged.drain(by_log)
    final = set(rows(binlog_db, "events"))
    assert len(final) == 21
    lost_by_window = final - {e.pk["id"] for e in by_window.events}
    lost_by_log = final - {e.pk["id"] for e in by_log.events}
    assert lost_by_window == {late_id}, "the window's residual risk happened"
    assert lost_by_log == set()
    assert [e.pk["id"] for e in by_log.events][-1] == late_id, "delivered in commit order"
    polled.source.close()
    logged_source.close()


@pytest.mark.mariadb
def test_a_position_in_the_oldest_binary_log_the_server_keeps_is_warned_about(
    binlog_db: BinlogDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source, store, name=f"ret_{uuid.uuid4().hex[:6]}")
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    t.drain(seen)
    source.close()
    server = binlog_db.server
    kept = server.scalar("SHOW MASTER STATUS")  # the checkpoint's file ...

    def oldest() -> bool:  # ... becomes the oldest the server keeps, and the log moves on
        server.execute(f"PURGE BINARY LOGS TO '{kept}'")
        return server.scalar("SHOW BINARY LOGS") == kept

    assert wait_until(oldest, 30)
    server.execute("FLUSH BINARY LOGS")
    again = BinlogSource(binlog_db.url, [table], snapshot="never")
    t2 = trigger(again, store, name=t.name)
    with caplog.at_level(logging.WARNING, logger="dbtrigger.cdc"):
        t2.tick(seen)
    warned = [r for r in caplog.records if r.__dict__.get("event") == "cdc_binlog_retention"]
    assert len(warned) == 1
    assert "oldest binary log" in warned[0].getMessage()
    assert "binlog_expire_logs_seconds" in warned[0].getMessage()
    again.close()


def test_connections_share_one_opportunistic_tls_context(binlog_db: BinlogDatabase) -> None:
    """PyMySQL built a TLS context per connection (the CA store loaded each time: most of
    a quiet read's CPU, two connections a read); one is built, as it is the same context."""
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    from dbtrigger.cdc.binlog_setup import connect, replica_connect  # noqa: PLC0415

    url = make_url(binlog_db.url)
    first, second = connect(url), replica_connect(host=url.host, port=url.port, user="root")
    try:
        assert first.ctx is second.ctx
    finally:
        first.close()
        second.close()


def test_each_binlog_event_is_freed_as_it_is_read_while_the_collector_is_paused(
    binlog_db: BinlogDatabase,
) -> None:
    """The runtime pauses the cyclic collector while it fetches a batch; mysql-replication's
    events refer to their packets and back, so a read held every event it parsed (94 MB of
    RSS for a 100,000-row transaction) until the collector ran again."""
    import gc  # noqa: PLC0415

    from pymysqlreplication.row_event import RowsEvent  # noqa: PLC0415

    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], snapshot="never", reader=f"gc_{table}")
    assert source.fetch(BEGINNING, 10) == []
    binlog_db.execute(f"INSERT INTO {table} SELECT seq, 'n', seq FROM seq_1_to_5000")
    gc.collect()
    gc.disable()
    try:
        rows = source.fetch(BEGINNING, 100)
        alive = sum(1 for o in gc.get_objects() if isinstance(o, RowsEvent))
    finally:
        gc.enable()
    assert len(rows) == 100
    assert alive == 0
    source.close()


@pytest.mark.mariadb
def test_two_workers_set_up_a_new_reader_at_once_and_share_one_start(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both found no control row and each wrote its own (the last write won): each read
    # from its own start, and a later process took the winner's for a recreate.
    from dbtrigger.cdc import binlog_source  # noqa: PLC0415

    table = make_table(binlog_db)
    both_looked = threading.Barrier(2, timeout=3)
    read = control.read

    def looked_together(*args: Any, **kwargs: Any) -> Any:
        row = read(*args, **kwargs)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_looked.wait()  # times out when set-up is one at a time
        return row

    monkeypatch.setattr(control, "read", looked_together)
    written: list[Any] = []
    write = binlog_source.BinlogSource.write_control

    def counted(self: Any, conn: Any, row: Any) -> None:
        written.append(row)
        write(self, conn, row)

    monkeypatch.setattr(binlog_source.BinlogSource, "write_control", counted)
    sources = [BinlogSource(binlog_db.url, [table]) for _ in range(2)]
    for source in sources:
        source.bind_poller("together")
    threads = [threading.Thread(target=source.prepare, args=(None,)) for source in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(written) == 1
    starts = {(s.control_row.created_file, s.control_row.created_pos) for s in sources}
    assert len(starts) == 1
    for source in sources:
        source.close()


def test_the_private_server_keeps_its_temporary_files_to_itself(
    binlog_mariadb: BinlogMariadb,
) -> None:
    # A starting server deletes every '#sql*' file in its tmpdir; with the shared /tmp,
    # one test worker's server starting broke another's mariadb-install-db now and then.
    tmpdir = str(binlog_mariadb.scalar("SELECT @@tmpdir"))
    assert tmpdir.startswith(str(binlog_mariadb.directory))
