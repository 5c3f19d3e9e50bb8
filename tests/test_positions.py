"""Start positions, rewinds and bookmarks, on SQLite, PostgreSQL and MariaDB, the
commands through the real CLI.

``start_from="now"`` on a large table delivers only the rows written after it
(DBTRIGGER_START_ROWS rows, 20,000 by default: 40 batches of 500 if it read
the table, about 1 s of CPU a database, mostly the inserts; 100,000 and more
for a longer run);
``rewind --to-time`` delivers again exactly the batches committed after the
time; what the history or the source cannot vouch for is refused.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install, prune
from dbtrigger.cli import main
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.history import FileHistory, Retention, history_for
from dbtrigger.state.document import format_time
from tests.databases import TestDatabase

START_ROWS = int(os.environ.get("DBTRIGGER_START_ROWS", "20000"))
T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.timezone.utc)


def events_table(db: TestDatabase, rows: int) -> sa.Table:
    table = sa.Table(
        "events",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False, index=True),
        sa.Column("at", sa.DateTime(timezone=True)),
        schema=db.schema,
    )
    table.create(db.engine)
    sa.Index("events_seq_id", table.c.seq, table.c.id).create(db.engine)
    add(db, table, 1, rows)
    return table


def add(db: TestDatabase, table: sa.Table, first: int, last: int) -> None:
    chunk = 5000
    with db.engine.begin() as conn:
        for start in range(first, last + 1, chunk):
            conn.execute(
                table.insert(),
                [
                    {"id": i, "seq": i, "at": T0 + dt.timedelta(seconds=i)}
                    for i in range(start, min(last, start + chunk - 1) + 1)
                ],
            )


def source(db: TestDatabase, cursor: str = "seq") -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url,
        table="events",
        schema=db.schema,
        cursor_column=cursor,
        pk_columns=["id"],
        visibility="none",
    )


def test_start_from_now_on_a_large_table_delivers_only_new_rows(
    db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = events_table(db, START_ROWS)
    store = FileCheckpointStore(tmp_path / "state")
    src = source(db)
    trigger = PollTrigger(
        name="events", source=src, checkpoint_store=store, batch_size=500, start_from="now"
    )
    seen: list[int] = []
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        assert trigger.tick(lambda events: seen.extend(int(e.pk["id"]) for e in events)) == 0
    add(db, table, START_ROWS + 1, START_ROWS + 3)
    trigger.drain(lambda events: seen.extend(int(e.pk["id"]) for e in events))
    assert seen == [START_ROWS + 1, START_ROWS + 2, START_ROWS + 3]
    doc = trigger.read_state()
    assert doc is not None
    assert doc.extra["start_from"]["spec"] == "now"
    assert doc.extra["start_from"]["position"]["value"] == START_ROWS
    started = [r for r in caplog.records if getattr(r, "event", "") == "start_position"]
    assert len(started) == 1
    history = history_for(store)
    assert history is not None
    assert next(r.get("operation") or r["type"] for r in history.read("events")) == "start"

    # Once there is a checkpoint, another start_from is ignored, and said so.
    again = PollTrigger(name="events", source=src, checkpoint_store=store, start_from="beginning")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        assert again.tick(lambda events: seen.extend(int(e.pk["id"]) for e in events)) == 0
    [ignored] = [r for r in caplog.records if getattr(r, "event", "") == "start_from_ignored"]
    assert "start_from=beginning is ignored: the poller has a checkpoint" in ignored.getMessage()
    src.close()


def test_start_from_never_undoes_a_reset_to_the_beginning(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A poller configured later with start_from="now" and reset to the beginning by
    an operator: its document has no checkpoint, and the next process must still
    deliver every row (the reset), not jump to now (it did: the rows were skipped)."""
    events_table(sqlite_db, 10)
    store = FileCheckpointStore(tmp_path / "state")
    PollTrigger(name="events", source=source(sqlite_db), checkpoint_store=store).drain(
        lambda events: None
    )
    assert (
        main(
            [
                "reset",
                "events",
                "--to-beginning",
                "--store",
                str(tmp_path / "state"),
                "--backup-dir",
                str(tmp_path / "bk"),
                "--reason",
                "replay all",
                "--yes",
            ]
        )
        == 0
    )
    restarted = PollTrigger(
        name="events", source=source(sqlite_db), checkpoint_store=store, start_from="now"
    )
    seen: list[int] = []
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        restarted.drain(lambda events: seen.extend(int(e.pk["id"]) for e in events))
    assert seen == list(range(1, 11))
    [ignored] = [r for r in caplog.records if getattr(r, "event", "") == "start_from_ignored"]
    assert "put there by reset" in ignored.getMessage()


def test_start_from_a_time_or_a_cursor(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    events_table(sqlite_db, 50)
    store = FileCheckpointStore(tmp_path / "state")
    by_time = PollTrigger(
        name="by-time",
        source=source(sqlite_db, "at"),
        checkpoint_store=store,
        start_from=T0 + dt.timedelta(seconds=41),
    )
    seen: list[int] = []
    by_time.drain(lambda events: seen.extend(int(e.pk["id"]) for e in events))
    assert seen == list(range(41, 51))
    by_cursor = PollTrigger(
        name="by-cursor", source=source(sqlite_db), checkpoint_store=store, start_from=48
    )
    seen.clear()
    by_cursor.drain(lambda events: seen.extend(int(e.pk["id"]) for e in events))
    assert seen == [48, 49, 50]
    exact = PollTrigger(
        name="exact",
        source=source(sqlite_db),
        checkpoint_store=store,
        start_from=Position(cursor=45, pk={"id": 45}),
    )
    seen.clear()
    exact.drain(lambda events: seen.extend(int(e.pk["id"]) for e in events))
    assert seen == [46, 47, 48, 49, 50]
    with pytest.raises(ConfigurationError, match="start_from is empty"):
        PollTrigger(name="x", source=source(sqlite_db), checkpoint_store=store, start_from="  ")


def test_start_from_now_on_the_change_log(db: TestDatabase, tmp_path: Path) -> None:
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, status VARCHAR(10))"
    )
    install(db.engine, "orders", schema=db.schema)
    for i in range(1, 6):
        db.execute(f"INSERT INTO {db.qualified('orders')} VALUES ({i}, 'old')")
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema, visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        start_from="now",
    )
    seen: list[tuple[str, int]] = []
    trigger.drain(lambda events: seen.extend((e.op, int(e.pk["id"])) for e in events))
    db.execute(f"UPDATE {db.qualified('orders')} SET status = 'new' WHERE id = 2")
    db.execute(f"DELETE FROM {db.qualified('orders')} WHERE id = 3")
    trigger.drain(lambda events: seen.extend((e.op, int(e.pk["id"])) for e in events))
    assert seen == [("update", 2), ("delete", 3)]


# --- rewind and bookmarks ------------------------------------------------------------------


@dataclass
class App:
    trigger: PollTrigger
    spec: str
    seen: list[list[int]] = field(default_factory=list)
    clock: list[dt.datetime] = field(default_factory=list)

    def handler(self, events: list[RowChange]) -> None:
        self.seen.append([int(e.pk["id"]) for e in events])
        self.clock[0] += dt.timedelta(minutes=1)  # one minute per batch

    def cli(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([*argv, "--trigger", self.spec])
        out, err = capsys.readouterr()
        return code, out, err


@pytest.fixture
def app(db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    events_table(db, 50)
    now = [T0]
    src = source(db)
    trigger = PollTrigger(
        name="events",
        source=src,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        clock=lambda: now[0],
        history=FileHistory(tmp_path / "state", segment_bytes=1024),  # segments to prune
    )
    module = f"positions_app_{uuid.uuid4().hex[:8]}"
    spec = f"{module}:trigger"
    app = App(trigger, spec, clock=now)
    trigger.handler(app.handler)
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DBTRIGGER_BACKUP_DIR", str(tmp_path / "bk"))
    trigger.drain(app.handler)
    assert [len(b) for b in app.seen] == [10] * 5
    yield app
    src.close()


def test_rewind_to_time_delivers_again_exactly_the_batches_committed_after_it(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    history = history_for(app.trigger.store)
    assert history is not None
    commits = [r for r in history.read("events") if r["type"] == "commit"]
    between = (
        dt.datetime.fromisoformat(commits[1]["committed_at"][:-1]) + dt.timedelta(seconds=30)
    ).replace(tzinfo=dt.timezone.utc)
    code, out, _ = app.cli(
        capsys, "rewind", "events", "--to-time", format_time(between), "--reason", "bad deploy"
    )
    assert code == 0, out
    assert "3 recorded batch(es) (30 rows) are delivered again" in out
    assert "dry run" in out
    code, out, _ = app.cli(
        capsys,
        "rewind",
        "events",
        "--to-time",
        format_time(between),
        "--reason",
        "bad deploy",
        "--yes",
    )
    assert code == 0, out
    app.seen.clear()
    app.trigger.drain(app.handler)
    assert app.seen == [list(range(21, 31)), list(range(31, 41)), list(range(41, 51))]
    last = list(history.read("events"))[-1]
    assert last["type"] == "commit"
    rewound = [r for r in history.read("events") if r.get("operation") == "rewind"]
    assert rewound[0]["reason"] == "bad deploy"

    # --to-batch: where that batch began.
    code, out, _ = app.cli(
        capsys, "rewind", "events", "--to-batch", commits[3]["batch_id"], "--reason", "r", "--yes"
    )
    assert code == 0, out
    app.seen.clear()
    app.trigger.drain(app.handler)
    assert app.seen == [list(range(31, 41)), list(range(41, 51))]


def test_rewind_refuses_what_the_history_cannot_vouch_for(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    history = app.trigger.history
    assert history is not None
    code, _, err = app.cli(
        capsys, "rewind", "events", "--to-time", "2999-01-01T00:00:00Z", "--reason", "r"
    )
    assert code == 2
    assert "nothing was committed after" in err
    # Retention pruned the oldest records: a time before what is kept is refused.
    history.prune("events", Retention(max_age_days=None, max_bytes=1024), T0 + dt.timedelta(days=1))
    code, _, err = app.cli(
        capsys, "rewind", "events", "--to-time", "2000-01-01T00:00:00Z", "--reason", "r"
    )
    assert code == 2
    assert "older records were pruned" in err


def test_rewind_refuses_a_change_log_pruned_past_it(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status VARCHAR(10))")
    install(sqlite_db.engine, "orders")
    for i in range(1, 9):
        sqlite_db.execute(f"INSERT INTO orders VALUES ({i}, 'new')")
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=sqlite_db.url, table="orders"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=4,
    )
    trigger.drain(lambda events: None)
    module = f"positions_log_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    history = history_for(trigger.store)
    assert history is not None
    first = next(r for r in history.read("orders-log") if r["type"] == "commit")["batch_id"]
    argv = [
        "rewind",
        "orders-log",
        "--to-batch",
        first,
        "--reason",
        "r",
        "--trigger",
        f"{module}:trigger",
    ]
    assert main(argv) == 0
    assert "the log still holds" in capsys.readouterr().out
    prune(sqlite_db.engine, "orders", up_to_seq=8)
    assert main(argv) == 2
    assert "the source cannot serve this rewind" in capsys.readouterr().err


def test_bookmarks(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = app.cli(
        capsys, "bookmark", "create", "events", "before-v2", "--reason", "deploying v2"
    )
    assert code == 0
    assert "at 50 id=50" in out
    code, _, err = app.cli(capsys, "bookmark", "create", "events", "before-v2", "--reason", "again")
    assert code == 2
    assert "exists already" in err
    code, out, _ = app.cli(capsys, "bookmark", "list", "events", "--json")
    assert json.loads(out)["before-v2"]["position"]["value"] == 50
    code, out, _ = app.cli(capsys, "reset", "events", "--to-beginning", "--reason", "oops", "--yes")
    assert code == 0
    code, out, _ = app.cli(capsys, "bookmark", "restore", "events", "before-v2", "--reason", "undo")
    assert "dry run" in out
    assert app.trigger.read_state().checkpoint is None  # type: ignore[union-attr]
    code, out, _ = app.cli(
        capsys, "bookmark", "restore", "events", "before-v2", "--reason", "undo", "--yes"
    )
    assert code == 0, out
    assert app.trigger.read_state().position == Position(cursor=50, pk={"id": 50})  # type: ignore[union-attr]
    code, _, err = app.cli(capsys, "bookmark", "restore", "events", "nope", "--reason", "r")
    assert code == 2
    assert "no bookmark 'nope'" in err
    code, out, _ = app.cli(capsys, "bookmark", "delete", "events", "before-v2", "--reason", "done")
    assert code == 0
    history = history_for(app.trigger.store)
    assert history is not None
    ops = [r.get("operation") for r in history.read("events") if r["type"] == "manual"]
    assert ops == ["bookmark", "reset", "bookmark_restore", "bookmark_delete"]


def _unused(*_: Any) -> None:
    pass


def test_rewind_refuses_to_cross_a_gap_in_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The history store was down for longer than the journal reaches back: a gap
    record marks the batches it never recorded. A rewind to before the gap could
    not name them all, and is refused with that reason; one after it is not."""
    from dbtrigger.testing import MemorySource  # noqa: PLC0415
    from tests.test_history_runtime import FlakyHistory  # noqa: PLC0415

    now = [T0]
    history = FlakyHistory(FileHistory(tmp_path / "state"))
    trigger = PollTrigger(
        name="events",
        source=MemorySource(
            [{"id": i, "seq": i} for i in range(1, 101)], cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=5,
        journal_limit=3,
        history=history,
        clock=lambda: now[0],
    )

    def tick() -> None:
        trigger.tick(lambda events: None)
        now[0] += dt.timedelta(minutes=1)

    tick()  # 12:00, recorded
    history.down = True
    for _ in range(6):  # 12:01-12:06: committed, the history unreachable
        tick()
    history.down = False
    tick()  # 12:07: recorded, after a gap record
    tick()  # 12:08
    assert [r["type"] for r in history.read("events")] == [
        "commit",
        "gap",
        "commit",
        "commit",
        "commit",
        "commit",
    ]
    module = f"positions_gap_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    argv = ["rewind", "events", "--reason", "r", "--trigger", f"{module}:trigger"]
    capsys.readouterr()
    assert main([*argv, "--to-time", format_time(T0 + dt.timedelta(seconds=30))]) == 2
    assert "the history has a gap after that point" in capsys.readouterr().err
    assert main([*argv, "--to-time", format_time(T0 + dt.timedelta(minutes=7, seconds=30))]) == 0
    assert "1 recorded batch(es) (5 rows) are delivered again" in capsys.readouterr().out
