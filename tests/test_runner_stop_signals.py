"""A SIGTERM stops a worker whatever its main thread was doing when it landed.

A Python signal handler runs on the main thread between two bytecodes. The
handler used to call ``stop.set()``, which takes the event's lock; a signal
that landed while the main thread held that same lock inside ``stop.wait()``
(the idle wait between ticks, on its way in or out) waited for its own thread:
the worker never exited (test_cdc_chaos's PostgreSQL worker, under load). The
tests below make the signal land exactly there: the handler runs inside
``raise_signal`` (it checks for signals before returning), called while the
main thread holds the stop event's lock, as ``Event.wait`` does. They run in
a subprocess, since a main thread that hangs would hang pytest with it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dbtrigger.runtime.stop_signals import SignalRelay, say_overdue

ROOT = Path(__file__).resolve().parent.parent

#: The signal lands while the main thread holds the stop event's lock, as it does
#: inside ``Event.wait`` (``Event`` keeps it in ``_cond``: CPython's threading.py).
LANDS_IN_WAIT = """
def idle(seconds, stop):
    with stop._cond:
        signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
    stop.wait(seconds)
    return False
"""

RUNNER = (
    """
import signal
from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.runtime.runner import Runner
from dbtrigger.testing import MemoryLogSource
"""
    + LANDS_IN_WAIT
    + """
source = MemoryLogSource()
source.commit([{"op": "insert", "pk": {"id": 1}, "after": {"id": 1}}])
trigger = PollTrigger(name="stop", source=source, checkpoint_store=InMemoryCheckpointStore())
trigger.wait_for_work = idle
stats = Runner(trigger, lambda events: None, interval_seconds=30).run()
print("stopped", stats.rows, flush=True)
"""
)

LOOP = (
    """
import signal, threading
from dbtrigger.runtime.stop_signals import stop_on_signals
"""
    + LANDS_IN_WAIT
    + """
stop = threading.Event()
with stop_on_signals(stop):
    while not stop.is_set():
        idle(30, stop)
print("stopped", flush=True)
"""
)


#: A script still running after this long writes every thread's stack and exits.
DUMP = "import faulthandler; faulthandler.dump_traceback_later(20, exit=True)\n"


def run_script(script: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DUMP + textwrap.dedent(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the worker did not stop within 30 s of SIGTERM: {out}{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_during_the_runners_idle_wait_stops_it() -> None:
    done = run_script(RUNNER)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stopped", "1"]


def test_stop_on_signals_stops_a_loop_of_ones_own() -> None:
    done = run_script(LOOP)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stopped"]


def test_a_stop_that_is_late_is_said_with_every_threads_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said = threading.Event()
    late: list[float] = []

    def overdue(seconds: float) -> None:
        late.append(seconds)
        say_overdue(seconds, "orders")
        said.set()

    acted: list[int] = []
    relay = SignalRelay(acted.append, overdue=overdue, overdue_seconds=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger.runner"):
            relay.post(15)
            assert said.wait(30), "no stop_overdue within 30 s"
    finally:
        relay.close()
    assert acted == [15]
    assert late[0] >= 0.2
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "stop_overdue"]
    assert record.levelno == logging.WARNING
    assert record.poller == "orders"  # type: ignore[attr-defined]
    assert "test_a_stop_that_is_late_is_said_with_every_threads_stack" in record.getMessage()


def test_a_relay_closed_before_it_is_late_says_nothing() -> None:
    late: list[float] = []
    acted = threading.Event()
    relay = SignalRelay(lambda signum: acted.set(), overdue=late.append, overdue_seconds=600)
    relay.post(15)
    assert acted.wait(30)
    relay.close()
    assert not relay._thread.is_alive()
    assert late == []


HANGS = """
import logging, signal, sys, time
from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.runtime import stop_signals
from dbtrigger.runtime.runner import Runner
from dbtrigger.testing import MemoryLogSource

stop_signals.SignalRelay.__init__.__kwdefaults__["overdue_seconds"] = 0.5  # not 20 s
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
source = MemoryLogSource()
source.commit([{"op": "insert", "pk": {"id": 1}, "after": {"id": 1}}])
trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())

def hangs(events):
    print("in handler", flush=True)
    time.sleep(60)

stats = Runner(trigger, hangs, interval_seconds=30).run()
print("stopped", stats.rows, flush=True)
"""


def test_a_late_stop_says_that_a_second_signal_abandons_the_batch() -> None:
    """Ctrl-C on a worker whose handler hangs: 'finishing the current batch, then
    stopping', and 20 s later a WARNING that spoke of a SIGKILL after the grace period
    only; the person at the terminal was not told that Ctrl-C again abandons the batch
    (and that it is delivered again), which is what ends the wait."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DUMP + textwrap.dedent(HANGS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert proc.stdout.readline().strip() == "in handler"
        proc.send_signal(signal.SIGINT)
        late = ""
        for line in proc.stderr:  # bounded by the script's own 20 s dump-and-exit
            if "still stopping" in line:
                late = line
                break
        assert "press Ctrl-C again or send another SIGTERM to abandon it now" in late, late
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert out.split() == ["stopped", "0"]
