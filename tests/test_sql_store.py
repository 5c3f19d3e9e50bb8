"""SqlCheckpointStore on SQLite, PostgreSQL and MariaDB.

The shared store contract runs on each database in test_store_contract.py; here
is what is specific to a SQL table (an isolated schema per test): namespaces,
case-sensitive keys on MariaDB, 1 MB documents, a whole drain with the state
next to the source, failures translated into the store error tree without
leaking the password, and writers in separate processes racing one etag.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
import sqlalchemy as sa

from dbtrigger import PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    ConfigurationError,
    StoreAuthError,
    StoreRefusedError,
    StoreUnavailableError,
    UnsafeIdentifierError,
    UnsupportedDocumentError,
)
from dbtrigger.state.stores import CheckpointStore, SqlCheckpointStore, StoredDocument
from dbtrigger.state.stores.sql import classify_driver_error
from dbtrigger.testing import CountingStore
from tests.databases import TestDatabase, admin_engine
from tests.race_processes import race_context

SECRET = "Wr0ng-s3cret-pa55"  # noqa: S105 - a made-up password the errors must not echo


@pytest.fixture
def sql_store(db: TestDatabase) -> Iterator[SqlCheckpointStore]:
    store = SqlCheckpointStore(url=db.url, schema=db.schema)
    yield store
    store.close()


# --- SQL-specific behaviour ------------------------------------------------------------


def test_row_is_plain_readable_json(db: TestDatabase, sql_store: SqlCheckpointStore) -> None:
    etag = sql_store.write("orders", b'{"poller_name": "orders"}', if_match=None)
    table = sa.Table("dbtrigger_state", sa.MetaData(), schema=db.schema, autoload_with=db.engine)
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(table)).mappings().one()
    assert row["namespace"] == "default"
    assert row["poller_name"] == "orders"
    assert json.loads(row["document"]) == {"poller_name": "orders"}
    assert row["etag"] == etag
    assert row["updated_at"] is not None


def test_namespaces_share_a_table_without_interfering(db: TestDatabase) -> None:
    app_a = SqlCheckpointStore(url=db.url, schema=db.schema, namespace="app-a")
    app_b = SqlCheckpointStore(url=db.url, schema=db.schema, namespace="app-b")
    try:
        ea = app_a.write("orders", b"A", if_match=None)
        eb = app_b.write("orders", b"B", if_match=None)  # same poller name, other namespace
        assert app_a.read("orders") == StoredDocument(b"A", ea)
        assert app_b.read("orders") == StoredDocument(b"B", eb)
        with pytest.raises(CasConflictError):
            app_b.write("orders", b"B2", if_match=ea)  # another namespace's etag is no key
        app_a.delete("orders")
        assert app_a.list_keys() == []
        assert app_b.list_keys() == ["orders"]
    finally:
        app_a.close()
        app_b.close()


def test_poller_names_differing_in_case_are_different_pollers(
    sql_store: SqlCheckpointStore,
) -> None:
    # MariaDB's default collations compare case-insensitively; the key columns
    # are declared binary so all three databases agree.
    upper = sql_store.write("Orders", b"upper", if_match=None)
    lower = sql_store.write("orders", b"lower", if_match=None)
    assert sql_store.read("Orders") == StoredDocument(b"upper", upper)
    assert sql_store.read("orders") == StoredDocument(b"lower", lower)
    assert sql_store.list_keys() == ["Orders", "orders"]


def test_one_megabyte_of_non_ascii_text_round_trips(sql_store: SqlCheckpointStore) -> None:
    # 4-byte characters need utf8mb4 on MariaDB; >64 KB needs LONGTEXT there.
    text = '{"journal": "' + ("é€😀x" * 100_000) + '"}'
    data = text.encode("utf-8")
    assert len(data) > 1_000_000
    etag = sql_store.write("big", data, if_match=None)
    assert sql_store.read("big") == StoredDocument(data, etag)
    etag2 = sql_store.write("big", b"{}", if_match=etag)
    assert sql_store.read("big") == StoredDocument(b"{}", etag2)


@pytest.mark.parametrize("data", [b"\xff\xfe not utf-8", b'{"a": "\x00"}'])
def test_bytes_that_are_not_text_are_refused_before_writing(
    sql_store: SqlCheckpointStore, data: bytes
) -> None:
    with pytest.raises(UnsupportedDocumentError):
        sql_store.write("p", data, if_match=None)
    assert sql_store.read("p") is None


def test_without_create_table_a_missing_table_is_reported_then_created(
    db: TestDatabase,
) -> None:
    store = SqlCheckpointStore(url=db.url, schema=db.schema, table="app_state", create_table=False)
    try:
        # a person must act (create it): an operator error naming the table, not an outage
        with pytest.raises(StoreRefusedError, match=r"there is no table .*app_state there"):
            store.read("orders")
        with pytest.raises(StoreRefusedError, match="No poller has committed"):
            store.list_keys()
        assert "CREATE TABLE" in store.ddl()
        store.create_table()
        store.create_table()  # idempotent
        etag = store.write("orders", b"{}", if_match=None)
        assert store.read("orders") == StoredDocument(b"{}", etag)
    finally:
        store.close()


def test_app_setting_reference_in_url(db: TestDatabase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBT_TEST_STATE_DB", db.url)
    store = SqlCheckpointStore(url="%DBT_TEST_STATE_DB%", schema=db.schema)
    try:
        etag = store.write("orders", b"{}", if_match=None)
        assert store.read("orders") == StoredDocument(b"{}", etag)
    finally:
        store.close()


def test_configuration_is_validated() -> None:
    with pytest.raises(ConfigurationError):
        SqlCheckpointStore()
    with pytest.raises(UnsafeIdentifierError):
        SqlCheckpointStore(url="sqlite://", table="state; DROP TABLE x")
    with pytest.raises(UnsafeIdentifierError):
        SqlCheckpointStore(url="sqlite://", namespace="../other")
    with pytest.raises(ConfigurationError, match="not a valid database URL"):
        SqlCheckpointStore(url="not a url")
    unset = SqlCheckpointStore(url="%NOT_SET_ANYWHERE%")  # an app setting: read at first use
    assert unset.describe().startswith("sql:(%NOT_SET_ANYWHERE%, unresolved)")
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="NOT_SET_ANYWHERE"):
            unset.read("p")
    store = SqlCheckpointStore(url="sqlite://")
    with pytest.raises(UnsafeIdentifierError):
        store.read("../etc/passwd")


# --- a whole drain with the state in the source database -----------------------------


def make_events_table(db: TestDatabase, rows: int) -> None:
    metadata = sa.MetaData()
    events = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.String(50), nullable=False),
        sa.Index("ix_events_version_id", "version", "id"),
        schema=db.schema,
    )
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        # Every version value is shared by 3 rows, so ties straddle batch boundaries.
        conn.execute(
            events.insert(),
            [{"id": i, "version": i // 3, "payload": f"p{i}"} for i in range(rows)],
        )


@dataclass
class CountedDrain:
    """A drain ticked until idle, with the store's reads and writes counted per tick."""

    trigger: PollTrigger
    delivered: list[int] = field(default_factory=list)
    #: (rows, store reads, store writes) of each tick
    per_tick: list[tuple[int, int, int]] = field(default_factory=list)

    def handle(self, events: list[RowChange]) -> None:
        self.delivered.extend(int(e.pk["id"]) for e in events)


def drain_counting_store_calls(db: TestDatabase, store: CheckpointStore) -> CountedDrain:
    """250 events (ties across batches) drained 3 batches of 40 per tick into ``store``."""
    make_events_table(db, 250)
    source = SqlAlchemySource(
        url=db.url, table="events", schema=db.schema, cursor_column="version", pk_columns=["id"]
    )
    counting = CountingStore(store)
    trigger = PollTrigger(
        name="events",
        source=source,
        checkpoint_store=counting,
        batch_size=40,
        max_batches_per_tick=3,
    )
    drain = CountedDrain(trigger)
    try:
        while True:
            rows = trigger.tick(drain.handle)
            counts = counting.reset()
            drain.per_tick.append((rows, counts.reads, counts.writes))
            if rows == 0:
                break
    finally:
        source.close()
    return drain


def test_poll_trigger_drains_with_state_in_the_same_database(
    db: TestDatabase, sql_store: SqlCheckpointStore
) -> None:
    drain = drain_counting_store_calls(db, sql_store)
    assert drain.delivered == list(range(250))
    # (rows, reads, writes): a tick of k batches costs 1 read + k + 1 writes
    # (acquire, k commits, the last folding in the release); an idle tick 1 read.
    assert drain.per_tick == [(120, 1, 4), (120, 1, 4), (10, 1, 2), (0, 1, 0)]
    state = drain.trigger.read_state()
    assert state is not None
    assert state.position.pk == {"id": 249}
    assert state.lease is not None
    assert state.lease.released
    assert sql_store.list_keys() == ["events"]


# --- failures, translated at the edge ----------------------------------------------------


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _messages(exc: BaseException) -> str:
    """The message of an error and of every cause in its chain."""
    parts = []
    seen: BaseException | None = exc
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def test_wrong_password_on_mariadb_is_an_auth_error_without_the_password(
    mariadb: TestDatabase,
) -> None:
    url = sa.make_url(mariadb.url).set(password=SECRET)
    store = SqlCheckpointStore(url=url.render_as_string(hide_password=False), schema=mariadb.schema)
    try:
        assert SECRET not in store.describe()
        with pytest.raises(StoreAuthError) as read_error:
            store.read("orders")
        with pytest.raises(StoreAuthError) as write_error:
            store.write("orders", b"{}", if_match=None)
    finally:
        store.close()
    for info in (read_error, write_error):
        assert "1045" in str(info.value)
        assert SECRET not in _messages(info.value)


def test_unknown_role_on_postgresql_is_an_auth_error_without_the_password(
    pg: TestDatabase,
) -> None:
    # The test server trusts local connections, so a wrong password alone is
    # accepted; a role that does not exist is refused at authentication.
    url = sa.make_url(pg.url).set(username="dbtrigger_no_such_role", password=SECRET)
    store = SqlCheckpointStore(url=url.render_as_string(hide_password=False), schema=pg.schema)
    try:
        with pytest.raises(StoreAuthError) as info:
            store.write("orders", b"{}", if_match=None)
    finally:
        store.close()
    assert "does not exist" in str(info.value)
    assert SECRET not in _messages(info.value)
    assert SECRET not in store.describe()


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_unreachable_server_is_unavailable_not_ambiguous(kind: str) -> None:
    scheme = "postgresql+psycopg" if kind == "postgresql" else "mysql+pymysql"
    url = f"{scheme}://app:{SECRET}@127.0.0.1:{_unused_port()}/state?connect_timeout=3"
    store = SqlCheckpointStore(url=url)
    try:
        with pytest.raises(StoreUnavailableError) as read_error:
            store.read("orders")
        with pytest.raises(StoreUnavailableError) as write_error:
            store.write("orders", b"{}", if_match=None)
    finally:
        store.close()
    for info in (read_error, write_error):
        assert not isinstance(info.value, AmbiguousWriteError)
        assert SECRET not in _messages(info.value)
        assert "127.0.0.1" in str(info.value)


def test_unopenable_sqlite_file_is_unavailable(tmp_path: Path) -> None:
    store = SqlCheckpointStore(url=f"sqlite:///{tmp_path / 'missing-dir' / 'state.db'}")
    with pytest.raises(StoreUnavailableError):
        store.read("orders")
    with pytest.raises(StoreUnavailableError):
        store.write("orders", b"{}", if_match=None)


def _kill_backend(kind: str, backend_id: int) -> None:
    """Terminate a server-side session from an admin connection and wait until it is gone."""
    admin = admin_engine(kind)
    with admin.connect() as conn:
        if kind == "postgresql":
            conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": backend_id})
            probe = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p")
        else:
            conn.execute(sa.text(f"KILL CONNECTION {int(backend_id)}"))
            probe = sa.text("SELECT count(*) FROM information_schema.processlist WHERE id = :p")
        deadline = time.monotonic() + 30  # bounded, generous for a loaded server
        while time.monotonic() < deadline:
            if conn.execute(probe, {"p": backend_id}).scalar() == 0:
                return
            conn.rollback()  # a fresh view: pg_stat_activity is cached per transaction
            time.sleep(0.05)
    raise AssertionError(f"{kind} session {backend_id} did not go away")


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_connection_lost_during_commit_is_ambiguous(kind: str, tmp_path: Path) -> None:
    from tests.databases import make_database  # noqa: PLC0415 - parametrised by kind here

    gen = make_database(kind, tmp_path)
    database = next(gen)
    engine = sa.create_engine(database.url, pool_pre_ping=True)
    store = SqlCheckpointStore(engine=engine, schema=database.schema)
    try:
        etag = store.write("orders", b'{"v": 1}', if_match=None)
        armed = {"on": True}

        @sa.event.listens_for(engine, "commit")
        def drop_connection(conn: sa.Connection) -> None:
            if not armed.pop("on", False):
                return
            dbapi = conn.connection.dbapi_connection
            backend = dbapi.info.backend_pid if kind == "postgresql" else dbapi.thread_id()
            _kill_backend(kind, backend)

        with pytest.raises(AmbiguousWriteError) as info:
            store.write("orders", b'{"v": 2}', if_match=etag)
        assert "COMMIT" in str(info.value)
        # The session died before COMMIT reached it, so here the write did not
        # land; the caller could not know that and must re-read, as the poller does.
        assert store.read("orders") == StoredDocument(b'{"v": 1}', etag)
        assert store.write("orders", b'{"v": 3}', if_match=etag) != etag
    finally:
        engine.dispose()
        for _ in gen:
            pass


def _dbapi_error(orig: BaseException, *, invalidated: bool = False) -> sa.exc.DBAPIError:
    return sa.exc.OperationalError("COMMIT", {}, orig, connection_invalidated=invalidated)


@pytest.mark.parametrize(
    ("orig", "invalidated", "kind"),
    [
        (psycopg.OperationalError('password authentication failed for user "app"'), False, "auth"),
        (psycopg.OperationalError("no pg_hba.conf entry for host"), False, "auth"),
        (psycopg.errors.InsufficientPrivilege("permission denied for table"), False, "auth"),
        (psycopg.errors.SerializationFailure("could not serialize access"), False, "conflict"),
        (psycopg.errors.DeadlockDetected("deadlock detected"), False, "conflict"),
        (psycopg.OperationalError("server closed the connection"), True, "disconnect"),
        (psycopg.OperationalError("connection refused"), False, "other"),
        (pymysql.err.OperationalError(1045, "Access denied for user"), False, "auth"),
        (pymysql.err.OperationalError(1142, "UPDATE command denied"), False, "auth"),
        (pymysql.err.OperationalError(1213, "Deadlock found"), False, "conflict"),
        (pymysql.err.OperationalError(2013, "Lost connection"), True, "disconnect"),
        (pymysql.err.OperationalError(2003, "Can't connect"), False, "other"),
    ],
)
def test_driver_error_classification(orig: BaseException, invalidated: bool, kind: str) -> None:
    assert classify_driver_error(_dbapi_error(orig, invalidated=invalidated)) == kind


# --- writers in separate processes ---------------------------------------------------------


def _racing_process(url: str, schema: str | None, index: int, barrier: Barrier, out: Any) -> None:
    """One process: race a create-only write, then a CAS on the etag everybody read."""
    store = SqlCheckpointStore(url=url, schema=schema)
    result: dict[str, Any] = {"index": index}
    try:
        barrier.wait(60)
        try:
            store.write("race", f"created-by-{index}".encode(), if_match=None)
            result["created"] = True
        except CasConflictError:
            result["created"] = False
        barrier.wait(60)
        stored = store.read("race")
        assert stored is not None
        result["etag"] = stored.etag
        barrier.wait(60)  # everybody holds the same etag before anybody writes
        try:
            store.write("race", f"updated-by-{index}".encode(), if_match=stored.etag)
            result["updated"] = True
        except CasConflictError:
            result["updated"] = False
    except BaseException as exc:
        result["error"] = repr(exc)
    finally:
        store.close()
        out.put(result)


def test_processes_racing_one_etag_exactly_one_wins(db: TestDatabase) -> None:
    # No table yet: the processes also race to create it.
    ctx = race_context()
    n = 4
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_racing_process, args=(db.url, db.schema, i, barrier, out))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert [r for r in results if "error" in r] == []
    creators = [r["index"] for r in results if r["created"]]
    winners = [r["index"] for r in results if r["updated"]]
    assert len(creators) == 1, results
    assert len({r["etag"] for r in results}) == 1
    assert len(winners) == 1, results
    store = SqlCheckpointStore(url=db.url, schema=db.schema)
    try:
        stored = store.read("race")
    finally:
        store.close()
    assert stored is not None
    assert stored.data == f"updated-by-{winners[0]}".encode()
    assert stored.etag != results[0]["etag"]


def test_state_table_name_is_configurable(db: TestDatabase) -> None:
    name = f"state_{uuid.uuid4().hex[:6]}"
    store = SqlCheckpointStore(url=db.url, schema=db.schema, table=name)
    try:
        store.write("orders", b"{}", if_match=None)
        assert name in store.describe()
        assert sa.inspect(db.engine).has_table(name, schema=db.schema)
    finally:
        store.close()
