"""Stopping a chaos test's worker process: bounded, and always reaped.

A worker that did not exit after SIGTERM was once left running by the test
that started it (``Popen.wait(timeout=60)`` raised, nothing killed it), and
its ``Popen``, collected later, failed whichever test ran next on the same
xdist worker (ResourceWarning: subprocess still running). Here a worker still
running after its grace period is asked for every thread's stack (SIGUSR1:
the workers register :mod:`faulthandler` for it, writing to their log), then
killed and reaped, and the test fails with the log, the stacks included.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import pytest

#: How long a worker's stack dump may take to reach its log.
DUMP_SECONDS = 5.0


def stop_worker(
    process: subprocess.Popen[bytes], log: Callable[[], str], timeout: float = 60.0
) -> None:
    """SIGTERM ``process`` and wait up to ``timeout``; past that, dump, kill, reap, fail.

    ``log``: the worker's stderr so far (read after the dump).
    """
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        process.send_signal(signal.SIGUSR1)
        process.wait(timeout=DUMP_SECONDS)  # a dump does not end it: this waits it out
    except subprocess.TimeoutExpired:
        pass
    finally:
        process.kill()
        process.wait()
    pytest.fail(
        f"the worker (pid {process.pid}) did not exit within {timeout:g}s of SIGTERM; "
        f"killed. Its log, with every thread's stack:\n{log()}"
    )


def reap(process: subprocess.Popen[bytes] | None) -> None:
    """Kill and reap ``process`` if it still runs (a test that failed before its stop)."""
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


__all__ = ["reap", "stop_worker"]
