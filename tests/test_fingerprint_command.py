"""The fingerprint error prints a command that can be pasted as it is, and works.

After a source definition changes, the first tick refuses with
``FingerprintMismatchError`` and names ``dbtrigger reset NAME --accept-source
MODULE:ATTR ... --yes``. Each test takes the command out of the message the
operator sees, runs it through the installed console script, and checks that
the poller then runs again. Only a trigger that no importable module holds
(a script run as ``__main__``) gets a fill-in, which says what to put there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command
from tests.test_source_sqlalchemy import insert, naive, orders_table

TRIGGER = """
import os
from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

orders = PollTrigger(
    name="orders",
    source=SqlAlchemySource(url={url!r}, table="orders", cursor_column="updated_at",
                            pk_columns=["id"], where=os.environ.get("ORDERS_WHERE") or None),
    checkpoint_store=FileCheckpointStore({state!r}),
    batch_size=5,
)

@orders.handler
def handle(events):
    pass
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBTRIGGER_", "ORDERS_"))}
    return {**env, **extra}


def run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` run; a leading ``dbtrigger`` is the CLI (tests/doc_cli.py)."""
    if argv[0] == "dbtrigger":
        argv = [dbtrigger_command(), *argv[1:]]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(cwd), **(env or clean_env())},
        timeout=120,
        check=False,
    )


def printed_command(text: str) -> list[str]:
    """The ``dbtrigger reset ...`` between backticks in the error, split as a shell would."""
    # Preceded by "cd DIR && " when the trigger's module imports from the current directory.
    found = re.search(r"`(?:cd \S+ && )?(dbtrigger reset [^`]+)`", text)
    assert found is not None, text
    argv = shlex.split(found.group(1))
    assert argv[0] == "dbtrigger"
    return ["dbtrigger", *argv[1:]]


def test_worker_error_prints_a_command_that_works(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    rows = [{"id": i, "updated_at": naive(i)} for i in range(7)]
    insert(sqlite_db, orders_table(sqlite_db), rows)
    (tmp_path / "fp_app.py").write_text(
        TRIGGER.format(url=sqlite_db.url, state=str(tmp_path / "state"))
    )
    first = run(["dbtrigger", "run", "fp_app:orders", "--max-ticks", "1"], tmp_path)
    assert first.returncode == 0, first.stderr
    changed = clean_env(ORDERS_WHERE="id >= 0")  # a redeployed definition
    refused = run(["dbtrigger", "run", "fp_app:orders", "--max-ticks", "1"], tmp_path, changed)
    assert refused.returncode == 2, refused.stderr
    assert "--accept-source fp_app:orders" in refused.stderr
    assert f"`cd {tmp_path} && dbtrigger reset orders" in refused.stderr  # fp_app is here
    assert "<module>" not in refused.stderr
    pasted = run(printed_command(refused.stderr), tmp_path, changed)
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    assert "applied" in pasted.stdout
    again = run(["dbtrigger", "run", "fp_app:orders", "--max-ticks", "1"], tmp_path, changed)
    assert again.returncode == 0, again.stderr
    assert "orders: committed 2 rows" in again.stderr  # rows 0-4 before, 5 and 6 now


def test_plain_python_names_the_module_it_imported(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """A service that imports its trigger and ticks it: the command names that module."""
    rows = [{"id": i, "updated_at": naive(i)} for i in range(3)]
    insert(sqlite_db, orders_table(sqlite_db), rows)
    (tmp_path / "fp_service.py").write_text(
        TRIGGER.format(url=sqlite_db.url, state=str(tmp_path / "state"))
    )
    tick = [sys.executable, "-c", "import fp_service; fp_service.orders.tick(lambda e: None)"]
    assert run(tick, tmp_path).returncode == 0
    changed = clean_env(ORDERS_WHERE="id >= 0")
    refused = run(tick, tmp_path, changed)
    assert "FingerprintMismatchError" in refused.stderr
    assert "--accept-source fp_service:orders" in refused.stderr
    pasted = run(printed_command(refused.stderr), tmp_path, changed)
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    assert run(tick, tmp_path, changed).returncode == 0


def test_a_script_gets_a_fill_in_that_says_what_goes_there(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    insert(sqlite_db, orders_table(sqlite_db), [{"id": 1, "updated_at": naive(1)}])
    script = TRIGGER.format(url=sqlite_db.url, state=str(tmp_path / "state"))
    (tmp_path / "fp_script.py").write_text(script + "\norders.tick(handle)\n")
    assert run([sys.executable, "fp_script.py"], tmp_path).returncode == 0
    changed = clean_env(ORDERS_WHERE="id >= 0")
    refused = run([sys.executable, "fp_script.py"], tmp_path, changed)
    assert "--accept-source '<module>:<trigger>'" in refused.stderr
    assert "replaced by the module:attribute that imports this PollTrigger" in refused.stderr
    # Filled in with the module that holds the trigger, the command works.
    printed = printed_command(refused.stderr)
    argv = [a.replace("<module>:<trigger>", "fp_script:orders") for a in printed]
    # Importing the script would tick it once more (it refuses again): only its trigger is needed.
    (tmp_path / "fp_script.py").write_text(script)
    pasted = run(argv, tmp_path, changed)
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr


FUNCTION_APP = """
import os

import azure.functions as func
from dbtrigger import DbBindings, FileCheckpointStore, SqlAlchemySource

app = func.FunctionApp()
db = DbBindings()

@app.function_name(name="orders_poll")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(
    arg_name="events",
    source=SqlAlchemySource(url="%ORDERS_DB_URL%", table="orders", cursor_column="updated_at",
                            pk_columns=["id"], where=os.environ["ORDERS_WHERE"]),
    checkpoint_store=FileCheckpointStore({state!r}),
    name="orders",
    batch_size=5,
)
def orders_poll(timer: func.TimerRequest, events) -> None:
    pass
"""


def test_functions_function_error_names_the_function(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    rows = [{"id": i, "updated_at": naive(i)} for i in range(7)]
    insert(sqlite_db, orders_table(sqlite_db), rows)
    (tmp_path / "host.json").write_text('{"version": "2.0"}')
    values = {"ORDERS_DB_URL": sqlite_db.url, "ORDERS_WHERE": "id >= 0"}
    (tmp_path / "local.settings.json").write_text(json.dumps({"Values": values}))
    (tmp_path / "function_app.py").write_text(FUNCTION_APP.format(state=str(tmp_path / "state")))
    first = run(["dbtrigger", "run", "function_app:orders_poll", "--max-ticks", "1"], tmp_path)
    assert first.returncode == 0, first.stderr
    values["ORDERS_WHERE"] = "id >= 1"
    (tmp_path / "local.settings.json").write_text(json.dumps({"Values": values}))
    # As the Functions host runs it: the invocation fails with the command in its message.
    invoke = textwrap.dedent(
        """
        from azure.functions.timer import TimerRequest
        from dbtrigger.settings import load_local_settings
        load_local_settings("local.settings.json")
        import function_app
        (fn,) = function_app.app.get_functions()
        fn.get_user_function()(timer=TimerRequest(past_due=False))
        """
    )
    refused = run([sys.executable, "-c", invoke], tmp_path)
    assert "FingerprintMismatchError" in refused.stderr
    assert "--accept-source function_app:orders_poll" in refused.stderr
    pasted = run(printed_command(refused.stderr), tmp_path)
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    again = run(["dbtrigger", "run", "function_app:orders_poll", "--max-ticks", "1"], tmp_path)
    assert again.returncode == 0, again.stderr
