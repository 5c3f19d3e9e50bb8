"""The chaos tests' fork server (tests/chaos/forked.py) behaves as ``subprocess.Popen`` does."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.chaos.forked import Forker

SLEEP = ["-n", "1", "-r", "1", "import time; time.sleep(120)"]  # python -m timeit


def test_a_forked_process_runs_as_python_m_and_exits_with_its_status(tmp_path: Path) -> None:
    with Forker("timeit") as forker:
        done = forker.start(
            ["-n", "1", "-r", "1", "import os; print('hi from', os.environ['WHO'])"],
            tmp_path / "a",
            {"WHO": "timeit"},
        )
        assert done.wait(60) == 0
        failed = forker.start(["-n", "1", "-r", "1", "1 / 0"], tmp_path / "b")
        assert failed.wait(60) == 1  # timeit prints the traceback and returns 1
    assert "hi from timeit" in (tmp_path / "a").read_text()
    assert "ZeroDivisionError" in (tmp_path / "b").read_text()
    with Forker("json.tool") as forker:
        usage = forker.start(["--no-such-option"], tmp_path / "c")
        assert usage.wait(60) == 2  # argparse's SystemExit(2)
    assert "unrecognized arguments" in (tmp_path / "c").read_text()


def test_signals_reach_the_worker_itself(tmp_path: Path) -> None:
    with Forker("timeit") as forker:
        killed = forker.start(SLEEP, tmp_path / "k")
        terminated = forker.start(SLEEP, tmp_path / "t")
        assert killed.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            killed.wait(0.2)
        killed.kill()
        assert killed.wait(60) == -signal.SIGKILL
        terminated.send_signal(signal.SIGTERM)
        assert terminated.wait(60) == -signal.SIGTERM
        assert terminated.poll() == -signal.SIGTERM
        running = forker.start(SLEEP, tmp_path / "r")
        pid = running.pid
        os.kill(pid, 0)
    # closed with a worker still running: killed, not left behind
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
