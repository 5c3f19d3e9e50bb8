"""``dbtrigger status`` shows what an operator on call needs: a lease whose holder stopped
renewing, events waiting for a retry (when, owed to whom), how full the window is, and the
visibility guard in force with what it needs - in the text and in ``--json``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import sys
import types
import uuid
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.runtime.subscribers import SubscriberCall
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase


def make_module(
    db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: object
) -> tuple[str, PollTrigger]:
    db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    db.execute("INSERT INTO events VALUES (1, 1), (2, 2), (3, 3)")
    source = SqlAlchemySource(url=db.url, table="events", cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        **options,  # type: ignore[arg-type]
    )
    name = f"status_view_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(name)
    module.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.chdir(tmp_path)
    return f"{name}:trigger", trigger


def status(capsys: pytest.CaptureFixture[str], spec: str, *extra: str) -> str:
    capsys.readouterr()
    assert main(["status", "orders", "--source", spec, *extra]) == 0
    return capsys.readouterr().out


def test_a_holder_that_stopped_renewing_is_not_shown_as_live(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec, trigger = make_module(sqlite_db, tmp_path, monkeypatch, lease_ttl_seconds=300)
    trigger.tick(lambda events: None)
    store = FileCheckpointStore(tmp_path / "state")
    stored = store.read("orders")
    assert stored is not None
    doc = docmod.loads(stored.data)
    now = dt.datetime.now(dt.timezone.utc)
    assert doc.lease is not None

    def held(renewed_ago: float) -> None:
        """The lease as a holder left it that renewed ``renewed_ago`` seconds ago."""
        lease = dataclasses.replace(
            doc.lease,  # type: ignore[arg-type]
            owner_id="web-2/311/9f1c2d3e",
            released=False,
            heartbeat_at=now - dt.timedelta(seconds=renewed_ago),
            expires_at=now - dt.timedelta(seconds=renewed_ago) + dt.timedelta(seconds=300),
        )
        current = store.read("orders")
        assert current is not None
        store.write(
            "orders", docmod.dumps(dataclasses.replace(doc, lease=lease)), if_match=current.etag
        )

    held(20)  # renewed recently: alive
    out = status(capsys, spec)
    assert "lease        live, held by web-2/311/9f1c2d3e (token" in out
    assert re.search(r"renewed 2\ds ago", out)  # 20 s, and the command's own time
    held(200)  # killed 200 s ago: the TTL has 100 s left, but nobody renews it
    out = status(capsys, spec)
    # As a person reads it (minutes and seconds), not "200s" or "200.153s".
    assert re.search(r"lease        NOT RENEWED for [34]m( \d+s)?, held by web-2/311/9f1c2d3e", out)
    assert "another instance takes it over after" in out
    lease = json.loads(status(capsys, spec, "--json"))["lease"]
    assert lease["state"] == "not_renewed"
    assert 199 <= lease["renewed_seconds_ago"] <= 260
    capsys.readouterr()
    assert main(["status", "--source", spec]) == 0
    assert re.search(r"NOT RENEWED [34]m( \d+s)? t", capsys.readouterr().out)  # the list view too


def test_waiting_retries_window_use_and_the_guard_in_force(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def billing(events, ctx):  # type: ignore[no-untyped-def]
        for e in events:
            if e.pk["id"] == 2:
                ctx.retry(e, "429 from billing")

    spec, trigger = make_module(
        sqlite_db,
        tmp_path,
        monkeypatch,
        subscribers={"billing": billing, "search": lambda events: None},
        retry_delay_seconds=600,
        retry_delay_max_seconds=600,
    )
    assert trigger.tick(SubscriberCall()) >= 1
    out = status(capsys, spec)
    assert "% used)" in out
    (line,) = [x for x in out.splitlines() if x.startswith("retries")]
    assert "1 event(s) waiting for a retry; the next is due at " in line
    assert re.search(r"\(in \d+m( \d+s)?\)", line)  # backoff with jitter: 300 to 600 s
    assert line.endswith("; owed to billing 1")
    (guard,) = [x for x in out.splitlines() if x.startswith("visibility")]
    assert guard.startswith("visibility   none (none): ")  # SQLite: one writer at a time
    report = json.loads(status(capsys, spec, "--json"))
    assert report["window"]["retries"]["waiting"] == 1
    assert report["window"]["retries"]["owed"] == {"billing": 1}
    assert 0 < report["window"]["use"] < 1
    assert report["visibility"]["mode"] == "none"


def test_a_holder_renewing_a_batch_held_past_its_ttl_is_said_so(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A handler hung at default settings: its heartbeat renews the lease, so status
    said "live, ... renewed 27s ago" for as long as it hung, and every other worker
    waits. A lease held past its TTL with no commit under it is said so."""
    spec, trigger = make_module(sqlite_db, tmp_path, monkeypatch, batch_size=1)
    trigger.tick(lambda events: None)
    store = FileCheckpointStore(tmp_path / "state")
    stored = store.read("orders")
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.lease is not None
    assert doc.checkpoint is not None
    now = dt.datetime.now(dt.timezone.utc)

    def held(for_seconds: float) -> dict[str, object]:
        """The lease as a holder whose batch began ``for_seconds`` ago renews it."""
        lease = dataclasses.replace(
            doc.lease,  # type: ignore[arg-type]
            owner_id="web-2/311/9f1c2d3e",
            released=False,
            acquired_at=now - dt.timedelta(seconds=for_seconds),
            heartbeat_at=now - dt.timedelta(seconds=10),
            expires_at=now + dt.timedelta(seconds=110),
        )
        checkpoint = dataclasses.replace(
            doc.checkpoint,  # type: ignore[arg-type]
            updated_at=now - dt.timedelta(seconds=for_seconds + 1),
        )
        current = store.read("orders")
        assert current is not None
        store.write(
            "orders",
            docmod.dumps(dataclasses.replace(doc, lease=lease, checkpoint=checkpoint)),
            if_match=current.etag,
        )
        return json.loads(status(capsys, spec, "--json"))["lease"]  # type: ignore[no-any-return]

    def listed() -> str:
        """The poller's row of the list view (every poller of the store)."""
        capsys.readouterr()
        assert main(["status", "--store", str(tmp_path / "state")]) == 0
        return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("orders"))

    assert held(60)["held_without_commit_seconds"] is None  # within its TTL: a batch
    assert "nothing committed" not in status(capsys, spec)
    assert re.search(r" live t\d+ ", listed())
    lease = held(300)
    assert lease["state"] == "live"
    assert 299 <= lease["held_without_commit_seconds"] <= 360  # type: ignore[operator]
    out = status(capsys, spec)
    assert re.search(r"renewed \d+s ago; nothing committed under it for 5m( \d+s)?: one batch", out)
    assert "handler_slow" in out
    # The list view said "live t2" of it, as of a holder committing batch after batch.
    assert re.search(r" live, HUNG 5m( \d+s)? t\d+ ", listed())
