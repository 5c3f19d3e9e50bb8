"""``dbtrigger check``: the installed console script against real tables and stores.

Each case builds a table the way users do (right or wrong), writes a module
defining the trigger, and runs ``dbtrigger check module:trigger`` as a
subprocess: exit 1 only for problems that lose rows or stop the poller,
warnings otherwise, ``--json`` for machines.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import (
    FileCheckpointStore,
    PollTrigger,
    SqlAlchemySource,
    SqlCheckpointStore,
    redaction,
)
from dbtrigger.checks import check_source, check_store, probe_key, warn_at_start
from dbtrigger.cursor import Position
from dbtrigger.state import document as docmod
from dbtrigger.state.document import Checkpoint, StateDocument
from dbtrigger.state.stores.factory import redact
from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command


def write_module(
    tmp_path: Path, db: TestDatabase, table: str, *, store: str | None = None, **source: Any
) -> str:
    """A module ``chk_<id>`` with ``trigger``; returns ``module:trigger``."""
    name = f"chk_{uuid.uuid4().hex[:8]}"
    kwargs = {"cursor_column": "updated_at", "pk_columns": ["id"]} | source
    store = store or f"FileCheckpointStore({str(tmp_path / 'state')!r})"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import (
                FileCheckpointStore, PollTrigger, SqlAlchemySource, SqlCheckpointStore
            )

            trigger = PollTrigger(
                name="orders",
                source=SqlAlchemySource(
                    url={db.url!r}, table={table!r}, schema={db.schema!r}, **{kwargs!r}
                ),
                checkpoint_store={store},
            )
            """
        )
    )
    return f"{name}:trigger"


def run_check(tmp_path: Path, spec: str, *extra: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [dbtrigger_command(), "check", spec, "--json", *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def by_check(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in report["findings"]}


def good_table(db: TestDatabase) -> None:
    """Keyed, indexed, NOT NULL, and the database moves the cursor on every write."""
    t = db.qualified("orders")
    if db.kind == "postgresql":
        db.execute(
            f"CREATE TABLE {t} (id INT PRIMARY KEY, updated_at timestamptz NOT NULL DEFAULT now())"
        )
        db.execute(
            f"CREATE FUNCTION {db.schema}.touch() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN NEW.updated_at := clock_timestamp(); RETURN NEW; END $$"
        )
        db.execute(
            f"CREATE TRIGGER orders_touch BEFORE INSERT OR UPDATE ON {t} "
            f"FOR EACH ROW EXECUTE FUNCTION {db.schema}.touch()"
        )
    elif db.kind == "mariadb":
        db.execute(
            f"CREATE TABLE {t} (id INT PRIMARY KEY, updated_at DATETIME(6) NOT NULL "
            "DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6))"
        )
    else:
        db.execute(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, "
            "updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')))"
        )
        db.execute(
            "CREATE TRIGGER orders_touch AFTER UPDATE ON orders BEGIN UPDATE orders SET "
            "updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now') WHERE id = NEW.id; END"
        )
    db.execute(f"CREATE INDEX ix_orders_cursor ON {t} (updated_at, id)")


def test_a_well_built_table_passes(db: TestDatabase, tmp_path: Path) -> None:
    good_table(db)
    code, report = run_check(tmp_path, write_module(tmp_path, db, "orders"))
    findings = by_check(report)
    assert code == 0, report
    assert report["warnings"] == 0, report
    for check in ("definition", "pk_unique", "cursor_index", "cursor_nullable"):
        assert findings[check]["severity"] == "ok", findings[check]
    assert findings["cursor_filled_by_db"]["severity"] == "ok"
    assert findings["store_writable"]["severity"] == "ok"
    if db.kind == "postgresql":  # the tests connect as a superuser
        assert findings["visibility_privilege"]["severity"] == "ok"
    # The probe key is gone again.
    assert probe_key("orders") not in FileCheckpointStore(tmp_path / "state").list_keys()


def test_keys_that_are_not_unique_fail_the_check(db: TestDatabase, tmp_path: Path) -> None:
    db.execute(
        f"CREATE TABLE {db.qualified('lines')} (id INT NOT NULL, line INT NOT NULL, "
        "updated_at INT NOT NULL, PRIMARY KEY (id, line))"
    )
    code, report = run_check(tmp_path, write_module(tmp_path, db, "lines"))
    assert code == 1
    definition = by_check(report)["definition"]
    assert definition["severity"] == "error"
    assert "not proven unique" in definition["message"]


def test_warnings_do_not_fail_the_check(db: TestDatabase, tmp_path: Path) -> None:
    """No index, a NULL-able cursor the application fills: delivered, but say so."""
    db.execute(f"CREATE TABLE {db.qualified('loose')} (id INT PRIMARY KEY, updated_at BIGINT)")
    code, report = run_check(tmp_path, write_module(tmp_path, db, "loose"))
    findings = by_check(report)
    assert code == 0, report
    assert findings["cursor_index"]["severity"] == "warning"
    assert "CREATE INDEX" in findings["cursor_index"]["fix"]
    assert findings["cursor_nullable"]["severity"] == "warning"
    assert findings["cursor_filled_by_db"]["severity"] == "warning"
    assert "application fills it" in findings["cursor_filled_by_db"]["message"]
    assert "W7" in findings["cursor_filled_by_db"]["message"]


def test_default_without_update_maintenance_is_a_w7_warning(
    db: TestDatabase, tmp_path: Path
) -> None:
    default = {"postgresql": "now()", "mariadb": "CURRENT_TIMESTAMP(6)"}.get(
        db.kind, "CURRENT_TIMESTAMP"
    )
    ts = "DATETIME(6)" if db.kind == "mariadb" else "TIMESTAMP"
    db.execute(
        f"CREATE TABLE {db.qualified('ins')} (id INT PRIMARY KEY, "
        f"updated_at {ts} NOT NULL DEFAULT {default})"
    )
    db.execute(f"CREATE INDEX ix_ins ON {db.qualified('ins')} (updated_at, id)")
    code, report = run_check(tmp_path, write_module(tmp_path, db, "ins"), "--no-store-probe")
    filled = by_check(report)["cursor_filled_by_db"]
    assert code == 0
    assert filled["severity"] == "warning"
    assert "nothing in the database moves it on UPDATE" in filled["message"]
    assert "store_writable" not in by_check(report)


def test_cursor_equal_to_key_sequence_passes_with_the_w7_note(
    db: TestDatabase, tmp_path: Path
) -> None:
    auto = {"postgresql": "BIGSERIAL", "mariadb": "BIGINT AUTO_INCREMENT"}.get(db.kind, "INTEGER")
    db.execute(f"CREATE TABLE {db.qualified('log')} (id {auto} PRIMARY KEY, body TEXT)")
    spec = write_module(tmp_path, db, "log", cursor_column="id", pk_columns=["id"])
    code, report = run_check(tmp_path, spec)
    findings = by_check(report)
    assert code == 0, report
    assert findings["cursor_index"]["severity"] == "ok"  # the primary key is the index
    assert findings["cursor_filled_by_db"]["severity"] == "ok"
    assert "never delivered (W7)" in findings["cursor_filled_by_db"]["message"]


def test_checkpoint_of_the_wrong_kind_fails_the_check(db: TestDatabase, tmp_path: Path) -> None:
    good_table(db)
    db.execute(f"INSERT INTO {db.qualified('orders')} (id) VALUES (1)")
    spec = write_module(tmp_path, db, "orders")
    source = SqlAlchemySource(
        url=db.url, table="orders", schema=db.schema, cursor_column="updated_at", pk_columns=["id"]
    )
    # A checkpoint written while the cursor was an integer column.
    doc = StateDocument(
        poller_name="orders",
        source_fingerprint=source.fingerprint(),
        checkpoint=Checkpoint(Position(7, {"id": 1}), "b1", dt.datetime.now(dt.timezone.utc)),
    )
    FileCheckpointStore(tmp_path / "state").write("orders", docmod.dumps(doc), if_match=None)
    code, report = run_check(tmp_path, spec)
    assert code == 1
    definition = by_check(report)["definition"]
    assert "integer value for cursor column 'updated_at'" in definition["message"]


def test_an_unwritable_store_fails_the_check(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """The state lives in a SQLite database opened read-only: no commit could ever land."""
    good_table(sqlite_db)
    state_db = tmp_path / "state.db"
    SqlCheckpointStore(url=f"sqlite:///{state_db}").create_table()
    read_only = f"sqlite:///file:{state_db}?mode=ro&uri=true"
    spec = write_module(
        tmp_path, sqlite_db, "orders", store=f"SqlCheckpointStore(url={read_only!r})"
    )
    code, report = run_check(tmp_path, spec)
    store = by_check(report)["store_writable"]
    assert code == 1, report
    assert store["severity"] == "error"
    assert "could not commit" in store["message"]


def test_store_probe_leaves_a_live_document_untouched(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    store = FileCheckpointStore(tmp_path / "state")
    etag = store.write("orders", b'{"x": 1}', if_match=None)
    store.write(probe_key("orders"), b"left by a check that was killed", if_match=None)
    finding = check_store(store, "orders")
    assert finding.severity == "ok", finding
    stored = store.read("orders")
    assert stored is not None
    assert stored.etag == etag
    assert store.list_keys() == ["orders"]


def test_missing_guard_privilege_is_a_warning_on_postgresql(pg: TestDatabase) -> None:
    good_table(pg)
    role = f"dbt_chk_{uuid.uuid4().hex[:8]}"
    pg.execute(f'CREATE ROLE "{role}" LOGIN')
    pg.execute(f'GRANT USAGE ON SCHEMA "{pg.schema}" TO "{role}"')
    pg.execute(f'GRANT SELECT ON {pg.qualified("orders")} TO "{role}"')
    try:
        url = pg.url.replace("postgres@", f"{role}@", 1)
        source = SqlAlchemySource(
            url=url,
            table="orders",
            schema=pg.schema,
            cursor_column="updated_at",
            pk_columns=["id"],
        )
        findings = {f.check: f for f in check_source(source)}
        source.close()
        assert findings["visibility_privilege"].severity == "warning"
        assert "pg_read_all_stats" in (findings["visibility_privilege"].fix or "")
    finally:
        pg.execute(f'DROP OWNED BY "{role}"')
        pg.execute(f'DROP ROLE "{role}"')


def test_worker_start_logs_findings_and_never_raises(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sqlite_db.execute("CREATE TABLE nokey (id INT NOT NULL, updated_at INT NOT NULL)")
    trigger = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="nokey", cursor_column="updated_at", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    with caplog.at_level(logging.WARNING, logger="dbtrigger.checks"):
        report = warn_at_start(trigger)
    assert report is not None
    assert not report.ok
    logged = [r for r in caplog.records if getattr(r, "event", "") == "startup_check"]
    assert any(r.levelno == logging.ERROR and "not proven unique" in r.getMessage() for r in logged)
    assert FileCheckpointStore(tmp_path / "state").list_keys() == []  # no store probe at start


def test_text_output_and_secret_redaction(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the credential-looking patterns: secrets that earlier tests in this process
    # registered (a password "secret", say) would mask this test's own tmp_path.
    monkeypatch.setattr(redaction, "_SECRETS", set())
    good_table(sqlite_db)
    spec = write_module(tmp_path, sqlite_db, "orders")
    proc = subprocess.run(
        [dbtrigger_command(), "check", spec],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("check orders (sqlite:orders)")
    assert "no problem found" in proc.stdout
    assert redact(proc.stdout) == proc.stdout


@pytest.mark.parametrize(
    ("declared", "severity"),
    [
        ("INTEGER PRIMARY KEY", "ok"),
        ("INTEGER PRIMARY KEY AUTOINCREMENT", "ok"),
        ("INT PRIMARY KEY", "warning"),
    ],
)
def test_a_sqlite_rowid_cursor_is_never_null(tmp_path: Path, declared: str, severity: str) -> None:
    """Three `dbtrigger run` on a SQLite change log each logged, at start, `WARNING ...
    cursor_nullable: dbt_seq allows NULL: such rows are not delivered until they get a
    value`. The log's dbt_seq is an INTEGER PRIMARY KEY: SQLite's rowid, which gives a
    NULL its next number, so no row is ever without one. Any other PRIMARY KEY column
    of SQLite can hold NULL (INT PRIMARY KEY included): still said."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE log (seq {declared}, note TEXT)")
    engine.dispose()
    source = SqlAlchemySource(url=url, table="log", cursor_column="seq", pk_columns=["seq"])
    try:
        findings = {f.check: f for f in check_source(source)}
    finally:
        source.close()
    assert findings["cursor_nullable"].severity == severity, findings["cursor_nullable"]


def test_a_sqlite_change_log_says_no_null_cursor_and_no_w7(tmp_path: Path) -> None:
    from dbtrigger.changelog import ChangeLogSource, install  # noqa: PLC0415

    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE items (id INTEGER PRIMARY KEY, version INT)")
    install(engine, "items")
    engine.dispose()
    source = ChangeLogSource(url=url, table="items")
    try:
        findings = {f.check: f for f in check_source(source)}
    finally:
        source.close()
    assert findings["cursor_nullable"].severity == "ok", findings["cursor_nullable"]
    # Every logged change is a row of its own: no update goes unseen (W7 is the
    # table poller's), and the advice to poll an updated_at instead is not for it.
    filled = findings["cursor_filled_by_db"]
    assert filled.severity == "ok", filled
    assert "W7" not in filled.message, filled
    assert "every insert, update and delete" in filled.message, filled
