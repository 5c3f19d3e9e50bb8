"""The standalone runner, `dbtrigger run` and the demo, in-process and as real processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cli import build_parser, load_object, main
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.runner import Runner
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table

DBTRIGGER = [sys.executable, "-m", "dbtrigger.cli"]


def make_trigger(db: TestDatabase, state: Path, rows: int, **kwargs: int) -> PollTrigger:
    kwargs.setdefault("max_batches_per_tick", 1)  # one batch per tick unless a test says
    table = orders_table(db)
    insert(db, table, [{"id": i, "updated_at": naive(i)} for i in range(rows)])
    source = SqlAlchemySource(
        url=db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    return PollTrigger(
        name="orders", source=source, checkpoint_store=FileCheckpointStore(state), **kwargs
    )


def test_a_second_signal_between_ticks_stops_the_run_cleanly(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Two signals while the worker sleeps between ticks (``timeout -s INT`` sends one
    to the process and one to its group): the second raised KeyboardInterrupt out of
    run(), so ``dbtrigger run`` exited 130 with no summary and the demo printed no stop
    line (about one run in three of the README's demo under ``timeout``). With no batch
    in flight there is nothing to abandon: the run stops as after one signal."""
    trigger = make_trigger(sqlite_db, tmp_path / "state", rows=5, batch_size=10)
    seen: list[int] = []
    runner = Runner(
        trigger, lambda events: seen.extend(e.pk["id"] for e in events), interval_seconds=30
    )

    def two_signals(seconds: float, stop: object) -> None:
        del seconds, stop
        runner._on_signal(signal.SIGINT, None)
        runner._on_signal(signal.SIGINT, None)

    trigger.wait_for_work = two_signals  # type: ignore[method-assign]
    stats = runner.run(install_signals=False)
    assert seen == list(range(5))
    assert (stats.rows, stats.ticks) == (5, 2)
    state = trigger.read_state()
    assert state is not None
    assert state.position.pk == {"id": 4}


def test_a_second_signal_during_a_batch_abandons_it(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    trigger = make_trigger(sqlite_db, tmp_path / "state", rows=5, batch_size=10)
    runner = Runner(trigger, lambda events: None, interval_seconds=30)

    def handler(events: list[RowChange]) -> None:
        runner._on_signal(signal.SIGINT, None)
        runner._on_signal(signal.SIGINT, None)  # abandons the batch: not committed

    runner.handler = handler
    stats = runner.run(install_signals=False)
    assert (stats.rows, stats.ticks) == (0, 1)
    state = trigger.read_state()
    assert state is None or not state.checkpoint
    assert state is None or state.lease is None or state.lease.released


def test_runner_polls_again_at_once_while_batches_are_full(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    trigger = make_trigger(sqlite_db, tmp_path / "state", rows=50, batch_size=10)
    seen: list[int] = []
    runner = Runner(
        trigger, lambda events: seen.extend(e.pk["id"] for e in events), interval_seconds=30
    )
    waits: list[float] = []
    real_wait = runner._stop.wait

    def record_wait(timeout: float | None = None) -> bool:
        waits.append(timeout or 0)
        runner.stop()  # the first idle wait ends the run
        return real_wait(0)

    runner._stop.wait = record_wait  # type: ignore[method-assign]
    stats = runner.run()
    assert seen == list(range(50))
    assert stats.rows == 50
    assert stats.ticks == 6  # 5 full batches back to back, then one idle tick
    assert waits == [30]  # it slept only after the idle tick


def test_stop_mid_tick_commits_the_current_batch_and_releases(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    trigger = make_trigger(
        sqlite_db, tmp_path / "state", rows=40, batch_size=10, max_batches_per_tick=4
    )
    runner: Runner

    def handle(events: list[RowChange], ctx: BatchContext) -> None:
        runner.stop()  # as a first SIGTERM would, while this batch is in flight

    runner = Runner(trigger, handle, interval_seconds=0)
    stats = runner.run()
    assert stats.rows == 10  # the in-flight batch was finished, no further batch started
    state = trigger.read_state()
    assert state is not None
    assert state.position.pk == {"id": 9}
    assert state.lease is not None
    assert state.lease.released  # released in the same write as the commit


def test_abandoned_batch_is_not_committed_and_lease_is_released(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    trigger = make_trigger(sqlite_db, tmp_path / "state", rows=20, batch_size=10)

    def handle(events: list[RowChange]) -> None:
        raise KeyboardInterrupt  # a second Ctrl-C arriving inside the handler

    stats = Runner(trigger, handle, interval_seconds=0).run()
    assert stats.rows == 0
    state = trigger.read_state()
    assert state is not None
    assert state.checkpoint is None  # nothing partial committed
    assert state.lease is not None
    assert state.lease.released
    seen: list[int] = []
    assert trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 10
    assert seen == list(range(10))  # the abandoned batch comes again


def test_runner_keeps_going_after_transient_failures(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    trigger = make_trigger(sqlite_db, tmp_path / "state", rows=10, batch_size=10)
    attempts = {"n": 0}

    def handle(events: list[RowChange]) -> None:
        attempts["n"] += 1
        if attempts["n"] < 3:
            raise ConnectionError("sink down")

    stats = Runner(trigger, handle, interval_seconds=0, max_backoff_seconds=0).run(max_ticks=4)
    assert stats.failures == 2
    assert stats.rows == 10


def test_runner_stops_on_operator_errors(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    source = SqlAlchemySource(
        url=sqlite_db.url, table="missing", cursor_column="c", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="x", source=source, checkpoint_store=FileCheckpointStore(tmp_path / "s")
    )
    with pytest.raises(ConfigurationError, match="does not exist"):
        Runner(trigger, lambda events: None, interval_seconds=0).run(max_ticks=3)


def test_load_object_errors() -> None:
    with pytest.raises(ConfigurationError, match="MODULE:ATTRIBUTE"):
        load_object("no_colon")
    with pytest.raises(ConfigurationError, match="cannot import"):
        load_object("dbtrigger_no_such_module:x")
    with pytest.raises(ConfigurationError, match="has no attribute"):
        load_object("dbtrigger:NoSuchThing")


def test_parser_knows_run_and_demo() -> None:
    args = build_parser().parse_args(["run", "app:trigger", "--interval", "2", "--max-ticks", "3"])
    assert (args.trigger, args.interval, args.max_ticks) == (["app:trigger"], 2.0, 3)
    assert build_parser().parse_args(["demo", "--duration", "1"]).duration == 1.0


def write_app(tmp_path: Path, db_url: str, handler_sleep: float) -> Path:
    app = tmp_path / "worker_app.py"
    app.write_text(
        textwrap.dedent(
            f"""
            import time
            from pathlib import Path
            from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

            trigger = PollTrigger(
                name="orders",
                source=SqlAlchemySource(url={db_url!r}, table="orders",
                                        cursor_column="updated_at", pk_columns=["id"]),
                checkpoint_store=FileCheckpointStore({str(tmp_path / "state")!r}),
                batch_size=5,
                max_batches_per_tick=100,
            )
            LOG = Path({str(tmp_path / "delivered.log")!r})

            @trigger.handler
            def handle(events):
                with LOG.open("a") as fh:
                    for e in events:
                        fh.write(f"{{e.pk['id']}}\\n")
                time.sleep({handler_sleep})
            """
        )
    )
    return app


def test_cli_run_in_process(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(12)])
    write_app(tmp_path, sqlite_db.url, 0)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "worker_app:trigger", "--interval", "0", "--max-ticks", "2"]) == 0
    assert "12 rows in 2 ticks" in capsys.readouterr().out
    assert (tmp_path / "delivered.log").read_text().split() == [str(i) for i in range(12)]


def test_cli_reports_errors_with_their_cause(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "dbtrigger:__version__"]) == 2
    assert "not a PollTrigger" in capsys.readouterr().err


def test_cli_run_subprocess_sigterm_finishes_batch_and_releases(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(1000)])
    write_app(tmp_path, sqlite_db.url, handler_sleep=0.3)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [*DBTRIGGER, "run", "worker_app:trigger", "--interval", "0.2"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "delivered.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().split()) < 10):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    delivered = [int(x) for x in log.read_text().split()]
    assert 10 <= len(delivered) < 1000
    state = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    ).read_state()
    assert state is not None
    assert state.lease is not None
    assert state.lease.released, "lease still held after a clean shutdown"
    # Everything handed to the handler was committed: the checkpoint is the last delivered row.
    assert state.position.pk == {"id": delivered[-1]}
    assert "rows in" in out


def test_demo_runs_resumes_and_stops_on_sigint(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    # Stopped by SIGINT once a batch is committed (waited for, bounded), not after
    # a fixed duration a loaded machine may spend before its first commit.
    proc = subprocess.Popen(
        [*DBTRIGGER, "demo", "--dir", str(demo_dir), "--seed", "1", "--rate", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "checkpoint ->" in line or not line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    text = "".join(lines) + out
    assert proc.returncode == 0, err
    assert "starting from the beginning" in text
    assert "checkpoint -> updated_at=" in text
    assert "stopped:" in text
    assert "Traceback" not in err
    assert (demo_dir / "state" / "orders.json").exists()

    # --duration stops it on its own; the second run resumes from the checkpoint.
    again = subprocess.run(
        [*DBTRIGGER, "demo", "--dir", str(demo_dir), "--duration", "1", "--seed", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "resuming after updated_at=" in again.stdout
    assert "stopped:" in again.stdout
    # Fewer rows than changes is no loss: the stop line says what waits, or that none does.
    assert re.search(r"; (\d+ row\(s\) wait after the checkpoint: run it again to resume|"
                     r"every change delivered)$", again.stdout.splitlines()[-1])  # fmt: skip


def test_drain_reports_progress_through_a_callback(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    trigger = make_trigger(sqlite_db, tmp_path / "state", rows=25, batch_size=10)
    seen: list[tuple[int, str]] = []
    total = trigger.drain(
        lambda events: None, progress=lambda rows, result: seen.append((rows, result.outcome))
    )
    assert total == 25
    assert seen == [(10, "committed"), (20, "committed"), (25, "committed"), (25, "idle")]
