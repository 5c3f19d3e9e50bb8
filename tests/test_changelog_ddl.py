"""Migrations on a table watched by the change log, on every database.

The change log's triggers run inside the application's writes: whatever DDL
the table goes through, those writes must succeed, and every change must
either be delivered or stop the poller with an error that names the fix
(re-install). Nothing is lost without being reported.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, drift, install, log_table_name, uninstall
from dbtrigger.changelog.ddl import MARKER, reflect_table
from dbtrigger.changelog.snapshot import resync
from dbtrigger.changelog.triggers import trigger_ddl
from dbtrigger.checks import check_trigger, warn_at_start
from dbtrigger.cli.main import main as cli_main
from dbtrigger.errors import (
    ChangeLogDriftError,
    ChangeLogGapError,
    ConfigurationError,
    DbTriggerError,
    FingerprintMismatchError,
)
from dbtrigger.state import operations as state_ops
from tests.databases import TestDatabase

BIG = 3_000_000_000  # past a 32-bit key: why keys are widened


def make_orders(db: TestDatabase) -> str:
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} ("
        "id INTEGER PRIMARY KEY, status VARCHAR(20) NOT NULL, note VARCHAR(20))"
    )
    return db.qualified("orders")


def poller(db: TestDatabase, tmp_path: Path, name: str = "orders-log") -> PollTrigger:
    # MariaDB's transaction horizon is server-wide: another session's open
    # transaction would hold these reads back. Every write here commits before
    # the poller reads, so no guard is needed to see them all.
    visibility = "none" if db.kind == "mariadb" else "auto"
    return PollTrigger(
        name=name,
        source=ChangeLogSource(
            url=db.url,
            table="orders",
            schema=db.schema,
            visibility=visibility,
            drift_check_seconds=0.001,  # every fetch, as a (re)started worker's first
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=50,
    )


class Replica:
    """The replica handler of docs/changes.md: upsert by key, remove on delete."""

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.seen: list[RowChange] = []

    def __call__(self, events: list[RowChange]) -> None:
        for e in events:
            self.seen.append(e)
            key = tuple(e.pk.values())
            if e.op == "truncate":
                self.rows.clear()
            elif e.op == "delete":
                self.rows.pop(key, None)
            else:
                assert e.after is not None
                self.rows[key] = dict(e.after)


def table_rows(db: TestDatabase, key: str = "id") -> dict[tuple[Any, ...], dict[str, Any]]:
    with db.engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT * FROM {db.qualified('orders')}")).mappings()
        return {(int(r[key]),): dict(r) for r in rows}


def application_writes(db: TestDatabase, key: str = "id", new_key: int = 3) -> None:
    """What the application keeps doing after the migration: each must succeed."""
    orders = db.qualified("orders")
    db.execute(f"INSERT INTO {orders} ({key}, status) VALUES ({new_key}, 'new')")
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE {key} = 1")
    db.execute(f"DELETE FROM {orders} WHERE {key} = 2")


def ops(events: list[RowChange]) -> list[tuple[str, int]]:
    return [(e.op, int(next(iter(e.pk.values())))) for e in events]


AFTER_DDL = [("insert", 3), ("update", 1), ("delete", 2)]

#: The statement each migration runs, per database (None: the database has no such ALTER).
DDL: dict[str, dict[str, str | None]] = {
    "add_column": dict.fromkeys(
        ("sqlite", "postgresql", "mariadb"), "ALTER TABLE {t} ADD COLUMN extra INTEGER"
    ),
    # The log's own prefix, on a column that only appears in the row images.
    "add_column_dbt_prefixed": dict.fromkeys(
        ("sqlite", "postgresql", "mariadb"), "ALTER TABLE {t} ADD COLUMN dbt_seq VARCHAR(9)"
    ),
    "drop_column": {
        "sqlite": None,  # refused by SQLite itself: test_sqlite_drop_column_*
        "postgresql": "ALTER TABLE {t} DROP COLUMN note",
        "mariadb": "ALTER TABLE {t} DROP COLUMN note",
    },
    "rename_column": dict.fromkeys(
        ("sqlite", "postgresql", "mariadb"), "ALTER TABLE {t} RENAME COLUMN note TO memo"
    ),
    "retype_column": {
        "sqlite": None,
        "postgresql": "ALTER TABLE {t} ALTER COLUMN note TYPE TEXT",
        "mariadb": "ALTER TABLE {t} MODIFY note TEXT",
    },
}

#: Whether the triggers still match the table after each migration.
DRIFTS = {
    ("postgresql", "add_column"): False,  # to_jsonb(row): nothing named, nothing to redo
    ("postgresql", "add_column_dbt_prefixed"): False,
    ("postgresql", "drop_column"): False,
    ("postgresql", "rename_column"): False,
    ("postgresql", "retype_column"): False,
    ("mariadb", "retype_column"): False,  # JSON_OBJECT renders any non-binary type
}


@pytest.mark.parametrize("migration", sorted(DDL))
def test_writes_succeed_and_changes_arrive_after_column_ddl(
    db: TestDatabase, tmp_path: Path, migration: str
) -> None:
    ddl = DDL[migration][db.kind]
    if ddl is None:
        pytest.skip(f"{db.kind} has no such ALTER TABLE")
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} (id, status, note) VALUES (1, 'new', 'a'), (2, 'new', 'b')")
    trigger = poller(db, tmp_path)
    replica = Replica()
    assert trigger.drain(replica) == 2

    db.execute(ddl.format(t=orders))
    application_writes(db)  # before the fix: 'Unknown column in NEW' on MariaDB

    drifts = DRIFTS.get((db.kind, migration), True)
    assert bool(drift(db.engine, "orders", schema=db.schema)) is drifts
    if drifts:
        with pytest.raises(ChangeLogDriftError, match="dbtrigger changelog install") as raised:
            trigger.tick(replica)
        assert "--table orders" in raised.value.fields["fix"]
        report = check_trigger(trigger, probe_store=False)
        assert [f.check for f in report.errors] == ["changelog_triggers"]
        with pytest.raises(ChangeLogDriftError):
            warn_at_start(trigger, raise_operator_errors=True)  # `dbtrigger run` stops here
        install(db.engine, "orders", schema=db.schema)  # the fix the error names
        assert not drift(db.engine, "orders", schema=db.schema)
        trigger = poller(db, tmp_path)  # the worker restarted after the re-install
    assert check_trigger(trigger, probe_store=False).ok

    trigger.drain(replica)
    assert ops(replica.seen[2:]) == AFTER_DDL
    assert replica.rows.keys() == table_rows(db).keys()
    assert replica.rows[(1,)]["status"] == "paid"
    if migration == "drop_column" and db.kind != "sqlite":
        assert "note" not in replica.rows[(1,)]  # the image of the row as it now is

    # After the re-install (or with nothing to redo) the images are complete again.
    db.execute(f"UPDATE {orders} SET status = 'shipped' WHERE id = 3")
    trigger.drain(replica)
    assert replica.rows[(3,)] == table_rows(db)[(3,)]


def test_key_rename_keeps_writes_and_the_checkpoint(db: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} (id, status) VALUES (1, 'new'), (2, 'new')")
    trigger = poller(db, tmp_path)
    replica = Replica()
    assert trigger.drain(replica) == 2

    db.execute(f"ALTER TABLE {orders} RENAME COLUMN id TO order_id")
    application_writes(db, key="order_id")  # before the fix: fails on PostgreSQL and MariaDB

    found = drift(db.engine, "orders", schema=db.schema)
    assert found.key_renamed
    with pytest.raises(ChangeLogDriftError, match="accept the changed source"):
        trigger.tick(replica)
    install(db.engine, "orders", schema=db.schema)  # renames the log's key column
    assert not drift(db.engine, "orders", schema=db.schema)

    restarted = poller(db, tmp_path)
    with pytest.raises(FingerprintMismatchError, match="--accept-source"):
        restarted.tick(replica)
    _accept_source(restarted)
    if db.kind == "mariadb":
        # The trigger could not name the changed rows (no row-to-JSON there):
        # reported, with what to do, never skipped.
        with pytest.raises(ChangeLogGapError, match="DELETE FROM") as gap:
            restarted.tick(replica)
        assert len(gap.value.fields["seqs"]) == 3
        resync(db.engine, "orders", schema=db.schema)  # what the error asks for, then:
        assert "AND dbt_op <> 'truncate'" in str(gap.value)
        db.execute(
            f"DELETE FROM {db.qualified(log_table_name('orders'))} "
            "WHERE (order_id IS NULL) AND dbt_op <> 'truncate'"
        )
    restarted.drain(replica)
    if db.kind != "mariadb":
        assert ops(replica.seen[2:]) == AFTER_DDL  # the keys filled in from the images
        assert all(set(e.pk) == {"order_id"} for e in replica.seen[2:])
    assert replica.rows.keys() == table_rows(db, "order_id").keys()

    # From here on, changes carry the renamed key.
    db.execute(f"UPDATE {orders} SET status = 'shipped' WHERE order_id = 3")
    restarted.drain(replica)
    assert replica.seen[-1].pk == {"order_id": 3}
    assert replica.rows[(3,)]["status"] == "shipped"


def _accept_source(trigger: PollTrigger) -> None:
    """What `dbtrigger reset NAME --accept-source ...` does."""
    import datetime as dt  # noqa: PLC0415

    from dbtrigger.state import document  # noqa: PLC0415

    stored = trigger.store.read(trigger.name)
    assert stored is not None
    doc = state_ops.accept_source(
        document.loads(stored.data),
        fingerprint=trigger.source.fingerprint(),
        now=dt.datetime.now(dt.timezone.utc),
        actor="test",
        reason="key renamed",
    )
    trigger.store.write(trigger.name, document.dumps(doc), if_match=stored.etag)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_key_widened_past_the_log_column(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} (id, status) VALUES (1, 'new'), (2, 'new')")
    trigger = poller(db, tmp_path)
    replica = Replica()
    assert trigger.drain(replica) == 2
    widen = "ALTER COLUMN id TYPE BIGINT" if kind == "postgresql" else "MODIFY id BIGINT"
    db.execute(f"ALTER TABLE {orders} {widen}")
    application_writes(db, new_key=BIG)  # a key the log's INTEGER cannot hold
    with pytest.raises(ChangeLogDriftError, match="id is BIGINT"):
        trigger.tick(replica)
    install(db.engine, "orders", schema=db.schema)  # widens the log's key, fills it in
    trigger = poller(db, tmp_path)
    trigger.drain(replica)  # the same poller: the key's name did not change
    assert ops(replica.seen[2:]) == [("insert", BIG), ("update", 1), ("delete", 2)]
    assert replica.rows.keys() == table_rows(db).keys()


def test_sqlite_drop_column_is_refused_by_sqlite_and_done_in_one_transaction(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    db = sqlite_db
    orders = make_orders(db)
    install(db.engine, "orders")
    db.execute(f"INSERT INTO {orders} (id, status, note) VALUES (1, 'new', 'a'), (2, 'new', 'b')")
    with pytest.raises(sa.exc.OperationalError, match="dbt_cl_orders"):
        db.execute(f"ALTER TABLE {orders} DROP COLUMN note")
    application_writes(db)  # the refused ALTER left the table and its writes alone
    # The documented recipe: triggers out, ALTER, triggers in, in one transaction.
    with db.engine.begin() as conn:
        uninstall(conn, "orders")
        conn.exec_driver_sql(f"ALTER TABLE {orders} DROP COLUMN note")
        install(conn, "orders")
    db.execute(f"UPDATE {orders} SET status = 'shipped' WHERE id = 3")
    assert not drift(db.engine, "orders")
    replica = Replica()
    poller(db, tmp_path).drain(replica)
    assert replica.rows.keys() == table_rows(db).keys()
    assert replica.rows[(3,)] == {"id": 3, "status": "shipped"}


def test_table_dropped_or_rebuilt_is_reported(db: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} (id, status) VALUES (1, 'new')")
    trigger = poller(db, tmp_path)
    replica = Replica()
    assert trigger.drain(replica) == 1
    # A rebuild (SQLite's way to change a column type): the new table has no triggers.
    db.execute(f"CREATE TABLE {db.qualified('orders_new')} AS SELECT * FROM {orders}")
    db.execute(f"DROP TABLE {orders}")
    with pytest.raises(ChangeLogDriftError, match="does not exist"):
        trigger.tick(replica)
    renamed = db.qualified("orders") if db.kind == "mariadb" else "orders"
    db.execute(f"ALTER TABLE {db.qualified('orders_new')} RENAME TO {renamed}")
    with pytest.raises(ChangeLogDriftError, match=r"missing|no primary key"):
        poller(db, tmp_path).tick(replica)


def test_triggers_of_an_older_dbtrigger_are_detected(db: TestDatabase, tmp_path: Path) -> None:
    """Upgrade: a v1 install (all columns named, NOT NULL keys) asks to be re-installed."""
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    _make_v1(db)
    found = drift(db.engine, "orders", schema=db.schema)
    assert any("older dbtrigger" in p for p in found.problems), found.problems
    with pytest.raises(ChangeLogDriftError, match="older dbtrigger"):
        poller(db, tmp_path).tick(lambda events: None)
    install(db.engine, "orders", schema=db.schema)
    assert not drift(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} (id, status) VALUES (1, 'new')")
    db.execute(f"ALTER TABLE {orders} RENAME COLUMN note TO memo")
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 1")  # no longer breaks


def _make_v1(db: TestDatabase) -> None:
    """Turn the installed triggers into what v1 wrote: the v1 marker, NOT NULL keys."""
    log = db.qualified(log_table_name("orders"))
    with db.engine.begin() as conn:
        if db.kind == "postgresql":
            fn = db.qualified("dbt_cl_orders_fn")
            src = conn.execute(
                sa.text("SELECT prosrc FROM pg_proc WHERE oid = to_regproc(:f)"), {"f": fn}
            ).scalar_one()
            old = src.split("\n", 1)[1].replace(MARKER, "x")
            conn.exec_driver_sql(
                f"CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS "
                f"$f$\n-- dbtrigger-changelog v1: one log row\n{old}$f$"
            )
            conn.exec_driver_sql(f"ALTER TABLE {log} ALTER COLUMN id SET NOT NULL")
            return
        rows = conn.execute(
            sa.text(
                "SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"
                if db.kind == "sqlite"
                else "SELECT TRIGGER_NAME, ACTION_STATEMENT FROM information_schema.TRIGGERS "
                "WHERE TRIGGER_SCHEMA = :s"
            ),
            {"s": db.schema},
        ).all()
        for name, text in rows:
            qualified = db.qualified(name)
            conn.exec_driver_sql(f"DROP TRIGGER {qualified}")
            if db.kind == "sqlite":
                body = text.replace(MARKER, "dbtrigger-changelog v1")
                conn.exec_driver_sql(body)
                continue
            event = {"ins": "INSERT", "upd": "UPDATE", "del": "DELETE"}[name[-3:]]
            conn.exec_driver_sql(
                f"CREATE TRIGGER {qualified} AFTER {event} ON {db.qualified('orders')} "
                f"FOR EACH ROW BEGIN /* dbtrigger-changelog v1 */ "
                f"INSERT INTO {log} (dbt_op, id) VALUES ('insert', "
                f"{'OLD' if event == 'DELETE' else 'NEW'}.id); END"
            )
        if db.kind == "mariadb":
            conn.exec_driver_sql(f"ALTER TABLE {log} MODIFY id INTEGER NOT NULL")


def test_hidden_triggers_are_not_called_drift(mariadb: TestDatabase, tmp_path: Path) -> None:
    """MariaDB lists triggers only to accounts with the TRIGGER privilege: not 'missing'."""
    make_orders(mariadb)
    install(mariadb.engine, "orders", schema=mariadb.schema)
    user = f"cl_{mariadb.schema}"[:30]
    for host in ("%", "localhost"):
        mariadb.execute(f"CREATE USER '{user}'@'{host}'")
        mariadb.execute(f"GRANT SELECT ON {mariadb.schema}.* TO '{user}'@'{host}'")
    url = sa.engine.make_url(mariadb.url).set(username=user, password=None, database=mariadb.schema)
    engine = sa.create_engine(url)
    try:
        found = drift(engine, "orders", schema=mariadb.schema)
        assert not found
        assert "TRIGGER privilege" in found.notes[0]
    finally:
        engine.dispose()
        for host in ("%", "localhost"):
            mariadb.execute(f"DROP USER '{user}'@'{host}'")


def test_drift_is_checked_again_while_running(pg: TestDatabase, tmp_path: Path) -> None:
    """A migration while the worker runs is found within drift_check_seconds."""
    orders = make_orders(pg)
    install(pg.engine, "orders", schema=pg.schema)
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(
            url=pg.url, table="orders", schema=pg.schema, drift_check_seconds=0.001
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    trigger.tick(lambda events: None)
    pg.execute(f"ALTER TABLE {orders} RENAME COLUMN id TO order_id")
    with pytest.raises(ChangeLogDriftError):
        trigger.tick(lambda events: None)


def test_drift_error_is_an_operator_error() -> None:
    assert issubclass(ChangeLogDriftError, DbTriggerError)
    with pytest.raises(Exception, match="drift_check_seconds"):
        ChangeLogSource(url="sqlite://", table="orders", drift_check_seconds=0)


def test_cli_check_reports_drift_and_the_fix(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    where = ["--url", db.url, "--table", "orders"] + (["--schema", db.schema] if db.schema else [])

    def cli(*args: str) -> tuple[int, str]:
        code = cli_main(["changelog", *args, *where])
        return code, capsys.readouterr().out

    code, out = cli("check")
    assert (code, "matches the table" in out) == (0, True), out
    db.execute(f"ALTER TABLE {orders} ADD COLUMN extra INTEGER")
    db.execute(f"ALTER TABLE {orders} RENAME COLUMN id TO order_id")
    code, out = cli("check")
    assert code == 1, out
    assert "(order_id)" in out
    assert "fix: dbtrigger changelog install" in out
    code, out = cli("install", "--yes")
    assert code == 0
    assert "--accept-source" in out
    assert cli("check")[0] == 0


def test_the_documented_one_transaction_recipes_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/changes.md: DROP COLUMN on SQLite, then a table rename, keeping the log."""
    text = (Path(__file__).parent.parent / "docs" / "changes.md").read_text()
    section = text.split("**Migrations the triggers would stand in the way of**")[1]
    snippets = [block.split("```")[0] for block in section.split("```python\n")[1:3]]
    monkeypatch.chdir(tmp_path)
    engine = sa.create_engine("sqlite:///shop.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, note TEXT)"
        )
    install(engine, "orders")
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO orders VALUES (1, 'new', 'x')")
    namespace: dict[str, Any] = {}
    for snippet in snippets:
        exec(compile(snippet, "docs/changes.md", "exec"), namespace)  # noqa: S102
    namespace["engine"].dispose()
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE purchases SET status = 'paid' WHERE id = 1")
    assert not drift(engine, "purchases")
    seen: list[RowChange] = []
    PollTrigger(
        name="purchases",
        source=ChangeLogSource(url="sqlite:///shop.db", table="purchases"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    ).drain(seen.extend)
    assert [(e.op, e.after) for e in seen] == [
        ("insert", {"id": 1, "status": "new", "note": "x"}),
        ("update", {"id": 1, "status": "paid"}),  # one log, before and after both ALTERs
    ]
    engine.dispose()


def test_bit_columns_are_logged_as_numbers_and_never_fail_a_write(
    mariadb: TestDatabase, tmp_path: Path
) -> None:
    """MariaDB's JSON_OBJECT writes a BIT value as a raw byte, which is not JSON. With a
    text column beside it, the triggers' column-by-column fallback then failed on its
    own image (error 4038), and with it every INSERT, UPDATE and DELETE of the
    application; alone, the log held invalid JSON that stopped the poller. A BIT column
    is now logged as its number; triggers installed without that are drift."""
    db = mariadb
    db.execute(
        f"CREATE TABLE {db.qualified('flags')} (id INTEGER PRIMARY KEY, on_off BIT(1), "
        "bits BIT(3), note TEXT)"
    )
    install(db.engine, "flags", schema=db.schema)
    db.execute(f"INSERT INTO {db.qualified('flags')} VALUES (1, 1, b'101', 'café')")
    db.execute(f"UPDATE {db.qualified('flags')} SET on_off = 0, note = 'thé' WHERE id = 1")
    db.execute(f"DELETE FROM {db.qualified('flags')} WHERE id = 1")
    trigger = PollTrigger(
        name="flags",
        # Every write committed before the read: no guard needed (see poller()).
        source=ChangeLogSource(url=db.url, table="flags", schema=db.schema, visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    seen: list[RowChange] = []
    trigger.drain(seen.extend)
    images = [(e.op, e.before, e.after) for e in seen]
    new = {"id": 1, "on_off": 1, "bits": 5, "note": "café"}
    changed = {"id": 1, "on_off": 0, "bits": 5, "note": "thé"}
    assert images == [("insert", None, new), ("update", new, changed), ("delete", changed, None)]

    # Triggers generated without the BIT rendering (an older dbtrigger) are drift.
    with db.engine.connect() as conn:
        info = reflect_table(conn, "flags", db.schema)
    older = dataclasses.replace(
        info, columns=tuple(dataclasses.replace(c, bit=False) for c in info.columns)
    )
    with db.engine.begin() as conn:
        quote = conn.dialect.identifier_preparer.quote
        for statement in trigger_ddl(older, quote):
            conn.exec_driver_sql(statement)
    with pytest.raises(ChangeLogDriftError, match=r"on_off, bits"):
        ChangeLogSource(url=db.url, table="flags", schema=db.schema).check_drift()


ODD_TYPES = {
    "postgresql": ("xml", "<a>1</a>"),
    "mariadb": ("INET6", "::1"),
    "sqlite": ("GEOMETRY", b"\x01\x02"),
}


@pytest.mark.filterwarnings("ignore:Did not recognize type")
def test_a_column_of_a_type_sqlalchemy_does_not_know_is_logged(
    db: TestDatabase, tmp_path: Path
) -> None:
    """``changelog install`` on a table with an xml (PostGIS, citext...) or an INET6
    column failed with SQLAlchemy's raw CompileError, though no trigger writes such a
    column's type (only a key's: that is a ConfigurationError). And SQLite, which lets
    any column hold bytes, failed the application's write of bytes to a TEXT or
    GEOMETRY column ("JSON cannot hold BLOB values"): bytes are logged as hex text
    there, as in a BLOB column."""
    odd, value = ODD_TYPES[db.kind]
    things = db.qualified("things")
    db.execute(f"CREATE TABLE {things} (id INTEGER PRIMARY KEY, odd {odd}, note TEXT)")
    install(db.engine, "things", schema=db.schema)
    note: Any = b"\xff\x00" if db.kind == "sqlite" else "é"
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {things} VALUES (1, :odd, :note)"),
            {"odd": value, "note": note},
        )
    db.execute(f"DELETE FROM {things} WHERE id = 1")
    trigger = PollTrigger(
        name="things",
        source=ChangeLogSource(url=db.url, table="things", schema=db.schema, visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    seen: list[RowChange] = []
    trigger.drain(seen.extend)
    shown = value.hex().upper() if isinstance(value, bytes) else value
    image = {"id": 1, "odd": shown, "note": "FF00" if db.kind == "sqlite" else "é"}
    assert [(e.op, e.before, e.after) for e in seen] == [
        ("insert", None, image),
        ("delete", image, None),
    ]
    if db.kind == "sqlite":
        return  # SQLite gives every declared type an affinity that SQLAlchemy knows
    key = "pg_lsn" if db.kind == "postgresql" else odd  # (xml has no ordering)
    db.execute(f"CREATE TABLE {db.qualified('odd_keys')} (id {key} PRIMARY KEY, note TEXT)")
    with pytest.raises(ConfigurationError, match=r"key column 'id' of 'odd_keys' has a type"):
        install(db.engine, "odd_keys", schema=db.schema)


def test_uninstall_after_the_table_was_dropped_or_renamed(db: TestDatabase) -> None:
    """A table dropped for good left a change log that ``changelog uninstall
    --drop-log`` could not remove ("table orders does not exist"), nor the
    PostgreSQL function. It now drops what is left; but when the triggers still
    exist (the table was renamed and they went with it, writing to this log),
    dropping the log would fail every write of the renamed table: refused."""
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    renamed = db.qualified("orders2") if db.kind == "mariadb" else "orders2"
    db.execute(f"ALTER TABLE {orders} RENAME TO {renamed}")
    with pytest.raises(ConfigurationError, match=r"dbt_cl_orders.* renamed"):
        uninstall(db.engine, "orders", schema=db.schema, drop_log=True)
    db.execute(f"INSERT INTO {db.qualified('orders2')} (id, status) VALUES (1, 'new')")
    assert sa.inspect(db.engine).has_table(log_table_name("orders"), schema=db.schema)

    db.execute(f"DROP TABLE {db.qualified('orders2')}")
    plan = uninstall(db.engine, "orders", schema=db.schema, drop_log=True)
    assert not sa.inspect(db.engine).has_table(log_table_name("orders"), schema=db.schema)
    assert any("DROP TABLE" in s for s in plan.statements)
    if db.kind == "postgresql":
        with db.engine.connect() as conn:
            left = conn.execute(
                sa.text("SELECT count(*) FROM pg_proc WHERE proname = 'dbt_cl_orders_fn'")
            ).scalar()
        assert left == 0
    uninstall(db.engine, "orders", schema=db.schema, drop_log=True)  # nothing left: a no-op


@pytest.mark.filterwarnings("ignore:Did not recognize type")
def test_a_spatial_column_is_logged_as_hex(mariadb: TestDatabase, tmp_path: Path) -> None:
    """A MariaDB POINT is bytes; JSON_OBJECT wrote them as text, one character per byte
    (NULs and all): an image no reader could use. Logged as hex, as binary columns are."""
    db = mariadb
    places = db.qualified("places")
    db.execute(f"CREATE TABLE {places} (id INTEGER PRIMARY KEY, at POINT, name TEXT)")
    install(db.engine, "places", schema=db.schema)
    db.execute(f"INSERT INTO {places} VALUES (1, POINT(1, 2), 'café')")
    with db.engine.connect() as conn:
        stored = conn.exec_driver_sql(f"SELECT HEX(at) FROM {places}").scalar()
    trigger = PollTrigger(
        name="places",
        source=ChangeLogSource(url=db.url, table="places", schema=db.schema, visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    seen: list[RowChange] = []
    trigger.drain(seen.extend)
    assert [e.after for e in seen] == [{"id": 1, "at": stored, "name": "café"}]


def test_a_log_dropped_under_a_running_poller_names_the_install(
    db: TestDatabase, tmp_path: Path
) -> None:
    """``changelog uninstall --drop-log`` while a poller runs: its next fetch failed with
    the keyset source's "fix the source definition ... or the table", which names
    neither the change log nor the command that brings it back."""
    orders = make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    db.execute(f"INSERT INTO {orders} (id, status) VALUES (1, 'new')")
    trigger = poller(db, tmp_path)
    assert trigger.drain(Replica()) == 1
    uninstall(db.engine, "orders", schema=db.schema, drop_log=True)
    with pytest.raises(
        ConfigurationError, match=r"change log of orders is gone.*changelog install"
    ):
        trigger.tick(Replica())
