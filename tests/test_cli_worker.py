"""`dbtrigger run` as an operator sees it, through the installed console script.

Every test starts the real ``dbtrigger`` executable of this environment in a
subprocess against a real database, and reads what it prints: the banner, one
line per tick outcome, tracebacks, exit codes, JSON log lines.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dbtrigger import FileCheckpointStore
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table

DBTRIGGER = str(Path(sys.executable).with_name("dbtrigger"))


def write_module(
    directory: Path,
    name: str,
    url: str,
    *,
    pollers: dict[str, str],
    schema: str | None = None,
    options: str = "",
) -> None:
    """A module with one trigger per entry of ``pollers`` (attribute -> handler body).

    ``POLLER`` in a body is replaced by the attribute name.
    """
    parts = [
        "from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource",
        f"STATE = {str(directory / 'state')!r}",
    ]
    for attr, body in pollers.items():
        parts.append(
            textwrap.dedent(
                f"""
                {attr} = PollTrigger(
                    name={attr!r},
                    source=SqlAlchemySource(url={url!r}, table="orders", schema={schema!r},
                                            cursor_column="updated_at", pk_columns=["id"]),
                    checkpoint_store=FileCheckpointStore(STATE),
                    batch_size=5,
                    max_batches_per_tick=1,
                    {options}
                )

                @{attr}.handler
                def handle_{attr}(events):
                    {body.replace("POLLER", attr)}
                """
            )
        )
    (directory / f"{name}.py").write_text("\n".join(parts))


def run_cli(
    args: list[str], cwd: Path, *, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DBTRIGGER, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd), **(env or {})},
        timeout=timeout,
        check=False,
    )


def run_until(
    args: list[str], cwd: Path, done: Callable[[list[str]], bool], *, timeout: float = 60
) -> tuple[int, str, str]:
    """Run the console script until ``done(stderr lines so far)`` holds, then SIGTERM it.

    The outcome is waited for (up to ``timeout`` seconds), never a fixed time, so a
    loaded machine cannot make the test see too little. Returns (exit code, stdout,
    stderr).
    """
    proc = subprocess.Popen(
        [DBTRIGGER, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    changed = threading.Condition()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with changed:
                lines.append(line.rstrip("\n"))
                changed.notify_all()
        with changed:
            changed.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with changed:
        changed.wait_for(
            lambda: done(lines) or proc.poll() is not None or not reader.is_alive(), timeout
        )
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(30)
    assert proc.stdout is not None
    out = proc.stdout.read()  # a few summary lines: no pipe can fill up meanwhile
    proc.stdout.close()
    assert proc.stderr is not None
    proc.stderr.close()
    err = "\n".join(lines)
    assert done(lines), f"timed out or exited after {timeout:.0f}s; stderr so far:\n{err}"
    return proc.returncode, out, err


def tick_lines(stderr: str) -> list[dict[str, object]]:
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [r for r in records if r.get("event") == "tick"]


def test_idle_worker_prints_a_banner_and_one_line_per_tick(
    pg: TestDatabase, tmp_path: Path
) -> None:
    orders_table(pg)
    url = pg.url.replace("postgres@", "postgres:Sup3rSecretPw@")  # trust auth ignores it
    assert "Sup3rSecretPw" in url
    write_module(tmp_path, "idle_app", url, pollers={"orders": "pass"}, schema=pg.schema)
    done = run_cli(["run", "idle_app:orders", "--interval", "0.1", "--max-ticks", "3"], tmp_path)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "Sup3rSecretPw" not in err + done.stdout
    assert "poller orders (trigger idle_app:orders)" in err
    assert "source      postgresql:" in err
    assert "at postgresql+psycopg://postgres:***@127.0.0.1" in err
    assert "cursor updated_at, key (id)" in err
    assert "store       file:" in err
    assert "batches     5 rows, up to 1 per tick; lease 120s" in err
    assert "visibility  auto: chosen" in err
    idle = [
        line for line in err.splitlines() if "orders: idle: nothing after the checkpoint" in line
    ]
    assert len(idle) == 1  # said when it becomes idle; the repeats are DEBUG
    assert "orders: 0 rows in 3 ticks" in done.stdout


def test_json_log_lines_carry_the_tick_outcome(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(7)])
    write_module(tmp_path, "json_app", sqlite_db.url, pollers={"orders": "pass"})
    done = run_cli(
        ["run", "json_app:orders", "--interval", "0", "--max-ticks", "3", "--log-format", "json"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    banner = [r for r in records if r.get("event") == "worker_start" and "source" in r]
    assert banner[0]["poller"] == "orders"
    assert banner[0]["source"]["cursor_column"] == "updated_at"
    ticks = tick_lines(done.stderr)
    assert [(t["outcome"], t["rows"]) for t in ticks] == [
        ("committed", 5),
        ("committed", 2),
        ("idle", 0),
    ]
    assert "more pending" in str(ticks[0]["message"])


def test_lease_held_by_another_owner_is_one_info_line_per_tick(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": 1, "updated_at": naive(1)}])
    write_module(tmp_path, "busy_app", sqlite_db.url, pollers={"orders": "pass"})
    # Another owner takes the lease the way a tick would.
    sys.path.insert(0, str(tmp_path))
    try:
        import busy_app  # noqa: PLC0415 - the module written above
    finally:
        sys.path.remove(str(tmp_path))
    now = dt.datetime.now(dt.timezone.utc)
    decision = leasemod.decide_acquire(
        None,
        poller="orders",
        fingerprint=busy_app.orders.fingerprint,
        owner="other-host/4242/abcd",
        now=now,
        ttl=dt.timedelta(minutes=10),
    )
    FileCheckpointStore(tmp_path / "state").write(
        "orders", docmod.dumps(decision.document), if_match=None
    )
    done = run_cli(["run", "busy_app:orders", "--interval", "0", "--max-ticks", "2"], tmp_path)
    assert done.returncode == 0, done.stderr
    busy = [line for line in done.stderr.splitlines() if "lease held by" in line]
    assert len(busy) == 1  # said when it starts; the repeats are DEBUG
    assert " INFO " in busy[0]
    until = decision.document.lease.expires_at  # type: ignore[union-attr]
    assert f"lease held by other-host/4242/abcd until {until:%Y-%m-%dT%H:%M:%SZ}" in busy[0]


def test_failing_handler_logs_its_traceback_once_and_backs_off(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(3)])
    write_module(
        tmp_path,
        "failing_app",
        sqlite_db.url,
        pollers={"orders": "raise RuntimeError('sink refused order ' + str(events[0].pk['id']))"},
    )
    # Stopped once five failed ticks are logged (bounded), not after a fixed time:
    # on a loaded machine a fixed sleep saw too few.
    code, out, err = run_until(
        ["run", "failing_app:orders", "--interval", "0.1", "--max-backoff", "0.4"],
        tmp_path,
        lambda lines: sum("tick failed (HandlerError" in line for line in lines) >= 5,
    )
    assert code == 0, err
    failed = [line for line in err.splitlines() if "tick failed (HandlerError" in line]
    assert len(failed) >= 4
    assert err.count("Traceback (most recent call last)") == 1
    assert "RuntimeError: sink refused order 0" in err
    waits = [float(line.split("next try in ")[1].split("s")[0]) for line in failed]
    assert waits[:3] == [0.1, 0.2, 0.4]
    assert max(waits) == 0.4  # capped
    assert "failed ticks" in out


def test_poison_line_prints_commands_that_work_and_the_batch_keeps_its_id(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(8)])
    write_module(
        tmp_path,
        "poison_app",
        sqlite_db.url,
        pollers={"orders": "if events[0].pk['id'] == 0: raise ValueError('bad row')"},
        options="max_attempts=2,",
    )
    done = run_cli(
        ["run", "poison_app:orders", "--interval", "0", "--max-backoff", "0", "--max-ticks", "3"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    failed = [  # one line per failed tick, the worker's (the runtime's own is at -vv)
        line
        for line in done.stderr.splitlines()
        if "tick failed (HandlerError: handler failed on batch " in line
    ]
    ids = {line.split("handler failed on batch ")[1].split(":")[0] for line in failed}
    assert len(failed) == 3
    assert len(ids) == 1, failed  # one id across the attempts
    poison = next(line for line in done.stderr.splitlines() if "has failed 2 times" in line)
    # poison_app imports from the worker's directory: the commands go there first, so
    # they work pasted into a shell anywhere.
    here = f"cd {shlex.quote(str(tmp_path))} && "
    inspect = poison.split("Inspect: ")[1].split("  Skip")[0]
    assert inspect == f"{here}dbtrigger status orders --source poison_app:orders"
    skip = poison.split("Skip (data loss, journaled): ")[1]
    assert skip == (
        f"{here}dbtrigger skip-batch orders --source poison_app:orders "
        "--reason 'poison batch' --yes"
    )
    status = pasted(inspect, tmp_path / "elsewhere")
    assert status.returncode == 0, status.stderr
    assert "3 attempt(s)" in status.stdout
    skipped = pasted(f"{skip} --backup-dir {tmp_path / 'bk'}", tmp_path / "elsewhere")
    assert skipped.returncode == 0, skipped.stderr
    after = run_cli(["run", "poison_app:orders", "--interval", "0", "--max-ticks", "2"], tmp_path)
    assert "committed 3 rows" in after.stderr  # the 3 rows after the skipped batch of 5


def pasted(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` as a person pastes it into a shell: in another directory, with no
    PYTHONPATH pointing at the app."""
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(DBTRIGGER).parent}{os.pathsep}{env.get('PATH', '')}"
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run(
        [bash, "-c", command],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
        check=False,
    )


def test_operator_errors_stop_the_worker_with_exit_2(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    write_module(
        tmp_path,
        "broken_app",
        "postgresql+psycopg://postgres@127.0.0.1:5432/dbtrigger_no_such_database",
        pollers={"orders": "pass"},
    )
    started = time.monotonic()
    done = run_cli(["run", "broken_app:orders", "--interval", "0.1"], tmp_path)
    assert done.returncode == 2
    assert time.monotonic() - started < 30  # it stopped instead of retrying for ever
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "the database does not exist" in errors[0]
    assert "Traceback" not in done.stderr


def test_a_missing_driver_is_a_configuration_error(tmp_path: Path) -> None:
    write_module(
        tmp_path,
        "nodriver_app",
        "mssql+pymssql://sa:pw@127.0.0.1/db",
        pollers={"orders": "pass"},
    )
    done = run_cli(["run", "nodriver_app:orders", "--max-ticks", "1"], tmp_path)
    assert done.returncode == 2
    assert "error: the database driver for mssql+pymssql:// is not installed" in done.stderr
    assert "pip install pymssql" in done.stderr
    assert "Traceback" not in done.stderr


def test_several_pollers_in_one_process_share_one_shutdown(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(12)])
    log = tmp_path / "seen.log"
    line = "f'POLLER {e.pk[\"id\"]}\\n'"
    body = f"open({str(log)!r}, 'a').write(''.join({line} for e in events))"
    write_module(tmp_path, "two_app", sqlite_db.url, pollers={"first": body, "second": body})
    proc = subprocess.Popen(
        [DBTRIGGER, "run", "two_app:first", "two_app:second", "--interval", "30"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = log.read_text().splitlines() if log.exists() else []
        if len(seen) >= 24:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # one signal stops both, while they sleep 30 s
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    seen = log.read_text().splitlines()
    assert sorted(seen) == sorted(f"{p} {i}" for p in ("first", "second") for i in range(12))
    assert "first: 12 rows" in out
    assert "second: 12 rows" in out
    assert "2 pollers (first, second)" in err


def test_drain_reports_progress_and_catching_up(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(40)])
    write_module(tmp_path, "drain_app", sqlite_db.url, pollers={"orders": "pass"})
    done = run_cli(
        [
            "run",
            "drain_app:orders",
            "--interval",
            "0",
            "--max-ticks",
            "10",
            "--progress-interval",
            "0",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    progress = [line for line in done.stderr.splitlines() if "catching up:" in line]
    assert progress
    assert "about 35 behind" in progress[0]  # counted at the start, minus the first batch
    assert "orders: caught up: 40 rows" in done.stderr


def test_version_help_and_broken_pipe(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    from dbtrigger import __version__  # noqa: PLC0415

    version = run_cli(["--version"], tmp_path)
    assert version.stdout.strip() == f"dbtrigger {__version__}"
    helped = run_cli(["--help"], tmp_path)
    assert "Poll SQL tables into handlers" in helped.stdout
    assert "``" not in helped.stdout  # no module docstring (reST) on the user's screen
    # A long --json output into a reader that closes early: no traceback.
    state = tmp_path / "state"
    store = FileCheckpointStore(state)
    for i in range(60):
        doc = leasemod.decide_acquire(
            None,
            poller=f"p{i:02d}",
            fingerprint="sha256:x",
            owner="o",
            now=dt.datetime.now(dt.timezone.utc),
            ttl=dt.timedelta(seconds=1),
        ).document
        store.write(f"p{i:02d}", docmod.dumps(doc), if_match=None)
    piped = subprocess.run(  # noqa: S602 - the pipe is the point
        f"{DBTRIGGER} status --store {state} --json | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert piped.stdout.strip() == "["
    assert "Traceback" not in piped.stderr
    assert "BrokenPipeError" not in piped.stderr


def test_every_option_has_help_text() -> None:
    import argparse  # noqa: PLC0415

    from dbtrigger.cli import build_parser  # noqa: PLC0415

    missing: list[str] = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(f"{name} {sub_name}", sub)
                continue
            if action.dest != "help" and not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk("dbtrigger", build_parser())
    assert missing == []
