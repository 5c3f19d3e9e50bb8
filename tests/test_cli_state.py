"""The state commands: every command in-process on the file store and on Azurite,
the guardrails (dry run, live lease, --force fencing, backups, journal), the
store factory, secrets kept out of output, and real subprocesses.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import subprocess
import sys
import textwrap
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.storage.blob import BlobServiceClient

from dbtrigger import (
    FileCheckpointStore,
    HandlerError,
    InMemoryCheckpointStore,
    LostLeaseError,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.cli import main
from dbtrigger.cli.backfill import Progress
from dbtrigger.cli.common import parse_position, parse_value, read_state
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, LiveLeaseError
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state import operations as ops
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import memory_store, open_store, redact
from tests.azurite import KEY, Azurite
from tests.databases import TestDatabase

ROWS = 50


def make_events_table(db: TestDatabase, rows: int = ROWS) -> None:
    """``events(id, seq)`` with ``seq = 10 * id``: an integer cursor typed easily on a CLI."""
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("note", sa.String(20)),
        schema=db.schema,
    )
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "seq": 10 * i} for i in range(1, rows + 1)])


@dataclass
class Backend:
    """Where the state lives: the store object the poller uses and the CLI's arguments."""

    kind: str
    store: CheckpointStore
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class App:
    """A poller over ``events`` registered as an importable module for --source/--trigger."""

    module: str
    trigger: PollTrigger
    source: SqlAlchemySource
    seen: list[int]
    backend: Backend
    backups: Path
    fail_on: set[int] = field(default_factory=set)

    def handler(self, events: list[RowChange]) -> None:
        ids = [int(e.pk["id"]) for e in events]
        if self.fail_on & set(ids):
            raise ValueError(f"poison row in {ids}")
        self.seen.extend(ids)

    def tick(self) -> int:
        return self.trigger.tick(self.handler)

    def close(self) -> None:
        self.source.close()
        close = getattr(self.backend.store, "close", None)
        if close is not None:
            close()

    def cli(self, *args: str, store: bool = True) -> list[str]:
        return [*args, *(self.backend.args if store else [])]

    def doc(self, name: str = "orders") -> docmod.StateDocument:
        stored = self.backend.store.read(name)
        assert stored is not None
        return docmod.loads(stored.data)

    def raw(self, name: str = "orders") -> tuple[bytes, str]:
        stored = self.backend.store.read(name)
        assert stored is not None
        return stored.data, stored.etag


def _blob_backend(azurite: Azurite) -> Iterator[Backend]:
    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

    container = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    try:
        store = BlobCheckpointStore.from_connection_string(
            azurite.connection_string, app_name="shop", container=container
        )
        yield Backend(
            "azurite",
            store,
            ["--store", azurite.connection_string, "--container", container, "--app", "shop"],
        )
    finally:
        service.delete_container(container)
        service.close()


@pytest.fixture(params=["file", pytest.param("azurite", marks=pytest.mark.azurite)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "file":
        state = tmp_path / "state"
        yield Backend("file", FileCheckpointStore(state), ["--store", str(state)])
        return
    yield from _blob_backend(request.getfixturevalue("azurite"))


def make_app(
    db: TestDatabase, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> App:
    make_events_table(db)
    source = SqlAlchemySource(
        url=db.url,
        table="events",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        # PostgreSQL's default guard waits out every open transaction on the server,
        # other tests' included; these tests are about the CLI, not visibility.
        visibility="none",
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=backend.store,
        batch_size=10,
        max_batches_per_tick=1,  # these tests step one batch per tick
    )
    module = f"cli_state_app_{uuid.uuid4().hex[:8]}"
    app = App(module, trigger, source, [], backend, tmp_path / "backups")
    trigger.handler(app.handler)
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    mod.source = source  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DBTRIGGER_BACKUP_DIR", str(app.backups))
    return app


@pytest.fixture
def app(
    sqlite_db: TestDatabase,
    backend: Backend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[App]:
    app = make_app(sqlite_db, backend, tmp_path, monkeypatch)
    yield app
    app.close()


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    # Every command of every test: the storage account key never reaches the terminal.
    assert KEY not in out + err
    return code, out, err


# --- status and history --------------------------------------------------------------------


def test_status_of_all_pollers_and_of_one(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.tick()
    app.tick()

    code, out, _ = run(capsys, app.cli("status"))
    assert code == 0
    header, row = out.splitlines()[1:3]
    assert header.split() == [
        "POLLER",
        "CURSOR",
        "LAST",
        "COMMIT",
        "LEASE",
        "LAG",
        "ROWS",
        "FAILING",
        "WINDOW",
    ]
    assert row.split()[:3] == ["orders", "200", "id=20"]
    assert "released t2" in row

    code, out, _ = run(capsys, app.cli("status", "orders", "--source", f"{app.module}:trigger"))
    assert code == 0
    fields = {line[:12].strip(): line[13:] for line in out.splitlines()}
    assert fields["checkpoint"] == "200 id=20"
    assert fields["lag"].startswith("30 rows")
    assert fields["fingerprint"].endswith("(matches --source)")
    assert fields["failing"] == "none"
    assert fields["window"].startswith("none")
    assert fields["last batch"].startswith(app.doc().checkpoint.last_successful_batch_id)  # type: ignore[union-attr]

    code, out, _ = run(
        capsys, app.cli("status", "orders", "--json", "--source", f"{app.module}:source")
    )
    status = json.loads(out)
    assert status["lag"]["rows"] == 30
    assert status["lease"]["state"] == "released"
    assert status["lease"]["fencing_token"] == 2
    assert status["checkpoint"]["cursor"]["value"] == 200
    assert status["fingerprint"] == app.source.fingerprint()
    assert status["failure"] is None

    for _ in range(10):  # the 30 rows left, whatever the batch
        app.tick()
    code, out, _ = run(capsys, app.cli("status", "orders", "--source", f"{app.module}:trigger"))
    fields = {line[:12].strip(): line[13:] for line in out.splitlines()}
    assert fields["lag"] == "0 rows (caught up)"  # no "oldest pending 0.0s"


def test_status_without_source_says_lag_is_unknown_and_shows_failures(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.fail_on = {3}
    with pytest.raises(HandlerError):
        app.tick()
    code, out, _ = run(capsys, app.cli("status", "orders"))
    assert code == 0
    assert "lag          unknown (pass --source to measure lag)" in out
    assert "1 attempt(s)" in out
    assert "poison row" in out
    code, out, _ = run(capsys, app.cli("status", "--json"))
    [status] = json.loads(out)
    assert status["failure"]["attempts"] == 1
    assert status["checkpoint"] is None
    assert status["lag"]["rows"] is None


def test_status_of_a_missing_poller_fails(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, app.cli("status", "nope"))
    assert code == 1
    assert "no state for poller 'nope'" in out
    assert out.rstrip().endswith("; it holds no poller")
    app.tick()
    code, out, _ = run(capsys, app.cli("status", "ordres"))  # a misspelt name
    assert code == 1
    assert out.rstrip().endswith("; it holds: orders")
    code, _, err = run(capsys, app.cli("reset", "ordres", "--to-beginning"))
    assert code == 2
    assert "no state for poller 'ordres'" in err
    assert "; it holds: orders" in err


def test_history_lists_commits_and_manual_changes(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(3):
        app.tick()
    run(capsys, app.cli("reset", "orders", "--to-beginning", "--reason", "replay all", "--yes"))
    code, out, _ = run(capsys, app.cli("history", "orders"))
    assert code == 0
    table, footer = out.split("\nkept in ")
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()]
    assert rows[0][:5] == ["#", "AT", "TYPE", "BATCH / OPERATION", "FROM"]
    commits = [row for row in rows if row[2] == "commit"]
    assert [row[0] for row in commits] == ["1", "2", "3"]  # numbered in the durable history
    assert [row[4:7] for row in commits] == [
        ["(beginning)", "100 id=10", "10"],
        ["100 id=10", "200 id=20", "10"],
        ["200 id=20", "300 id=30", "10"],
    ]
    assert rows[-1][2:6] == ["manual", "reset", "300 id=30", "(beginning)"]
    assert rows[-1][-1] == "reason: replay all"
    assert "waiting now: none" in footer

    code, out, _ = run(capsys, app.cli("history", "orders", "--json", "--limit", "2"))
    entries = json.loads(out)
    assert [e["type"] for e in entries] == ["commit", "manual"]
    assert entries[0]["rows"] == 10
    assert entries[0]["to"]["value"] == 300
    assert entries[1]["after"] is None


# --- reset and its guardrails ------------------------------------------------------------


def test_reset_is_a_dry_run_without_yes(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.tick()
    before = app.raw()
    code, out, _ = run(
        capsys,
        app.cli("reset", "orders", "--to-cursor", "50", "--pk", "id=5", "--reason", "r"),
    )
    assert code == 0
    assert "checkpoint   100 id=10\n               -> 50 id=5" in out
    assert "dry run: nothing was written" in out
    assert app.raw() == before
    assert not app.backups.exists()


def test_reset_needs_a_reason(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.tick()
    code, _, err = run(capsys, app.cli("reset", "orders", "--to-beginning", "--yes"))
    assert code == 2
    assert "--reason is required with --yes" in err
    assert not app.backups.exists()
    code, _, err = run(capsys, app.cli("reset", "orders", "--to-beginning", "--reason", " "))
    assert code == 2
    assert "needs a reason" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("reset", "orders", "--to-beginning"),
        ("clone", "orders", "orders-v2"),
    ],
)
def test_a_dry_run_needs_no_reason(
    app: App, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    """Looking at a plan is not a change: only applying it needs --reason."""
    app.tick()
    code, out, _ = run(capsys, app.cli(*argv))
    assert code == 0
    assert "<--reason: required with --yes>" in out  # the journal entry it would write
    assert out.rstrip().endswith("dry run: nothing was written; add --reason TEXT --yes to apply")
    code, _, err = run(capsys, app.cli(*argv, "--yes"))
    assert code == 2
    assert "--reason is required with --yes" in err
    assert not app.backups.exists()


def test_reset_to_cursor_writes_backup_and_journal_and_polling_resumes_there(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(3):
        app.tick()
    previous, _ = app.raw()
    code, out, _ = run(
        capsys,
        app.cli(
            "reset", "orders", "--to-cursor", "150", "--pk", "id=15",
            "--reason", "reprocess after the sink outage", "--yes", "--actor", "ana@ops",
        ),
    )  # fmt: skip
    assert code == 0, out
    doc = app.doc()
    assert doc.position == Position(150, {"id": 15})
    assert doc.checkpoint is not None
    assert doc.checkpoint.last_successful_batch_id is None
    entry = doc.journal[-1]
    assert entry["type"] == "manual"
    assert entry["operation"] == "reset"
    assert entry["actor"] == "ana@ops"
    assert entry["reason"] == "reprocess after the sink outage"
    assert entry["before"]["value"] == 300
    assert entry["after"] == docmod.position_to_json(Position(150, {"id": 15}))
    dt.datetime.fromisoformat(entry["at"].replace("Z", "+00:00"))
    [backup] = app.backups.iterdir()
    assert backup.read_bytes() == previous
    assert entry["backup"] == backup.name
    assert f"--from-file {backup.relative_to(app.backups.parent)}" in out or str(backup) in out

    app.seen.clear()
    app.tick()
    assert app.seen == list(range(16, 26))


def test_reset_to_beginning_and_restore_from_the_backup(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(2):
        app.tick()
    original = app.doc()
    code, _, _ = run(capsys, app.cli("reset", "orders", "--to-beginning", "--reason", "x", "--yes"))
    assert code == 0
    assert app.doc().checkpoint is None
    [backup] = app.backups.iterdir()

    code, out, _ = run(
        capsys,
        app.cli("reset", "orders", "--from-file", str(backup), "--reason", "undo", "--yes"),
    )
    assert code == 0, out
    restored = app.doc()
    assert restored.position == original.position
    assert restored.source_fingerprint == original.source_fingerprint
    ops = [e.get("operation") for e in restored.journal if e["type"] == "manual"]
    assert ops == ["reset", "restore"]
    assert restored.journal[-1]["from_file"] == backup.name
    assert len(list(app.backups.iterdir())) == 2  # the restore backed up what it replaced


def test_restore_refuses_a_backup_of_another_poller(
    app: App, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    app.tick()
    other = docmod.StateDocument(poller_name="other", source_fingerprint="sha256:x")
    path = tmp_path / "other.json"
    path.write_bytes(docmod.dumps(other))
    code, _, err = run(
        capsys, app.cli("reset", "orders", "--from-file", str(path), "--reason", "r", "--yes")
    )
    assert code == 2
    assert "backup is of poller 'other'" in err


def test_reset_to_batch_from_the_journal(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        app.tick()
    second = app.doc().journal[1]["batch_id"]
    code, _, _ = run(
        capsys, app.cli("reset", "orders", "--to-batch", second, "--reason", "r", "--yes")
    )
    assert code == 0
    assert app.doc().position == Position(200, {"id": 20})
    code, _, _ = run(
        capsys,
        app.cli("reset", "orders", "--to-batch", second, "--redeliver", "--reason", "r", "--yes"),
    )
    assert code == 0
    assert app.doc().position == Position(100, {"id": 10})
    code, _, err = run(capsys, app.cli("reset", "orders", "--to-batch", "batch_x", "--reason", "r"))
    assert code == 2
    assert "not in the journal" in err


def test_refused_under_a_live_lease_and_force_fences_the_holder_out(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.tick()
    codes: list[tuple[int, str]] = []

    def handler_that_meets_an_operator(events: list[RowChange]) -> None:
        # While this batch is in flight the lease is live.
        reset = ["reset", "orders", "--to-cursor", "400", "--pk", "id=40", "--reason", "skip"]
        code, _, err = run(capsys, app.cli(*reset, "--yes"))
        codes.append((code, err))
        code, out, _ = run(capsys, app.cli(*reset, "--yes", "--force"))
        codes.append((code, out))

    token_before = app.doc().lease.fencing_token  # type: ignore[union-attr]
    with pytest.raises(LostLeaseError):
        app.trigger.tick(handler_that_meets_an_operator)

    (refused, refusal), (forced, forced_out) = codes
    assert refused == 2
    assert "reset refused" in refusal
    assert "--force" in refusal
    assert forced == 0, forced_out
    doc = app.doc()
    # The old owner's commit was rejected: the operator's position stands.
    assert doc.position == Position(400, {"id": 40})
    assert doc.lease is not None
    assert doc.lease.released
    assert doc.lease.owner_id.startswith("operator:")
    assert doc.lease.fencing_token == token_before + 2  # the tick's acquire, then the fence
    fenced = doc.journal[-1]["fenced"]
    assert fenced["fencing_token"] == token_before + 1
    assert fenced["new_fencing_token"] == token_before + 2
    assert len(list(app.backups.iterdir())) == 1  # the refused attempt wrote nothing

    app.seen.clear()
    app.tick()
    assert app.seen == list(range(41, 51))
    assert app.doc().lease.fencing_token == token_before + 3  # type: ignore[union-attr]


def test_a_concurrent_change_makes_the_command_fail_without_writing(
    app: App, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app.tick()
    cls = type(app.backend.store)
    real_write = cls.write
    intercepted: list[str] = []

    def write_after_someone_else(
        self: CheckpointStore, key: str, data: bytes, *, if_match: str | None
    ) -> str:
        if not intercepted:  # the command's write: a poller commits just before it
            intercepted.append(key)
            monkeypatch.setattr(cls, "write", real_write)
            app.tick()
        return real_write(self, key, data, if_match=if_match)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "write", write_after_someone_else)
    code, _, err = run(
        capsys, app.cli("reset", "orders", "--to-beginning", "--reason", "r", "--yes")
    )
    assert intercepted == ["orders"]
    assert code == 2
    assert "changed while this command ran" in err
    assert app.doc().position == Position(200, {"id": 20})


# --- release, clone, skip ------------------------------------------------------------------


def _leave_live_lease(app: App, ttl: float) -> int:
    """A lease as a crashed instance leaves it: acquired, never released."""
    data, etag = app.raw()
    decision = leasemod.decide_acquire(
        docmod.loads(data),
        poller="orders",
        fingerprint=app.source.fingerprint(),
        owner="crashed-host/1/dead",
        now=dt.datetime.now(dt.timezone.utc),
        ttl=dt.timedelta(seconds=ttl),
    )
    assert isinstance(decision, leasemod.Acquired)
    app.backend.store.write("orders", docmod.dumps(decision.document), if_match=etag)
    return decision.fencing_token


def test_release_lease(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.tick()
    code, _, err = run(capsys, app.cli("release-lease", "orders", "--reason", "r", "--yes"))
    assert code == 2
    assert "holds no lease" in err

    token = _leave_live_lease(app, ttl=3600)
    code, _, err = run(capsys, app.cli("release-lease", "orders", "--reason", "r", "--yes"))
    assert code == 2
    assert "crashed-host/1/dead" in err
    code, out, _ = run(
        capsys,
        app.cli("release-lease", "orders", "--reason", "instance gone", "--yes", "--force"),
    )
    assert code == 0, out
    doc = app.doc()
    assert doc.lease is not None
    assert doc.lease.released
    assert doc.lease.fencing_token == token + 1
    assert doc.position == Position(100, {"id": 10})
    assert doc.journal[-1]["operation"] == "release_lease"
    app.tick()
    assert app.doc().position == Position(200, {"id": 20})


def test_an_expired_lease_needs_no_force_but_is_still_fenced(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.tick()
    token = _leave_live_lease(app, ttl=0.001)
    code, out, _ = run(capsys, app.cli("release-lease", "orders", "--reason", "r", "--yes"))
    assert code == 0, out
    assert app.doc().lease.fencing_token == token + 1  # type: ignore[union-attr]


def test_clone(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.tick()
    code, out, _ = run(capsys, app.cli("clone", "orders", "orders-v2", "--reason", "r"))
    assert code == 0
    assert "dry run" in out
    assert app.backend.store.read("orders-v2") is None

    code, out, _ = run(capsys, app.cli("clone", "orders", "orders-v2", "--reason", "v2", "--yes"))
    assert code == 0, out
    clone = app.doc("orders-v2")
    assert clone.position == Position(100, {"id": 10})
    assert clone.lease is None
    assert clone.source_fingerprint == app.doc().source_fingerprint
    [entry] = clone.journal
    assert entry["operation"] == "clone"
    assert entry["cloned_from"] == "orders"

    code, _, err = run(capsys, app.cli("clone", "orders", "orders-v2", "--reason", "r", "--yes"))
    assert code == 2
    assert "already exists" in err

    twin = PollTrigger(
        name="orders-v2",
        source=app.source,
        checkpoint_store=app.backend.store,
        batch_size=10,
        max_batches_per_tick=1,
    )
    app.seen.clear()
    twin.tick(app.handler)
    assert app.seen == list(range(11, 21))


def test_skip_batch_finds_the_poison_batch_through_the_source(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.tick()
    app.fail_on = {15}
    for _ in range(2):
        with pytest.raises(HandlerError):
            app.tick()
    failing = app.doc().failure
    assert failing is not None
    assert failing.attempts == 2

    code, _, err = run(capsys, app.cli("skip-batch", "orders", "--reason", "r"))
    assert code == 2
    assert "needs --source" in err

    code, out, _ = run(
        capsys,
        app.cli(
            "skip-batch", "orders", "--source", f"{app.module}:trigger",
            "--reason", "row 15 is corrupt, ticket OPS-1", "--yes",
        ),
    )  # fmt: skip
    assert code == 0, out
    assert "-> 200 id=20" in out
    doc = app.doc()
    assert doc.position == Position(200, {"id": 20})
    assert doc.failure is None
    entry = doc.journal[-1]
    assert entry["operation"] == "skip_batch"
    assert entry["skipped_rows"] == 10
    assert entry["skipped_keys"] == [{"id": i} for i in range(11, 21)]
    assert entry["failed_batch_id"] == failing.batch_id
    assert entry["failed_attempts"] == 2
    assert "poison row" in entry["last_error"]

    app.seen.clear()
    app.tick()
    assert app.seen == list(range(21, 31))


def test_skip_batch_to_a_cursor(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.tick()
    code, out, _ = run(
        capsys,
        app.cli(
            "skip-batch", "orders", "--to-cursor", "120", "--pk", "id=12", "--reason", "r", "--yes"
        ),
    )
    assert code == 0, out
    assert app.doc().position == Position(120, {"id": 12})
    assert "skipped_rows" not in app.doc().journal[-1]


# --- backfill --------------------------------------------------------------------------------


def test_backfill_drains_a_separate_poller_with_progress(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(2):
        app.tick()
    live_before = app.raw()
    app.seen.clear()
    base = ["backfill", "orders-backfill", "--trigger", f"{app.module}:trigger"]

    code, out, _ = run(
        capsys, app.cli(*base, "--from-cursor", "300", "--pk", "id=30", "--reason", "r")
    )
    assert code == 0
    assert "about 20 rows" in out
    assert "dry run" in out
    assert app.backend.store.read("orders-backfill") is None
    assert app.seen == []

    code, out, err = run(
        capsys,
        app.cli(
            *base, "--from-beginning", "--batch-size", "7", "--reason", "rebuild the cache", "--yes"
        ),
    )
    assert code == 0, err
    assert app.seen == list(range(1, ROWS + 1))
    assert "caught up: 50 rows delivered" in out
    last_progress = err.strip().splitlines()[-1]
    assert "50/50 rows 100%" in last_progress
    assert "rows/s" in last_progress
    assert app.raw() == live_before  # the live poller was never touched
    doc = app.doc("orders-backfill")
    assert doc.journal[0]["operation"] == "backfill"
    assert doc.journal[0]["backfill_of"] == "orders"
    assert doc.position == Position(500, {"id": 50})

    # Resuming a finished backfill finds nothing; restarting it needs a new name.
    code, out, _ = run(capsys, app.cli(*base, "--reason", "r", "--yes"))
    assert code == 0
    assert "caught up: 0 rows" in out
    code, _, err = run(capsys, app.cli(*base, "--from-beginning", "--reason", "r", "--yes"))
    assert code == 2
    assert "already exists" in err
    code, _, err = run(
        capsys,
        ["backfill", "orders", "--trigger", f"{app.module}:trigger", "--reason", "r"],
    )
    assert code == 2
    assert "its own poller name" in err


def test_progress_bar_rendering() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    class Sink:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    sink = Sink()
    progress = Progress(sink, 100, clock=clock)  # type: ignore[arg-type]
    now[0] = 2.0
    progress.update(50)
    assert sink.text.startswith("\r[##############--------------] 50/100 rows  50%")
    assert "25 rows/s" in sink.text
    assert "ETA 0:00:02" in sink.text
    now[0] = 4.0
    progress.update(70)  # more rows than estimated: the total grows
    progress.finish()
    assert sink.text.endswith("\n")
    assert "120/120 rows 100%" in sink.text.splitlines()[-1].split("\r")[-1]


# --- parsing --------------------------------------------------------------------------------


def test_parse_values_by_kind() -> None:
    assert parse_value("2026-04-07T01:23:45.5Z", "timestamp") == dt.datetime(
        2026, 4, 7, 1, 23, 45, 500000, tzinfo=dt.timezone.utc
    )
    assert parse_value("2026-04-07 03:00:00+02:00", "timestamp") == dt.datetime(
        2026, 4, 7, 1, tzinfo=dt.timezone.utc
    )
    assert parse_value("2026-04-07T01:00:00", "naive_timestamp") == dt.datetime(2026, 4, 7, 1)
    assert str(parse_value("10.50", "decimal")) == "10.50"
    assert parse_value("2026-04-07", "date") == dt.date(2026, 4, 7)
    assert str(parse_value("12345678-1234-5678-1234-567812345678", "uuid")).startswith("1234")
    for text, kind in [("2026-04-07T01:00:00", "timestamp"), ("x", "int"), ("NaN", "decimal")]:
        with pytest.raises(ConfigurationError):
            parse_value(text, kind)


def test_parse_position_takes_kinds_from_the_stored_checkpoint() -> None:
    stored = docmod.StateDocument(
        poller_name="p",
        source_fingerprint="f",
        checkpoint=docmod.Checkpoint(
            position=Position(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), {"code": "007"}),
            last_successful_batch_id=None,
            updated_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        ),
    )
    position = parse_position("2026-02-01T00:00:00Z", ["code=042"], kind=None, like=stored)
    assert position == Position(dt.datetime(2026, 2, 1, tzinfo=dt.timezone.utc), {"code": "042"})
    # Without a checkpoint: the source's column types, never the look of the value.
    kinds = lambda: ("int", {"id": "int"})  # noqa: E731 - what a source reflects
    assert parse_position("5", ["id=7"], kind=None, like=None, kinds=kinds) == Position(
        5, {"id": 7}
    )
    assert parse_position("5", ["id:str=7"], kind="str", like=None) == Position("5", {"id": "7"})
    with pytest.raises(ConfigurationError, match="cannot tell which type --to-cursor '5' is"):
        parse_position("5", ["id=7"], kind=None, like=None)
    with pytest.raises(ConfigurationError, match="--pk id:KIND=7"):
        parse_position("5", ["id=7"], kind="int", like=None)
    with pytest.raises(ConfigurationError, match="every key column"):
        parse_position("2026-02-01T00:00:00Z", ["id=1"], kind=None, like=stored)
    with pytest.raises(ConfigurationError, match="needs the key"):
        parse_position("5", [], kind=None, like=None)


# --- store factory and secrets ------------------------------------------------------------------


def test_open_store_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert open_store("memory:x") is memory_store("x")
    assert open_store(f"file:{tmp_path}").describe() == f"file:{tmp_path}"
    assert open_store(str(tmp_path)).describe() == f"file:{tmp_path}"
    monkeypatch.setenv("STATE_LOCATION", f"file:{tmp_path}")
    assert open_store("%STATE_LOCATION%").describe() == f"file:{tmp_path}"
    with pytest.raises(ConfigurationError, match="unknown store scheme"):
        open_store("ftp://example/x")
    with pytest.raises(ConfigurationError, match="MISSING_SETTING"):
        open_store("%MISSING_SETTING%")


def test_open_store_builds_azure_and_sql_stores_without_echoing_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415
    from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415

    blob = open_store("azure-blob://acct.blob.core.windows.net/my-state?app=shop", app="ignored")
    assert isinstance(blob, BlobCheckpointStore)
    assert blob.container_name == "my-state"
    assert blob.app_name == "shop"

    secret = "Zm9vYmFyc2VjcmV0a2V5MTIzNDU2Nzg5MA=="  # noqa: S105 - fake, for redaction
    conn = f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={secret};"
    monkeypatch.setenv("MY_STORAGE", conn)
    via_setting = open_store("%MY_STORAGE%", app="shop", container="other-state")
    assert isinstance(via_setting, BlobCheckpointStore)
    assert via_setting.container_name == "other-state"
    assert secret not in via_setting.describe()

    sql = open_store(
        "postgresql+psycopg://u:Sql-Pa55word@127.0.0.1:5432/test?state_table=st&namespace=shop"
    )
    assert isinstance(sql, SqlCheckpointStore)
    assert "Sql-Pa55word" not in sql.describe()
    assert redact(f"oops {conn} and postgresql://u:Sql-Pa55word@h/db") == (
        "oops DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***; "
        "and postgresql://u:***@h/db"
    )


def test_redact_masks_credentials_in_free_text() -> None:
    text = (
        "https://a.blob.core.windows.net/c?sv=2024&sig=abcDEF%2B123&se=1 "
        "Server=x;Password=hunter22;Uid=sa "
        "mysql+pymysql://root:pw-123@db/x?ssl_key=/k "
        "Authorization: Bearer eyJhbGciOi.J9.xyz"
    )
    masked = redact(text)
    for secret in ("abcDEF%2B123", "hunter22", "pw-123", "eyJhbGciOi.J9.xyz"):
        assert secret not in masked
    assert "sig=***" in masked
    assert "sv=2024" in masked  # harmless parameters stay readable


def test_secrets_never_reach_cli_output(
    pg: TestDatabase,
    azurite: Azurite,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    password = "Pg-Secret-7d1e"  # noqa: S105 - fake; PostgreSQL trusts local users
    url = sa.make_url(pg.url).set(password=password).render_as_string(hide_password=False)
    state_url = f"{url}?state_schema={pg.schema}&namespace=shop"
    sql_store = SqlCheckpointStore(url=url, schema=pg.schema, namespace="shop")
    backend = Backend("sql", sql_store, ["--store", state_url])
    app = make_app(pg, backend, tmp_path, monkeypatch)
    try:
        _check_no_secret_in_output(app, pg, azurite, url, state_url, password, capsys, monkeypatch)
    finally:
        app.close()


def _check_no_secret_in_output(
    app: App,
    pg: TestDatabase,
    azurite: Azurite,
    url: str,
    state_url: str,
    password: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert app.tick() == 10

    outputs: list[str] = []
    for argv, expected in (
        (app.cli("status"), 0),
        (app.cli("status", "orders", "--json"), 0),
        (app.cli("history", "orders"), 0),
        (app.cli("reset", "orders", "--to-beginning", "--reason", "r", "--yes"), 0),
        (["status", "--store", state_url.replace(pg.schema or "", "no_such_schema")], 2),
        (["status", "--store", url.replace("/test", "/no_such_database")], 2),
    ):
        code, out, err = run(capsys, argv)
        outputs.append(out + err)
        assert code == expected, out + err
    assert any("error" in o for o in outputs[-2:])
    wrong_key = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    bad_conn = azurite.connection_string.replace(KEY, wrong_key)
    for conn, problem in (
        (azurite.connection_string, "does not exist"),  # a missing container
        (bad_conn, "refused"),  # the account key is wrong
    ):
        monkeypatch.setenv("DBTRIGGER_STORE", conn)
        code, out, err = run(capsys, ["status", "--container", "nosuchcontainer"])
        assert code == 2
        assert problem in err
        outputs.append(out + err)
    monkeypatch.setenv("SECRET_STORE", bad_conn)
    code, out, err = run(capsys, ["status", "--store", "%SECRET_STORE%"])
    assert code == 2
    assert "refused (HTTP 403" in err
    outputs.append(out + err)
    everything = "\n".join(outputs)
    assert "orders" in everything
    for secret in (password, KEY, wrong_key, "Wrong"):
        assert secret not in everything


# --- subprocesses ----------------------------------------------------------------------------


def _module_file(tmp_path: Path, db_url: str, store_expr: str) -> str:
    name = f"cli_proc_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import PollTrigger, SqlAlchemySource, FileCheckpointStore
            source = SqlAlchemySource(url={db_url!r}, table="events", cursor_column="seq",
                                      pk_columns=["id"])
            trigger = PollTrigger(name="orders", source=source,
                                  checkpoint_store={store_expr}, batch_size=10,
                                  max_batches_per_tick=1)
            """
        )
    )
    return name


def _run_cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dbtrigger.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd), **env},
        timeout=120,
        check=False,
    )


def test_subprocess_status_and_reset_on_the_file_store(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    make_events_table(sqlite_db)
    state = tmp_path / "state"
    module = _module_file(tmp_path, sqlite_db.url, f"FileCheckpointStore({str(state)!r})")
    env = {"DBTRIGGER_STORE": str(state), "DBTRIGGER_BACKUP_DIR": str(tmp_path / "bk")}
    sys.path.insert(0, str(tmp_path))
    try:
        trigger = __import__(module).trigger
        trigger.tick(lambda events: None)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)

    result = _run_cli(["status", "orders", "--source", f"{module}:trigger"], tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert "checkpoint   100 id=10" in result.stdout
    assert "lag          40 rows" in result.stdout

    result = _run_cli(["reset", "orders", "--to-beginning", "--reason", "r"], tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert "dry run" in result.stdout
    result = _run_cli(
        ["reset", "orders", "--to-beginning", "--reason", "r", "--yes"], tmp_path, env
    )
    assert result.returncode == 0, result.stderr
    assert FileCheckpointStore(state).read("orders") is not None
    assert docmod.loads(FileCheckpointStore(state).read("orders").data).checkpoint is None  # type: ignore[union-attr]
    assert len(list((tmp_path / "bk").iterdir())) == 1


@pytest.mark.azurite
def test_subprocess_status_on_azurite_via_the_environment(
    sqlite_db: TestDatabase, azurite: Azurite, tmp_path: Path
) -> None:
    gen = _blob_backend(azurite)
    backend_obj = next(gen)
    try:
        make_events_table(sqlite_db)
        trigger = PollTrigger(
            name="orders",
            source=SqlAlchemySource(
                url=sqlite_db.url, table="events", cursor_column="seq", pk_columns=["id"]
            ),
            checkpoint_store=backend_obj.store,
            batch_size=10,
            max_batches_per_tick=1,
        )
        trigger.tick(lambda events: None)
        container = backend_obj.args[backend_obj.args.index("--container") + 1]
        env = {
            "DBTRIGGER_STORE": azurite.connection_string,
            "DBTRIGGER_CONTAINER": container,
            "DBTRIGGER_APP": "shop",
        }
        result = _run_cli(["status", "--json"], tmp_path, env)
        assert result.returncode == 0, result.stderr
        [status] = json.loads(result.stdout)
        assert status["poller"] == "orders"
        assert status["checkpoint"]["cursor"]["value"] == 100
        assert KEY not in result.stdout + result.stderr
    finally:
        gen.close()


# --- the pure operations, table by table ------------------------------------------------------

T0 = dt.datetime(2026, 4, 7, 1, 0, tzinfo=dt.timezone.utc)


def _doc(lease: str | None) -> docmod.StateDocument:
    """A document whose lease is ``None``, ``"live"``, ``"expired"`` or ``"released"``."""
    base = docmod.StateDocument(
        poller_name="orders",
        source_fingerprint="sha256:f",
        checkpoint=docmod.Checkpoint(Position(7, {"id": 7}), "batch_1", T0),
        failure=docmod.FailureRecord(2, T0, T0, "boom", "batch_2"),
    )
    if lease is None:
        return base
    expires = T0 + dt.timedelta(minutes=1 if lease == "live" else -1)
    return dataclasses.replace(
        base,
        lease=docmod.Lease("host/1/a", 41, T0, T0, expires, released=lease == "released"),
    )


@pytest.mark.parametrize(
    ("lease", "force", "refused", "token_after", "owner_after"),
    [
        (None, False, False, None, None),
        ("released", False, False, 41, "host/1/a"),
        ("expired", False, False, 42, "operator:ana@ops"),
        ("live", False, True, None, None),
        ("live", True, False, 42, "operator:ana@ops"),
    ],
)
def test_reset_lease_rules(
    lease: str | None, force: bool, refused: bool, token_after: int | None, owner_after: str | None
) -> None:
    doc = _doc(lease)
    if refused:
        with pytest.raises(LiveLeaseError, match="host/1/a"):
            ops.reset(doc, position=None, now=T0, actor="ana@ops", reason="r", force=force)
        return
    out = ops.reset(doc, position=None, now=T0, actor="ana@ops", reason="r", force=force)
    assert out.checkpoint is None
    assert out.failure is None
    assert (out.lease.fencing_token if out.lease else None) == token_after
    assert (out.lease.owner_id if out.lease else None) == owner_after
    assert out.lease is None or out.lease.released
    entry = out.journal[-1]
    assert entry["before"] == docmod.position_to_json(Position(7, {"id": 7}))
    assert entry["after"] is None
    assert ("fenced" in entry) == (lease in ("expired", "live"))


def test_a_fenced_holder_can_no_longer_commit() -> None:
    fenced = ops.release_lease(_doc("live"), now=T0, actor="a", reason="r", force=True)
    with pytest.raises(LostLeaseError):
        leasemod.decide_commit(
            fenced,
            owner="host/1/a",
            token=41,
            position=Position(9, {"id": 9}),
            batch_id="b",
            row_count=1,
            now=T0,
            ttl=dt.timedelta(minutes=1),
            release=True,
        )
    again = leasemod.decide_acquire(
        fenced,
        poller="orders",
        fingerprint="sha256:f",
        owner="host/2/b",
        now=T0,
        ttl=dt.timedelta(minutes=1),
    )
    assert isinstance(again, leasemod.Acquired)
    assert again.fencing_token == 43


def test_operations_record_who_when_why_and_keep_the_journal_bounded() -> None:
    doc = _doc("released")
    for i in range(ops.JOURNAL_LIMIT + 5):
        doc = ops.reset(
            doc, position=Position(i, {"id": i}), now=T0, actor="ana@ops", reason=f"step {i}"
        )
    assert len(doc.journal) == ops.JOURNAL_LIMIT
    assert doc.journal[-1]["reason"] == f"step {ops.JOURNAL_LIMIT + 4}"
    assert doc.journal[-1]["at"] == "2026-04-07T01:00:00.000000Z"
    with pytest.raises(ConfigurationError, match="reason"):
        ops.reset(doc, position=None, now=T0, actor="a", reason="  ")


def test_clone_create_and_batch_positions() -> None:
    doc = _doc("live")
    clone = ops.clone(doc, new_poller="orders-2", now=T0, actor="a", reason="r")
    assert (clone.poller_name, clone.lease, clone.failure) == ("orders-2", None, None)
    assert clone.position == doc.position
    with pytest.raises(ConfigurationError):
        ops.clone(doc, new_poller="orders", now=T0, actor="a", reason="r")
    with pytest.raises(ConfigurationError):
        ops.clone(doc, new_poller="../x", now=T0, actor="a", reason="r")

    created = ops.create("bf", fingerprint="sha256:f", position=None, now=T0, actor="a", reason="r")
    assert created.checkpoint is None
    assert created.journal[0]["operation"] == "create"

    commit = {
        "type": "commit",
        "batch_id": "batch_9",
        "from": docmod.position_to_json(Position(1, {"id": 1})),
        "to": docmod.position_to_json(Position(5, {"id": 5})),
    }
    with_batch = doc.with_journal_entry(commit)
    assert ops.batch_position(with_batch, "batch_9") == Position(5, {"id": 5})
    assert ops.batch_position(with_batch, "batch_9", redeliver=True) == Position(1, {"id": 1})
    with pytest.raises(ConfigurationError, match="batch_9"):
        ops.batch_position(with_batch, "batch_0")


def test_skip_batch_records_the_loss() -> None:
    out = ops.skip_batch(
        _doc("expired"),
        position=Position(20, {"id": 20}),
        now=T0,
        actor="a",
        reason="poison",
        skipped_rows=3,
        skipped_keys=[{"id": 8}, {"id": 9}, {"id": 20}],
    )
    entry = out.journal[-1]
    assert entry["operation"] == "skip_batch"
    assert (entry["failed_batch_id"], entry["failed_attempts"], entry["last_error"]) == (
        "batch_2",
        2,
        "boom",
    )
    assert entry["skipped_keys"][-1] == {"id": 20}
    assert out.failure is None
    assert out.position == Position(20, {"id": 20})


# --- Azure Table Storage through the CLI -------------------------------------------------------


@pytest.mark.azurite
def test_status_and_reset_on_a_table_store(
    azurite: Azurite,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from azure.data.tables import TableServiceClient  # noqa: PLC0415

    table = f"t{uuid.uuid4().hex[:12]}"
    service = TableServiceClient.from_connection_string(azurite.connection_string)
    service.create_table(table)
    spec = f"azure-table:{azurite.connection_string}"
    store = open_store(spec, app="shop", table=table)
    backend = Backend("table", store, ["--store", spec, "--table", table, "--app", "shop"])
    app = make_app(sqlite_db, backend, tmp_path, monkeypatch)
    try:
        app.tick()
        code, out, _ = run(capsys, app.cli("status", "--json"))
        assert code == 0
        [status] = json.loads(out)
        assert status["checkpoint"]["cursor"]["value"] == 100
        code, out, _ = run(
            capsys, app.cli("reset", "orders", "--to-beginning", "--reason", "r", "--yes")
        )
        assert code == 0, out
        assert app.doc().checkpoint is None
        assert app.doc().journal[-1]["operation"] == "reset"
    finally:
        app.close()
        service.delete_table(table)
        service.close()


def test_a_missing_poller_names_the_pollers_of_a_store_partitioned_ones_once() -> None:
    store = InMemoryCheckpointStore()
    for key in ("parts.members", "parts.p000-064", "parts.p064-128", "solo"):
        store.write(key, b"{}", if_match=None)
    with pytest.raises(ConfigurationError, match=r"; it holds: parts \(partitioned\), solo$"):
        read_state(store, "prats")
