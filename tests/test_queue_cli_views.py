"""A queue named where a poller is expected: ``status``, ``check`` and ``history`` work
or point to ``dbtrigger queue status``; a sidecar feeder runs under ``dbtrigger run``.

Run the way an operator types them, against a module in the current directory.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger.cli import main
from dbtrigger.queue import ddl
from tests.databases import TestDatabase


@pytest.fixture
def app(db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module holding a queue over ``jobs`` and a sidecar feeder over ``items``."""
    db.execute(f"CREATE TABLE {db.qualified('jobs')} (id integer PRIMARY KEY, payload varchar(20))")
    db.execute(f"INSERT INTO {db.qualified('jobs')} VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    with db.engine.begin() as conn:
        table = sa.Table("jobs", sa.MetaData(), schema=db.schema, autoload_with=conn)
        ddl.apply(conn, ddl.install_columns(conn, table))
    db.execute(
        f"CREATE TABLE {db.qualified('items')} (id integer PRIMARY KEY, version integer NOT NULL)"
    )
    db.execute(f"INSERT INTO {db.qualified('items')} VALUES (1, 1), (2, 1), (3, 1)")
    schema = ["--schema", db.schema] if db.schema else []
    assert main(["queue", "install", "--url", db.url, "--table", "items", "--mode", "sidecar",
                 *schema, "--yes"]) == 0  # fmt: skip
    name = f"queueapp_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger
            from dbtrigger.queue import SidecarFeeder

            source = ClaimSource(url={db.url!r}, table="jobs", schema={db.schema!r},
                                 pk_columns=["id"])
            queue = QueueTrigger(name="jobs", source=source)

            @queue.handler
            def handle(events):
                pass

            items = ClaimSource(url={db.url!r}, table="items", schema={db.schema!r},
                                pk_columns=["id"], mode="sidecar", cursor_column="version")
            feeder = SidecarFeeder(name="items-feeder", source=items,
                                   checkpoint_store=FileCheckpointStore({str(tmp_path / "st")!r}))
            items_queue = QueueTrigger(name="items", source=items)

            @items_queue.handler
            def handle_items(events):
                pass
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    module = sys.modules.pop(name, None)
    if module is not None:
        module.source.close()
        module.feeder.close()
        module.items.close()


def test_status_on_a_queue_shows_the_queue(app: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--source", f"{app}:queue"]) == 0
    out = capsys.readouterr().out
    assert "ready    3" in out
    assert "claimable now: 3" in out
    assert main(["status", "--source", f"{app}:source", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["by_status"]["ready"] == 3


def test_history_and_state_commands_on_a_queue_point_to_queue_status(
    app: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["history", "jobs", "--source", f"{app}:queue"],
        ["reset", "jobs", "--to-beginning", "--source", f"{app}:queue", "--reason", "x"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is a claim queue: it keeps no state document" in err
        assert f"dbtrigger queue status --source {app}:queue" in err


def test_check_on_a_queue_checks_the_table(
    db: TestDatabase, app: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", f"{app}:queue"]) == 0
    out = capsys.readouterr().out
    assert "check jobs (" in out
    assert "OK       queue_table" in out
    assert "OK       claim_index" in out
    assert "3 claimable now" in out
    with db.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {db.qualified('jobs')} DROP COLUMN dbt_last_error"))
    sys.modules[app].source.close()
    sys.modules.pop(app)
    assert main(["check", f"{app}:queue", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (finding,) = report["findings"]
    assert (finding["check"], finding["severity"]) == ("queue_table", "error")
    assert "dbtrigger queue install" in finding["message"]


def test_sidecar_feeder_runs_under_run_and_checks_as_poller_and_queue(
    db: TestDatabase, app: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", f"{app}:feeder", "--max-ticks", "2", "--interval", "0"]) == 0
    captured = capsys.readouterr()
    assert "items-feeder: 3 rows" in captured.out
    claims = db.scalar(f"SELECT count(*) FROM {db.qualified('dbtrigger_claims')}")
    assert claims == 3
    assert main(["status", "items-feeder", "--source", f"{app}:feeder"]) == 0
    assert "checkpoint   1 id=3" in capsys.readouterr().out
    assert main(["check", f"{app}:feeder", "--no-store-probe"]) == 0
    out = capsys.readouterr().out
    assert "check items-feeder (" in out  # the feeder, a keyset poller
    assert "OK       queue_table" in out  # and the queue it feeds


def test_feeder_and_worker_run_in_one_process(db: TestDatabase, app: str, tmp_path: Path) -> None:
    """docs/queues.md: `dbtrigger run app:feeder app:queue`, no flag: fed, then claimed.

    A worker process of its own, stopped with SIGTERM once every row is done.
    """
    worker = subprocess.Popen(
        [str(Path(sys.executable).parent / "dbtrigger"), "run", f"{app}:feeder",
         f"{app}:items_queue", "--interval", "0.2"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    claims = db.qualified("dbtrigger_claims")
    try:
        deadline = time.monotonic() + 60
        done = 0
        while done < 3 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.1)
            with contextlib.suppress(sa.exc.DBAPIError):  # the table, before the first claim
                done = int(db.scalar(f"SELECT count(*) FROM {claims} WHERE dbt_status = 'done'"))
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    assert done == 3, err
    assert worker.returncode == 0, err
    assert "items-feeder: 3 rows" in out
    assert "items: 3 rows" in out
