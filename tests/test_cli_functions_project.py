"""Operating an Azure Functions poller with the CLI, from inside its project directory.

A real ``azure.functions.FunctionApp`` module with ``@db.trigger`` and
``@db.output``, a ``host.json`` and a ``local.settings.json``, driven through
the installed ``dbtrigger`` console script: ``run`` and ``backfill`` call the
function itself (its output binding writes), the state commands find the
store through ``--source function_app:orders_poll``, and the printed undo
command runs as pasted.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger.cli.common import store_from_args
from dbtrigger.cli.main import build_parser
from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command
from tests.test_source_sqlalchemy import insert, naive, orders_table

ROWS = 12


@pytest.fixture
def project(sqlite_db: TestDatabase, tmp_path: Path) -> Path:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(ROWS)])
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE processed (order_id integer NOT NULL)"))
    root = tmp_path / "funcproj"
    root.mkdir()
    (root / "host.json").write_text('{"version": "2.0"}')
    settings = {
        "IsEncrypted": False,
        "Values": {
            "FUNCTIONS_WORKER_RUNTIME": "python",
            "ORDERS_DB_URL": sqlite_db.url,
            "DEST_DB_URL": sqlite_db.url,
            "STATE_DIR": str(root / "state"),
        },
    }
    (root / "local.settings.json").write_text(json.dumps(settings))
    (root / "function_app.py").write_text(
        textwrap.dedent(
            """
            import os
            import azure.functions as func
            from dbtrigger import DbBindings, DbOut, FileCheckpointStore, SqlAlchemySource

            app = func.FunctionApp()
            db = DbBindings()

            @app.function_name(name="orders_poll")
            @app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
            @db.trigger(
                arg_name="events",
                source=SqlAlchemySource(url="%ORDERS_DB_URL%", table="orders",
                                        cursor_column="updated_at", pk_columns=["id"]),
                checkpoint_store=FileCheckpointStore(os.environ["STATE_DIR"]),
                name="orders",
                batch_size=5,
            )
            @db.output("out", url="%DEST_DB_URL%", table="processed")
            def orders_poll(timer: func.TimerRequest, events, out: DbOut) -> None:
                assert not timer.past_due
                out.set([{"order_id": e.pk["id"]} for e in events])
            """
        )
    )
    return root


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBTRIGGER_")}
    return subprocess.run(
        [dbtrigger_command(), *args],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=120,
        check=False,
    )


def processed(db: TestDatabase) -> list[int]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(sa.text("SELECT order_id FROM processed")))


def test_run_drives_the_function_with_its_output_binding(
    project: Path, sqlite_db: TestDatabase
) -> None:
    done = cli(project, "run", "function_app:orders_poll", "--interval", "0", "--max-ticks", "4")
    assert done.returncode == 0, done.stderr
    assert "poller orders (Functions function function_app:orders_poll)" in done.stderr
    assert processed(sqlite_db) == list(range(ROWS))  # written by the function's db.output

    status = cli(project, "status", "orders", "--source", "function_app:orders_poll", "--json")
    assert status.returncode == 0, status.stderr
    body = json.loads(status.stdout)
    assert body["checkpoint"]["display"].endswith("id=11")
    assert body["lag"]["rows"] == 0
    history = cli(project, "history", "orders", "--trigger", "function_app:orders_poll")
    assert history.returncode == 0, history.stderr
    assert history.stdout.count("commit") == 3


def test_backfill_runs_the_function_under_its_own_name(
    project: Path, sqlite_db: TestDatabase
) -> None:
    done = cli(
        project,
        "backfill",
        "orders-rebuild",
        "--trigger",
        "function_app:orders_poll",
        "--from-beginning",
        "--reason",
        "rebuild processed",
        "--yes",
    )
    assert done.returncode == 0, done.stderr
    assert processed(sqlite_db) == list(range(ROWS))
    final = [line for line in (done.stdout + done.stderr).splitlines() if f"{ROWS}/{ROWS}" in line]
    assert len(final) == 1  # the bar's last state, once
    assert done.stdout.count("caught up") == 1


def test_state_commands_take_the_store_from_the_function_and_undo_pastes(
    project: Path, sqlite_db: TestDatabase
) -> None:
    assert cli(project, "run", "function_app:orders_poll", "--max-ticks", "1").returncode == 0
    source = ["--source", "function_app:orders_poll"]
    before = cli(project, "status", "orders", *source, "--json")
    reset = cli(
        project,
        "reset",
        "orders",
        "--to-beginning",
        *source,
        "--reason",
        "replay",
        "--backup-dir",
        str(project / "backups"),
        "--yes",
    )
    assert reset.returncode == 0, reset.stderr
    undo_line = next(line for line in reset.stdout.splitlines() if line.startswith("to undo: "))
    undo = shlex.split(undo_line.removeprefix("to undo: "))
    assert undo[:3] == ["cd", str(project), "&&"]  # function_app imports from the project
    undo = undo[3:]
    assert undo[:3] == ["dbtrigger", "reset", "orders"]
    assert "--source" in undo
    assert "..." not in undo_line
    restored = cli(project, *undo[1:])
    assert restored.returncode == 0, restored.stderr
    after = cli(project, "status", "orders", *source, "--json")
    assert (
        json.loads(after.stdout)["checkpoint"]["cursor"]
        == json.loads(before.stdout)["checkpoint"]["cursor"]
    )


def test_settings_file_is_read_only_inside_a_functions_project(
    project: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "local.settings.json").write_text((project / "local.settings.json").read_text())
    (elsewhere / "function_app.py").write_text((project / "function_app.py").read_text())
    # No host.json: not a Functions project, so %ORDERS_DB_URL% stays unresolved.
    outside = cli(elsewhere, "status", "orders", "--source", "function_app:orders_poll")
    assert outside.returncode == 2
    assert "STATE_DIR" in outside.stderr or "ORDERS_DB_URL" in outside.stderr
    explicit = cli(
        elsewhere,
        "status",
        "--settings",
        str(project / "local.settings.json"),
        "--source",
        "function_app:orders_poll",
    )
    assert "no pollers in" in explicit.stdout, explicit.stderr
    ignored = cli(project, "status", "--no-settings", "--source", "function_app:orders_poll")
    assert ignored.returncode == 2


def test_app_name_comes_from_the_same_setting_as_the_functions_example(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "state.db").touch()  # the CLI opens stores, never creates them
    url = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("DBTRIGGER_APP_NAME", "shop")
    monkeypatch.delenv("DBTRIGGER_APP", raising=False)
    args = build_parser().parse_args(["status", "--store", url])
    assert "namespace=shop" in store_from_args(args).describe()
    monkeypatch.delenv("DBTRIGGER_APP_NAME")
    monkeypatch.setenv("DBTRIGGER_APP", "legacy")  # the old name still works
    assert "namespace=legacy" in store_from_args(args).describe()
