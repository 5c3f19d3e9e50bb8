"""``reset --accept-source``: never for a source that cannot be read, and it shows the change.

A typo'd port (nothing listening) changes the fingerprint like a deliberate
move does. The worker used to end on "source definition changed" with a
ready-to-paste ``--accept-source ... --yes``, and pasting it tied the
checkpoint to an endpoint that does not exist. Now the connection error comes
first (typed, with the password-free URL), no accept command is suggested,
and ``reset --accept-source`` itself refuses a source it cannot read.

The dry run used to show two hashes; the state document now keeps what the
fingerprint hashes (readable, no secret), so the dry run and the mismatch
error say which fields changed. Everything runs through the installed
console script against each database.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command
from tests.test_source_sqlalchemy import (
    insert,
    make_table,
    naive,
    orders_table,
    precise_datetime,
)

SECRET = "Acc3ptS3cret"  # noqa: S105 - a test password (trust auth ignores it)

APP = """
import os
from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

orders = PollTrigger(
    name="orders",
    source=SqlAlchemySource(
        url=os.environ["ORDERS_URL"],
        table=os.environ.get("ORDERS_TABLE", "orders"),
        schema=os.environ.get("ORDERS_SCHEMA") or None,
        cursor_column=os.environ.get("ORDERS_CURSOR", "updated_at"),
        pk_columns=os.environ.get("ORDERS_KEY", "id").split(","),
        where=os.environ.get("ORDERS_WHERE") or None,
        parameters=dict(tenant=os.environ.get("ORDERS_TENANT", "t-1")),
    ),
    checkpoint_store=FileCheckpointStore({state!r}),
    batch_size=5,
)

@orders.handler
def handle(events):
    pass
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def good_url(db: TestDatabase) -> str:
    if db.kind == "postgresql":  # trust authentication: the password is only text to hide
        return db.url.replace("postgres@", f"postgres:{SECRET}@")
    return db.url


def typo_url(db: TestDatabase, tmp_path: Path) -> str:
    """The same database at an endpoint that does not answer (a port, a directory)."""
    if db.kind == "sqlite":
        return f"sqlite:///{tmp_path / 'no-such-dir' / 'source.db'}"
    url = sa.make_url(good_url(db)).set(port=free_port())
    return url.render_as_string(hide_password=False)


class App:
    def __init__(self, db: TestDatabase, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.state = tmp_path / "state"
        (tmp_path / "accept_app.py").write_text(APP.format(state=str(self.state)))
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("DBTRIGGER_", "ORDERS_"))
        }
        self.env.update(PYTHONPATH=str(tmp_path), ORDERS_URL=good_url(db))
        if db.schema:
            self.env["ORDERS_SCHEMA"] = db.schema

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [dbtrigger_command(), *args],
            capture_output=True,
            text=True,
            cwd=self.dir,
            env={**self.env, **env},
            timeout=120,
            check=False,
        )

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        return self.cli(
            "run",
            "accept_app:orders",
            "--interval",
            "0",
            "--max-backoff",
            "0",
            "--max-ticks",
            "2",
            **env,
        )

    def run_until(
        self, done: Callable[[subprocess.CompletedProcess[str]], bool], timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """:meth:`run` (two ticks) again until ``done(run)``, each run ending 0 (bounded).
        On MariaDB the visibility guard holds every row back, ticks and all, while a
        write transaction another test opened on the shared server before the guard's
        first look is still open: two ticks may deliver nothing, or not yet be idle."""
        deadline = time.monotonic() + timeout
        while True:
            ran = self.run()
            assert ran.returncode == 0, ran.stderr
            if done(ran):
                return ran
            assert time.monotonic() < deadline, f"not done within {timeout:.0f}s: {ran.stderr}"

    def delivered(self, ran: subprocess.CompletedProcess[str]) -> bool:
        return (self.state / "orders.json").exists()

    def accept(self, *more: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self.cli(
            "reset",
            "orders",
            "--accept-source",
            "accept_app:orders",
            "--reason",
            "moved",
            "--backup-dir",
            str(self.dir / "backups"),
            *more,
            **env,
        )

    def document(self) -> dict[str, object]:
        return dict(json.loads((self.state / "orders.json").read_text()))


def test_a_typo_in_the_endpoint_is_reported_as_a_connection_error_never_accepted(
    db: TestDatabase, tmp_path: Path
) -> None:
    insert(db, orders_table(db), [{"id": i, "updated_at": naive(i)} for i in range(3)])
    app = App(db, tmp_path)
    app.run_until(app.delivered)
    stored = app.document()["source_fingerprint"]

    typo = typo_url(db, tmp_path)
    failed = app.run(ORDERS_URL=typo)
    text = failed.stderr + failed.stdout
    assert "--accept-source" not in text, text
    assert "source definition changed" not in text, text
    assert SECRET not in text
    if db.kind == "sqlite":  # a file that cannot be opened stops the start-up check at once
        assert failed.returncode == 2
        assert "unable to open database file" in text, text
    else:  # a connection error: retried with backoff, reported before any definition change
        assert "cannot be read (FetchError" in text, text
        assert "do not accept a definition that cannot be read" in text, text
        assert f"port {sa.make_url(good_url(db)).port} -> {sa.make_url(typo).port}" in text
    if db.kind == "postgresql":
        assert "postgres:***@127.0.0.1" in text, text

    # The accept command refuses a source it cannot read, even when told --yes.
    refused = app.accept("--yes", ORDERS_URL=typo)
    assert refused.returncode != 0, refused.stdout
    assert "refusing to accept a definition that cannot be read" in refused.stderr
    assert SECRET not in refused.stderr + refused.stdout
    assert app.document()["source_fingerprint"] == stored  # nothing written

    # The typo fixed: the checkpoint was never touched.
    app.run_until(lambda ran: "idle: nothing after the checkpoint" in ran.stderr)


def test_the_dry_run_shows_what_changed_in_the_definition(db: TestDatabase, tmp_path: Path) -> None:
    rows = [{"id": i, "updated_at": naive(i)} for i in range(3)]
    insert(db, orders_table(db), rows)
    v2 = make_table(
        db,
        "orders_v2",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", precise_datetime(timezone=False), nullable=True),
        index=("updated_at", "id"),
    )
    insert(db, v2, rows)
    app = App(db, tmp_path)
    app.run_until(app.delivered)

    moved = {
        "ORDERS_TABLE": "orders_v2",
        "ORDERS_KEY": "id,updated_at",
        "ORDERS_WHERE": "id >= 0",
        "ORDERS_TENANT": "tenant-seven",
    }
    refused = app.run(**moved)
    assert refused.returncode == 2, refused.stderr
    assert 'table "orders" -> "orders_v2"' in refused.stderr  # the error says what changed
    dry = app.accept(**moved)
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout
    assert "definition   4 field(s) changed:" in out, out
    assert 'table: "orders" -> "orders_v2"' in out
    assert 'pk_columns: ["id"] -> ["id", "updated_at"]' in out
    assert 'where: null -> "id >= 0"' in out
    assert "parameters: " in out  # changed, shown as digests: a value may be sensitive
    assert "tenant-seven" not in out
    assert "dry run: nothing was written" in out

    applied = app.accept("--yes", **moved)
    assert applied.returncode == 0, applied.stderr
    recorded = app.document()["source_definition"]
    assert isinstance(recorded, dict)
    assert recorded["table"] == "orders_v2"
    assert recorded["fingerprint"] == app.document()["source_fingerprint"]
    assert app.run(**moved).returncode == 0


@pytest.mark.postgresql
def test_the_recorded_definition_holds_no_secret_and_reaches_older_documents(
    pg: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(pg)
    insert(pg, table, [{"id": 1, "updated_at": naive(1)}])
    app = App(pg, tmp_path)
    url = app.env["ORDERS_URL"] + f"?sslmode=prefer&application_name=x&password={SECRET}"
    assert app.run(ORDERS_URL=url, ORDERS_TENANT=SECRET).returncode == 0
    raw = (app.state / "orders.json").read_text()
    assert SECRET not in raw
    recorded = app.document()["source_definition"]
    assert isinstance(recorded, dict)
    assert recorded["port"] == 5432
    assert recorded["user"] == "postgres"
    assert recorded["url_options"] == {}  # connection-only and secret options are left out

    # A document written before definitions were recorded: the dry run says so and
    # shows the new definition; the next tick that writes records it.
    doc = app.document()
    del doc["source_definition"]
    (app.state / "orders.json").write_text(json.dumps(doc))
    dry = app.accept(ORDERS_URL=url, ORDERS_TENANT=SECRET, ORDERS_WHERE="id > 0")
    assert "does not record which definition its fingerprint stands for" in dry.stdout
    assert f"orders at postgresql://localhost:5432/{sa.make_url(pg.url).database}" in dry.stdout
    insert(pg, table, [{"id": 2, "updated_at": naive(2)}])  # (an idle tick writes nothing)
    assert app.run(ORDERS_URL=url, ORDERS_TENANT=SECRET).returncode == 0
    assert "source_definition" in app.document()

    # A stale copy (an older dbtrigger rewrote the fingerprint and kept the field)
    # is not believed.
    doc = app.document()
    doc["source_fingerprint"] = "sha256:" + "0" * 64
    parsed = docmod.loads(json.dumps(doc))
    assert docmod.known_definition(parsed) is None


def test_an_older_dbtrigger_keeps_the_field() -> None:
    """Rolling upgrades: a reader that does not know the field writes it back."""
    raw = {
        "version": 1,
        "poller_name": "orders",
        "source_fingerprint": "sha256:x",
        "source_definition": {"fingerprint": "sha256:x", "table": "orders"},
        "checkpoint": None,
        "lease": None,
        "failure": None,
        "journal": [],
    }
    doc = docmod.loads(json.dumps(raw))
    assert docmod.known_definition(doc) == raw["source_definition"]
    assert json.loads(docmod.dumps(doc)) == raw
    without = {k: v for k, v in raw.items() if k != "source_definition"}
    assert (
        docmod.dumps(docmod.loads(json.dumps(without)))
        == json.dumps(without, separators=(",", ":")).encode()
    )


def test_partition_sources_record_no_definition_of_another_fingerprint() -> None:
    """A wrapper that narrows a source (one partition) records nothing it cannot explain."""
    from dbtrigger.sources.base import source_definition  # noqa: PLC0415

    class Narrowed:
        name = "x"

        def fingerprint(self) -> str:
            return "sha256:partition"

        def source_definition(self) -> dict[str, object]:
            return {"fingerprint": "sha256:base", "table": "orders"}

    assert source_definition(Narrowed()) is None  # type: ignore[arg-type]
