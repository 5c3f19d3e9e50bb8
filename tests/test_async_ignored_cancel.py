"""An async handler that swallows its cancellation is let go after a bounded wait.

Once a batch is given up (``handler_timeout_seconds``, a lost lease or claim, a
stop), the kernel cancels the handler's task and waits for it. A handler that
catches ``asyncio.CancelledError`` and carries on used to hold the tick - and
the worker's stop - for ever. Now it is waited for ``CANCEL_GRACE_SECONDS``,
then let go (it runs on; nothing it does is recorded), the batch fails with
the timeout's error, an ERROR ``handler_ignored_cancel`` says so, and the rows
are delivered again. Every wait here is for an outcome, with a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, LostLeaseError, RowChange
from dbtrigger.queue import ClaimSource, QueueTrigger
from dbtrigger.runtime import async_calls
from tests.databases import TestDatabase
from tests.reliability_support import (
    Recorder,
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    wait_for,
)
from tests.test_hung_handler import Ticking
from tests.test_hung_handler_stop import APP, Worker
from tests.test_queue_columns import make_jobs, rows

BOUND = 60.0  # seconds: generous, a loaded machine is slower, never stuck


class Stubborn:
    """An async handler that ignores every cancellation until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.ignored = threading.Event()
        self.release = threading.Event()

    async def __call__(self, events: list[RowChange], ctx: Any) -> None:
        self.entered.set()
        while not self.release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                self.ignored.set()  # and carries on


@pytest.fixture
def stubborn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stubborn]:
    monkeypatch.setattr(async_calls, "CANCEL_GRACE_SECONDS", 0.3, raising=False)
    handler = Stubborn()
    yield handler
    handler.release.set()  # the let-go task ends; its loop closes on its own thread


def ignored_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "handler_ignored_cancel"]


def test_a_timed_out_async_handler_that_ignores_its_cancellation_is_let_go(
    sqlite_db: TestDatabase, stubborn: Stubborn, caplog: pytest.LogCaptureFixture
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 4))
    store = InMemoryCheckpointStore()
    hung = make_trigger(
        items_source(sqlite_db),
        store,
        lease_ttl_seconds=1,
        handler_timeout_seconds=0.3,
        owner_id="hung",
    )
    tick = Ticking(lambda: hung.tick(stubborn))
    tick.join()  # before: never returned
    assert stubborn.ignored.is_set()
    assert isinstance(tick.error, LostLeaseError)
    assert checkpoint_id(store) is None  # nothing recorded
    (record,) = ignored_records(caplog)
    assert record.levelno == logging.ERROR
    assert "ignored its cancellation" in record.getMessage()
    other = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=1, owner_id="other")
    delivered: list[int] = []
    wait_for(lambda: delivered.append(other.tick(Recorder())) or sum(delivered) == 3, BOUND)
    assert checkpoint_id(store) == 3  # nothing lost
    hung.close()
    other.close()


def test_tick_async_lets_go_of_a_handler_that_ignores_its_cancellation(
    sqlite_db: TestDatabase, stubborn: Stubborn, caplog: pytest.LogCaptureFixture
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 4))
    store = InMemoryCheckpointStore()
    hung = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=1, handler_timeout_seconds=0.3
    )
    ended = threading.Event()
    errors: list[BaseException] = []

    async def main() -> None:
        try:
            await hung.tick_async(stubborn)
        except BaseException as exc:
            errors.append(exc)
        ended.set()
        await asyncio.to_thread(stubborn.release.wait, BOUND)  # (the loop's own task ends)

    tick = Ticking(lambda: asyncio.run(main()))
    assert ended.wait(BOUND)  # before: the tick never ended
    assert [type(e) for e in errors] == [LostLeaseError]
    assert ignored_records(caplog)
    assert checkpoint_id(store) is None
    stubborn.release.set()
    tick.join()
    hung.close()


def test_a_queue_call_that_ignores_its_cancellation_is_let_go(
    sqlite_db: TestDatabase, stubborn: Stubborn, caplog: pytest.LogCaptureFixture
) -> None:
    make_jobs(sqlite_db, 3)
    queue = QueueTrigger(
        name="jobs",
        source=ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"]),
        batch_size=10,
        visibility_timeout_seconds=1,
        handler_timeout_seconds=0.3,
    )
    tick = Ticking(lambda: queue.tick(stubborn))
    tick.join()  # before: never returned
    assert stubborn.ignored.is_set()
    assert ignored_records(caplog)
    assert "done" not in {r["dbt_status"] for r in rows(sqlite_db).values()}
    queue.close()


ASYNC_APP = """
import asyncio, sys
from dbtrigger.runtime import async_calls
async_calls.CANCEL_GRACE_SECONDS = 0.5

async def stubborn(events):
    sys.stderr.write(f"handler entered: {len(events)} rows\\n")
    sys.stderr.flush()
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            sys.stderr.write("cancellation ignored\\n")
            sys.stderr.flush()
"""


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """``worker``, killed if the test fails before it stopped (a worker stuck in a
    hung tick ignores one SIGTERM: it must not outlive the test)."""
    try:
        yield worker
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()


def write_async_app(db: TestDatabase, tmp_path: Path, timeout: float | None) -> None:
    text = APP.format(
        url=db.url, schema=None, lanes=1, timeout=timeout, state=str(tmp_path / "state")
    )
    text = text.replace("import sys, threading", ASYNC_APP).replace(
        "handler(hang)", "handler(stubborn)"
    )
    (tmp_path / "app.py").write_text(text)


def test_the_worker_goes_on_past_a_timed_out_handler_that_ignores_cancel_and_stops(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """``dbtrigger run``: the batch is given up and the worker goes on (before: stuck in
    the tick for ever, saying nothing); one SIGTERM then stops it."""
    add_items(sqlite_db, items_table(sqlite_db), [1, 2, 3])
    write_async_app(sqlite_db, tmp_path, timeout=0.5)
    with running(Worker(tmp_path, "poller")) as worker:
        worker.wait_for_line("cancellation ignored")
        worker.wait_for_line("ignored its cancellation")
        code, _, err = worker.stop()
    assert code == 0, err


def test_two_sigterms_end_a_worker_whose_async_handler_ignores_cancel(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """No handler timeout: the first signal waits for the batch in flight, the second
    abandons it - and the process exits (a guard: this one passed before too)."""
    add_items(sqlite_db, items_table(sqlite_db), [1, 2, 3])
    write_async_app(sqlite_db, tmp_path, timeout=None)
    with running(Worker(tmp_path, "poller")) as worker:
        worker.wait_for_line("handler entered")
        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_for_line("signal 15")
        code, _, err = worker.stop()
    assert "items: in-flight batch abandoned" in err
    assert code == 0, err
