"""The chaos tests' worker stop: a worker that ignores SIGTERM is dumped, killed and reaped."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.cdc.processes import stop_worker

#: A worker stuck as the chaos worker once was: SIGTERM does nothing, SIGUSR1 dumps.
STUCK = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def where_it_sits():
    print("ready", file=sys.stderr, flush=True)
    time.sleep(600)
where_it_sits()
"""


def test_a_worker_that_ignores_sigterm_fails_the_test_with_its_stacks_and_is_reaped(
    tmp_path: Path,
) -> None:
    log = tmp_path / "worker.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-c", STUCK], stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text():  # its handlers are in place
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker never started"
            process_wait(process, 0.01)
        with pytest.raises(pytest.fail.Exception) as failed:
            stop_worker(process, log.read_text, timeout=0.5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode is not None, "reaped"
    assert "did not exit within 0.5s of SIGTERM" in str(failed.value)
    assert "where_it_sits" in str(failed.value), "every thread's stack is in the failure"


def test_a_worker_that_exits_is_simply_reaped(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stop_worker(process, lambda: "", timeout=30)
    assert process.returncode == -15


def process_wait(process: subprocess.Popen[bytes], seconds: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=seconds)


def test_a_stream_thread_that_outlives_its_stop_is_said_at_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopping the stream waits a bounded time for its thread; one still running then
    (stuck in a status message or a control-row write) is left, and said, not waited for."""
    from dbtrigger.cdc import pg_stream  # noqa: PLC0415

    monkeypatch.setattr(pg_stream, "STOP_SECONDS", 0.2)
    source: Any = SimpleNamespace(lock=threading.RLock(), slot="s1", poller="orders")
    reader = pg_stream.StreamReader(source)
    stuck = threading.Event()
    thread = threading.Thread(target=stuck.wait, args=(60,), daemon=True)
    thread.start()
    reader._thread = thread
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger.cdc"), source.lock:
            reader.stop()  # called under the source's lock, as fill() and close() do
    finally:
        stuck.set()
        thread.join(60)
    (record,) = [
        r for r in caplog.records if getattr(r, "event", None) == "cdc_stream_stop_abandoned"
    ]
    assert record.levelno == logging.WARNING
    assert "did not end within 0.2s" in record.getMessage()
    assert reader._thread is None
