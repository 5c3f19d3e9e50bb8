"""SIGTERM to a worker whose synchronous handler call was given up: it exits at once.

``handler_timeout_seconds`` gives a hung call up: its lease or claim lapses and
another worker delivers the rows again. A synchronous call cannot be killed,
and the tick's thread went on waiting for it - and so did the first SIGTERM
of ``dbtrigger run`` ("finish the batch in flight"): the worker only ended on
a second signal (with lanes, not even then: the interpreter joins a thread
pool at exit). A platform sends one SIGTERM, then SIGKILL after its grace
period, so every deploy beside a hung handler became a kill.

Each test runs the real console script against a real database, its handler
blocked on an Event nobody sets, and sends one SIGTERM; the exit is waited
for with a bound, never a fixed time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    wait_for,
)
from tests.test_queue_columns import make_jobs, rows

DBTRIGGER = str(Path(sys.executable).with_name("dbtrigger"))
BOUND = 60.0  # seconds to reach a state: generous, a loaded machine is slower
EXIT_BOUND = 20.0  # seconds from the SIGTERM to the exit (under a 30 s grace period)

APP = """
import sys, threading
from dbtrigger import ClaimSource, FileCheckpointStore, PollTrigger, QueueTrigger
from dbtrigger import SqlAlchemySource

def hang(events):
    sys.stderr.write(f"handler entered: {{len(events)}} rows\\n")
    sys.stderr.flush()
    threading.Event().wait()  # for ever

queue = QueueTrigger(
    name="jobs",
    source=ClaimSource(url={url!r}, table="jobs", schema={schema!r}, pk_columns=["id"]),
    batch_size=10, visibility_timeout_seconds=2, max_concurrency={lanes},
    handler_timeout_seconds={timeout},
)
queue.handler(hang)

poller = PollTrigger(
    name="items",
    source=SqlAlchemySource(url={url!r}, table="items", schema={schema!r},
                            cursor_column="version", pk_columns=["id"], visibility="none"),
    checkpoint_store=FileCheckpointStore({state!r}),
    batch_size=10, lease_ttl_seconds=2, max_concurrency={lanes},
    handler_timeout_seconds={timeout},
)
poller.handler(hang)
"""


class Worker:
    """``dbtrigger run app:ATTR`` in a subprocess; its stderr lines as they come."""

    def __init__(self, cwd: Path, attr: str) -> None:
        self.proc = subprocess.Popen(
            [DBTRIGGER, "run", f"app:{attr}", "--interval", "0.2"],
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(cwd)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, text: str) -> None:
        def seen() -> bool:
            return any(text in line for line in self.lines)

        with self._changed:
            self._changed.wait_for(lambda: seen() or not self._reader.is_alive(), BOUND)
            assert seen(), f"no line with {text!r}; stderr:\n" + "\n".join(self.lines)

    def stop(self) -> tuple[int, str, str]:
        """One SIGTERM; the exit code, stdout and stderr once it exited (bounded)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=EXIT_BOUND)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(BOUND)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        err = "\n".join(self.lines)
        assert code is not None, f"still running {EXIT_BOUND:g} s after the SIGTERM:\n{err}"
        return code, out, err


def write_app(db: TestDatabase, tmp_path: Path, *, lanes: int, timeout: float) -> None:
    text = APP.format(
        url=db.url, schema=db.schema, lanes=lanes, timeout=timeout, state=str(tmp_path / "state")
    )
    (tmp_path / "app.py").write_text(textwrap.dedent(text))


def assert_abandoned(code: int, out: str, err: str, name: str) -> None:
    assert code == 0, err
    assert f"{name}: stopping without waiting for the handler call on " in err
    assert "WARNING dbtrigger.runtime" in err
    assert f"{name}: stopped after 1 tick" in err
    assert "taken over by another instance" not in err  # a stop let it go, no other worker
    assert f"{name}: 0 rows in 1 tick" in out


def delivered_again(deliver: Callable[[], int], rows: int) -> None:
    """Another worker gets every row once the abandoned call's hold lapsed."""
    got: list[int] = []
    wait_for(lambda: got.append(deliver()) or sum(got) >= rows, timeout=BOUND)
    assert sum(got) == rows


@pytest.mark.parametrize("lanes", [1, 2])
def test_one_sigterm_stops_a_queue_worker_whose_call_timed_out(
    db: TestDatabase, tmp_path: Path, lanes: int
) -> None:
    make_jobs(db, 3)
    write_app(db, tmp_path, lanes=lanes, timeout=0.5)
    worker = Worker(tmp_path, "queue")
    worker.wait_for_line("past handler_timeout_seconds=0.5")
    code, out, err = worker.stop()
    assert_abandoned(code, out, err, "jobs")
    assert "done" not in {r["dbt_status"] for r in rows(db).values()}  # nothing recorded
    other = QueueTrigger(
        name="jobs",
        source=ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"]),
        batch_size=10,
    )
    try:
        delivered_again(lambda: other.tick(lambda events: None), 3)
    finally:
        other.close()
    assert {r["dbt_status"] for r in rows(db).values()} == {"done"}


@pytest.mark.parametrize("lanes", [1, 2])
def test_one_sigterm_stops_a_poller_whose_call_timed_out(
    sqlite_db: TestDatabase, tmp_path: Path, lanes: int
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), [1, 2, 3])
    write_app(sqlite_db, tmp_path, lanes=lanes, timeout=0.5)
    worker = Worker(tmp_path, "poller")
    worker.wait_for_line("past handler_timeout_seconds=0.5")
    code, out, err = worker.stop()
    assert_abandoned(code, out, err, "items")
    store = FileCheckpointStore(str(tmp_path / "state"))
    assert read_doc(store).checkpoint is None  # nothing committed for the batch
    other = make_trigger(items_source(sqlite_db), store, owner_id="other")
    try:
        delivered_again(lambda: other.tick(lambda events: None), 3)
    finally:
        other.close()


def test_sigterm_before_the_timeout_waits_for_it_then_stops(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """The documented stop finishes the batch in flight: a call not given up yet is
    waited for, up to the handler timeout; then the worker stops at once."""
    make_jobs(sqlite_db, 3)
    write_app(sqlite_db, tmp_path, lanes=1, timeout=3)
    worker = Worker(tmp_path, "queue")
    worker.wait_for_line("handler entered: 3 rows")
    code, out, err = worker.stop()
    assert_abandoned(code, out, err, "jobs")
    order = [
        next(i for i, line in enumerate(worker.lines) if text in line)
        for text in ("signal 15", "past handler_timeout_seconds=3", "stopping without waiting")
    ]
    assert order == sorted(order), err


def test_a_second_sigterm_ends_a_worker_whose_lanes_hang(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """No handler timeout: the first signal waits for the batch in flight, the second
    abandons it (documented) - and the process exits. The lanes' threads were a
    thread pool's, which the interpreter joins at exit: it never did."""
    add_items(sqlite_db, items_table(sqlite_db), [1, 2, 3])
    text = APP.format(
        url=sqlite_db.url, schema=None, lanes=2, timeout=None, state=str(tmp_path / "state")
    )
    (tmp_path / "app.py").write_text(textwrap.dedent(text))
    worker = Worker(tmp_path, "poller")
    worker.wait_for_line("handler entered")
    worker.proc.send_signal(signal.SIGTERM)
    worker.wait_for_line("signal 15")
    code, _, err = worker.stop()
    assert "items: in-flight batch abandoned" in err
    assert code == 0, err
    assert read_doc(FileCheckpointStore(str(tmp_path / "state"))).checkpoint is None
