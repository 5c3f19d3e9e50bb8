"""What a person reads at default settings: the right noun for what runs, durations
as a person says them (``3h 25m``, not ``12345.678s``), no "about 0 behind".
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import sys
import types
import uuid
from pathlib import Path

import pytest

from dbtrigger import ClaimSource, FileCheckpointStore, PollTrigger, QueueTrigger, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.durations import human_duration
from dbtrigger.runtime.progress import DrainProgress
from tests.databases import TestDatabase


def module_with(monkeypatch: pytest.MonkeyPatch, **attrs: object) -> str:
    """An importable module holding ``attrs``; its name."""
    name = f"wording_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return name


def test_human_durations() -> None:
    assert human_duration(0.24) == "0.2s"
    assert human_duration(45.7) == "45s"
    assert human_duration(200) == "3m 20s"
    assert human_duration(3202.7) == "53m 22s"
    assert human_duration(12345.678) == "3h 25m"
    assert human_duration(7200) == "2h"
    assert human_duration(200000) == "2d 7h"
    assert human_duration(-3) == "0.0s"


def test_progress_lines_say_time_as_a_person_does_and_never_about_0_behind() -> None:
    long = DrainProgress("orders", delivered=3000, behind=1500, elapsed_seconds=12345.678)
    assert long.describe().startswith("catching up: 3,000 rows in 3h 25m (0.24 rows/s), ")
    done = DrainProgress("orders", 3000, 0, 12345.678, caught_up=True)
    assert done.describe() == "caught up: 3,000 rows in 3h 25m (0.24 rows/s)"
    # The rows counted at the start are delivered, yet rows keep coming: not "about 0 behind".
    used_up = DrainProgress("orders", delivered=5000, behind=0, elapsed_seconds=30.0)
    text = used_up.describe()
    assert "about 0" not in text
    assert text == (
        "catching up: 5,000 rows in 30s (167 rows/s), "
        "the rows counted behind are delivered and more keep arriving"
    )


def test_the_start_line_calls_a_queue_a_queue(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    sqlite_db.execute("CREATE TABLE emails (id INTEGER PRIMARY KEY, recipient TEXT)")
    assert main(["queue", "install", "--url", sqlite_db.url, "--table", "emails", "--yes"]) == 0
    orders = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    orders.handler(lambda events: None)
    emails = QueueTrigger(
        name="emails", source=ClaimSource(url=sqlite_db.url, table="emails", pk_columns=["id"])
    )
    emails.handler(lambda events: None)
    module = module_with(monkeypatch, orders=orders, emails=emails)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="dbtrigger.runner"):
        code = main(["run", f"{module}:emails", "--max-ticks", "1", "--interval", "0"])
        assert code == 0
        code = main(
            ["run", f"{module}:orders", f"{module}:emails", "--max-ticks", "1", "--interval", "0"]
        )
        assert code == 0
    starts = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "worker_start"]
    first = [line for line in starts if "worker, pid" in line]
    assert re.search(r"worker, pid \d+: 1 queue \(emails\); Ctrl-C", first[0]), first[0]
    assert "1 poller (orders), 1 queue (emails); Ctrl-C" in first[1]
    said = [r.getMessage() for r in caplog.records]
    # Not "idle: 0 rows done, 0 retried, 0 dead-lettered" for a queue with nothing to claim.
    assert any(line.startswith("emails: idle: nothing claimable (") for line in said), said
    assert "orders: stopped after 1 tick, 0 rows (0 failed ticks)" in said  # not "1 ticks"


def test_status_says_how_old_the_oldest_pending_row_is_in_hours(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at DATETIME NOT NULL)")
    old = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) - dt.timedelta(hours=3, minutes=25)
    sqlite_db.execute(
        "INSERT INTO orders VALUES (1, :t), (2, :t)", {"t": old.strftime("%Y-%m-%d %H:%M:%S.%f")}
    )
    trigger = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=1,
    )
    trigger.tick(lambda events: None)
    module = module_with(monkeypatch, trigger=trigger)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["status", "orders", "--source", f"{module}:trigger"]) == 0
    lag = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lag "))
    assert re.fullmatch(r"lag\s+1 rows, oldest pending 3h 2[56]m", lag), lag


def test_commands_to_paste_name_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative ``./state`` or ``sqlite:///jobs.db`` in a printed command names another
    directory's store or database once pasted elsewhere: they are printed absolute."""
    monkeypatch.chdir(tmp_path)
    assert FileCheckpointStore("state").describe() == f"file:{tmp_path / 'state'}"
    import sqlite3  # noqa: PLC0415

    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO jobs VALUES (1)")
    source = ClaimSource(url="sqlite:///jobs.db", table="jobs", pk_columns=["id"])
    with pytest.raises(Exception, match="dbtrigger queue install") as refused:
        source.counts()
    assert f"--url 'sqlite:///{tmp_path / 'jobs.db'}' --table jobs" in str(refused.value)

    (tmp_path / "wording_app.py").write_text(
        "from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource\n"
        "orders = PollTrigger(name='orders', checkpoint_store=FileCheckpointStore('state'),\n"
        "    source=SqlAlchemySource(url='sqlite:///jobs.db', table='jobs',\n"
        "                            cursor_column='id', pk_columns=['id']))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wording_app", raising=False)
    import wording_app  # type: ignore[import-not-found]  # noqa: PLC0415

    wording_app.orders.tick(lambda events: None)
    undo = []
    for where in (["--store", "./state"], ["--source", "wording_app:orders"]):
        capsys.readouterr()
        argv = ["reset", "orders", "--to-beginning", *where, "--reason", "r", "--yes"]
        assert main([*argv, "--backup-dir", "bk"]) == 0
        out = capsys.readouterr().out
        assert f"previous document saved to {tmp_path / 'bk'}/orders." in out
        undo.append(next(line for line in out.splitlines() if line.startswith("to undo: ")))
    assert f" --store {tmp_path / 'state'} " in undo[0]
    # The module imports from here: the command goes here first.
    assert undo[1].startswith(f"to undo: cd {tmp_path} && dbtrigger reset orders --from-file ")


def test_queue_status_says_the_oldest_ready_age_in_hours(
    sqlite_db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    sqlite_db.execute("CREATE TABLE emails (id INTEGER PRIMARY KEY, recipient TEXT)")
    args = ["--url", sqlite_db.url, "--table", "emails"]
    assert main(["queue", "install", *args, "--yes"]) == 0
    source = ClaimSource(url=sqlite_db.url, table="emails", pk_columns=["id"])
    source.enqueue([{"id": 1, "recipient": "ana@example.com"}])
    sqlite_db.execute(
        "UPDATE emails SET dbt_visible_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '-5 hours')"
    )
    capsys.readouterr()
    assert main(["queue", "status", *args]) == 0
    out = capsys.readouterr().out
    shown = re.search(r"oldest ready for (.*)\n", out)
    assert shown is not None, out
    assert re.fullmatch(r"[45]h( \d+m)?", shown.group(1)), out  # not "18000.0s"
