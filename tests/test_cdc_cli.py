"""``dbtrigger cdc ...``, ``run``, ``status``, ``history``, ``reset``, ``check``: PgLogicalSource.

A real module defines the trigger (as a user's would), on the private
wal_level=logical server; every command runs through ``main()`` as the shell
would call it.
"""

from __future__ import annotations

import json
import re
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger.cdc import pg_admin, pg_connection
from dbtrigger.cli import main
from tests.cdc_servers import CdcDatabase, LogicalPostgres


class App:
    def __init__(self, db: CdcDatabase, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.db = db
        self.module = f"cdcapp_{uuid.uuid4().hex[:8]}"
        self.state = root / "state"
        self.out = root / "delivered.jsonl"
        self.poller = f"orders_{uuid.uuid4().hex[:6]}"
        (root / f"{self.module}.py").write_text(
            textwrap.dedent(
                f"""
                import json
                from dbtrigger import FileCheckpointStore, PollTrigger
                from dbtrigger.cdc import PgLogicalSource

                source = PgLogicalSource({db.url!r}, ["orders"], snapshot="never")
                trigger = PollTrigger(
                    name={self.poller!r},
                    source=source,
                    checkpoint_store=FileCheckpointStore({str(self.state)!r}),
                    batch_size=10,
                )

                @trigger.handler
                def handle(events):
                    with open({str(self.out)!r}, "a") as out:
                        for e in events:
                            out.write(json.dumps({{"op": e.op, "pk": dict(e.pk),
                                "snapshot": e.metadata["snapshot"]}}) + "\\n")
                """
            )
        )
        monkeypatch.chdir(root)
        monkeypatch.syspath_prepend(str(root))

    @property
    def spec(self) -> str:
        return f"{self.module}:trigger"

    @property
    def slot(self) -> str:
        return f"dbtrigger_{self.poller}"

    def delivered(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines()]

    def slot_status(self) -> str | None:
        return self.db.scalar(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
        )


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def app(cdc_db: CdcDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> App:
    cdc_db.execute("CREATE TABLE orders (id int PRIMARY KEY, status text)")
    return App(cdc_db, tmp_path, monkeypatch)


def test_install_is_a_dry_run_that_offers_full_images_then_status_check_and_drop(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "cdc", "install", app.spec)
    assert code == 0
    assert "CREATE TABLE IF NOT EXISTS" in out
    assert f'CREATE PUBLICATION "{app.slot}" FOR TABLE "public"."orders"' in out
    assert f"pg_create_logical_replication_slot('{app.slot}', 'pgoutput')" in out
    assert "REPLICA IDENTITY DEFAULT: a delete's before image has only id" in out
    assert "offered, with --full-images" in out
    # The dry run prints the statement the install runs: names quoted, so a
    # pasted copy means the same table as the install would alter.
    assert 'ALTER TABLE "public"."orders" REPLICA IDENTITY FULL' in out
    assert "-- WARNING: max_slot_wal_keep_size is unlimited" in out
    assert "dry run" in out
    assert app.slot_status() is None

    code, out, _ = run(capsys, "cdc", "install", app.spec, "--full-images", "--yes")
    assert code == 0
    assert app.slot_status() == "reserved"
    assert app.db.scalar("SELECT relreplident FROM pg_class WHERE relname = 'orders'") == "f"

    code, out, _ = run(capsys, "cdc", "status", app.spec)
    assert code == 0
    assert "wal_status reserved" in out
    assert "REPLICA IDENTITY FULL" in out
    assert "WARNING      max_slot_wal_keep_size is unlimited" in out  # said once, not twice
    code, out, _ = run(capsys, "cdc", "status", app.spec, "--json")
    assert json.loads(out)["healthy"] is True

    code, out, _ = run(capsys, "check", app.spec, "--no-store-probe")
    assert code == 0, out
    assert "wal_level=logical" in out
    assert f"replication slot {app.slot}: wal_status reserved" in out
    assert "WARNING  max_slot_wal_keep_size" in out

    code, out, _ = run(capsys, "cdc", "drop", app.spec)
    assert "would drop replication slot" in out
    assert app.slot_status() == "reserved"
    code, out, _ = run(capsys, "cdc", "drop", app.spec, "--yes")
    assert code == 0
    assert app.slot_status() is None
    code, out, _ = run(capsys, "cdc", "status", app.spec)
    assert code == 1
    assert "missing" in out


def test_run_status_history_reset_and_a_lost_slot_recreated_with_a_snapshot(
    app: App, logical_pg: LogicalPostgres, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "cdc", "install", app.spec, "--yes")
    app.db.execute("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 25) g")
    app.db.execute("UPDATE orders SET status = 'paid' WHERE id <= 5")
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "5", "--interval", "0")
    assert code == 0, err
    assert [d["op"] for d in app.delivered()] == ["insert"] * 25 + ["update"] * 5

    store = str(app.state)
    code, out, _ = run(capsys, "status", app.poller, "--store", store)
    assert code == 0
    assert "#0000000005" in out  # the checkpoint: the 5th change of the update's commit
    code, out, _ = run(capsys, "history", app.poller, "--store", store, "--json")
    assert sum(e["rows"] for e in json.loads(out) if e["type"] == "commit") == 30

    # The slot is invalidated while the worker is down (max_slot_wal_keep_size).
    logical_pg.set_config("max_slot_wal_keep_size", "1MB")
    try:
        with app.db.connect() as conn:
            for _ in range(4):
                conn.execute("CREATE TABLE IF NOT EXISTS filler (v text)")
                conn.execute("INSERT INTO filler VALUES ('x')")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
        assert app.slot_status() == "lost"
    finally:
        logical_pg.set_config("max_slot_wal_keep_size", None)
    app.db.execute("INSERT INTO orders VALUES (26, 'lost in the gap')")

    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    assert code == 2
    assert "invalidated" in err
    assert "dbtrigger cdc recreate" in err
    code, out, _ = run(capsys, "check", app.spec, "--no-store-probe")
    assert code == 1
    assert "ERROR    slot" in out
    code, out, _ = run(capsys, "cdc", "status", app.spec)
    assert code == 1
    assert "invalidated" in out
    code, out, _ = run(capsys, "status", app.poller, "--store", store, "--source", app.spec)
    assert "source error slot: replication slot" in out
    assert "is invalidated" in out

    code, _, err = run(capsys, "cdc", "recreate", app.spec, "--yes")
    assert code == 2
    assert "--snapshot" in err  # the operator must choose
    code, out, _ = run(capsys, "cdc", "recreate", app.spec, "--snapshot", "--yes")
    assert code == 0, out
    assert "snapshot of 1 table(s) queued" in out
    before = len(app.delivered())
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "10", "--interval", "0")
    assert code == 0, err
    again = app.delivered()[before:]
    assert all(d["snapshot"] for d in again)
    assert sorted(d["pk"]["id"] for d in again) == list(range(1, 27))  # the gap is covered

    code, out, _ = run(
        capsys,
        "reset",
        app.poller,
        "--store",
        store,
        "--to-beginning",
        "--reason",
        "replay",
        "--yes",
    )
    assert code == 0, out
    app.db.execute("INSERT INTO orders VALUES (27, 'after the reset')")
    before = len(app.delivered())
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    assert code == 0, err
    # The slot released what was delivered: from the beginning means what it still holds.
    assert [d["pk"]["id"] for d in app.delivered()[before:]] == [27]


def test_snapshot_and_accept_schema_commands(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "cdc", "install", app.spec, "--yes")
    app.db.execute("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 12) g")
    run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    code, out, _ = run(
        capsys, "cdc", "snapshot", app.spec, "--table", "orders", "--where", "id > 10"
    )
    assert "would read orders where id > 10 again" in out
    code, out, _ = run(
        capsys, "cdc", "snapshot", app.spec, "--table", "orders", "--where", "id > 10", "--yes"
    )
    assert code == 0
    before = len(app.delivered())
    run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    assert [(d["pk"]["id"], d["snapshot"]) for d in app.delivered()[before:]] == [
        (11, True),
        (12, True),
    ]

    app.db.execute("ALTER TABLE orders ALTER COLUMN status TYPE varchar(20)")
    app.db.execute("INSERT INTO orders VALUES (13, 'new')")
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    assert code == 2
    assert "SchemaChangedError" in err or "changed type" in err
    code, out, _ = run(capsys, "cdc", "accept-schema", app.spec)
    assert "public.orders.status: text -> character varying(20)" in out
    assert "dry run" in out
    code, out, _ = run(capsys, "cdc", "accept-schema", app.spec, "--yes")
    assert code == 0
    before = len(app.delivered())
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    assert code == 0, err
    assert [d["pk"]["id"] for d in app.delivered()[before:]] == [13]


def install_behind(
    app: App, capsys: pytest.CaptureFixture[str], statement: str, argv: list[str]
) -> tuple[int, str]:
    """``dbtrigger <argv>`` run while another session's transaction, open after
    ``statement``, holds a lock on ``orders``; its exit code and stderr. Fails the
    test when it still waited after 25 s (the transaction ends in any case)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(run(capsys, *argv)), daemon=True)
    with app.db.connect() as holder:
        holder.execute("BEGIN")  # (an autocommit session) a transaction that stays open
        holder.execute(statement)
        thread.start()
        thread.join(25)
        waited = thread.is_alive()
        holder.execute("ROLLBACK")
    thread.join(60)
    assert not waited, "cdc install still waited for the table's lock after 25 s"
    [(code, _, err)] = result
    return code, err


def test_install_full_images_behind_an_open_transaction_gives_up(
    app: App, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cdc install --full-images`` behind an application's transaction open on the
    table: its ALTER TABLE ... REPLICA IDENTITY FULL waited for ever, and every later
    reader and writer of the table queued behind it. Now it gives up after its bound."""
    monkeypatch.setattr(pg_admin, "INSTALL_LOCK_TIMEOUT", 1.0, raising=False)
    install = ["cdc", "install", app.spec, "--full-images", "--yes"]
    code, err = install_behind(app, capsys, "UPDATE orders SET status = status", install)
    assert code == 2, err
    assert "REPLICA IDENTITY FULL on public.orders waited 1 s for a lock" in err, err
    assert "held by backend pid" in err, err  # who holds it, as the other DDL says
    assert "its replica identity is unchanged" in err, err
    code, _, err = run(capsys, "cdc", "install", app.spec, "--full-images", "--yes")
    assert code == 0, err
    assert app.db.scalar("SELECT relreplident FROM pg_class WHERE relname = 'orders'") == "f"


def test_install_behind_an_index_build_gives_up_creating_the_publication(
    app: App, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CREATE PUBLICATION ... FOR TABLE`` waits behind a ``CREATE INDEX`` (a SHARE
    lock, held for the whole build), a ``VACUUM`` or an ``ALTER TABLE`` of the table:
    ``cdc install`` waited there for ever and said nothing. Now it gives up after its
    bound, naming who holds the lock, and creates nothing."""
    monkeypatch.setattr(pg_connection, "DDL_LOCK_TIMEOUT", 1.0, raising=False)
    shared = "LOCK TABLE orders IN SHARE MODE"  # as CREATE INDEX holds it
    code, err = install_behind(app, capsys, shared, ["cdc", "install", app.spec, "--yes"])
    assert code == 2, err
    assert "creating the publication waited 1 s for a lock another transaction holds" in err
    assert "held by backend pid" in err, err
    # The message names no table, so each holder's lock is said with its table.
    assert re.search(r"held by backend pid \d+ \([^)]*, on [\w.\"]*orders\)", err), err
    assert "nothing changed" in err, err
    published = "SELECT count(*) FROM pg_publication WHERE pubname = %s"
    assert app.db.scalar(published, (app.slot,)) == 0
    code, _, err = run(capsys, "cdc", "install", app.spec, "--yes")  # once it ended
    assert code == 0, err
    assert app.db.scalar(published, (app.slot,)) == 1
