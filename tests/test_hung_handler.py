"""A handler call that never returns: reported while it runs, given up at
``handler_timeout_seconds``.

At default settings the heartbeat renews the lease for as long as the call
runs, so every other worker of the poller waits behind it; the call must be
reported at WARNING, then ERROR (runtime/heartbeat.py CallWatch). With
``handler_timeout_seconds`` the lease is no longer renewed once the call runs
out: it lapses, another worker delivers the batch, and the hung call's late
return commits nothing. Handlers block on an Event released at the end;
every wait is for an outcome, with a generous bound, never a duration.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, LostLeaseError, RowChange
from dbtrigger.errors import ConfigurationError
from dbtrigger.faults import FaultyStore
from dbtrigger.health import OK, STALE, check_health
from dbtrigger.runtime.context import BatchContext
from tests.databases import TestDatabase
from tests.reliability_support import (
    Recorder,
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    wait_for,
)

BOUND = 60.0  # seconds: generous, a loaded machine is slower, never stuck


def record(caplog: pytest.LogCaptureFixture, event: str) -> Callable[[], logging.LogRecord | None]:
    def first() -> logging.LogRecord | None:
        return next((r for r in list(caplog.records) if getattr(r, "event", None) == event), None)

    return first


class Blocked:
    """A handler that blocks until released; what it saw once released (a poller's or
    a queue's: both contexts have ``cancelled``)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.cancelled_seen: bool | None = None

    def __call__(self, events: list[RowChange], ctx: Any) -> None:
        self.entered.set()
        self.release.wait(BOUND * 2)
        self.cancelled_seen = ctx.cancelled


class Ticking:
    """One tick on a thread of its own: its result or error."""

    def __init__(self, tick: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = tick()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(BOUND)
        assert not self.thread.is_alive()


def test_a_hung_handler_is_reported_at_warning_then_error(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """Default settings (no timeout): the call is reported once it outlives the
    lease TTL, then again at ERROR; releasing it lets the batch commit."""
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=1)
    handler = Blocked()
    tick = Ticking(lambda: trigger.tick(handler))
    try:
        wait_for(lambda: record(caplog, "handler_stuck")() is not None, timeout=BOUND)
    finally:
        handler.release.set()
        tick.join()
    slow, stuck = record(caplog, "handler_slow")(), record(caplog, "handler_stuck")()
    assert slow is not None
    assert stuck is not None
    assert (slow.levelno, stuck.levelno) == (logging.WARNING, logging.ERROR)
    assert slow.created <= stuck.created
    for rec in (slow, stuck):
        fields = rec.__dict__
        assert fields["poller"] == "items"
        assert fields["rows"] == 5
        assert fields["lease_held"]
        assert fields["batch_id"]
        assert fields["seconds"] > 0
        text = rec.getMessage()
        assert "items" in text
        assert fields["batch_id"] in text
        assert "5 rows" in text
        assert "lease" in text
        assert "handler_timeout_seconds" in text
    # No timeout at default settings: the call was never cancelled and committed.
    assert tick.error is None
    assert tick.result == 5
    assert handler.cancelled_seen is False
    assert checkpoint_id(store) == 5
    assert record(caplog, "handler_timeout")() is None


def test_a_timed_out_call_lets_another_worker_deliver_and_commits_nothing(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    store = FaultyStore(InMemoryCheckpointStore())
    ttl = 1.0
    hung = make_trigger(
        items_source(sqlite_db),
        store,
        lease_ttl_seconds=ttl,
        handler_timeout_seconds=0.5,
        owner_id="hung",
    )
    other = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=ttl, owner_id="other")
    handler = Blocked()
    tick = Ticking(lambda: hung.tick(handler))
    released = False
    try:
        wait_for(lambda: record(caplog, "handler_timeout")() is not None, timeout=BOUND)
        timeout = record(caplog, "handler_timeout")()
        assert timeout is not None
        assert timeout.levelno == logging.ERROR
        assert timeout.__dict__["poller"] == "items"
        assert timeout.__dict__["rows"] == 5
        assert "handler_timeout_seconds=0.5" in timeout.getMessage()
        # The lease lapses; the other worker takes the batch over and commits it.
        recorder = Recorder()
        delivered: list[int] = []
        wait_for(lambda: delivered.append(other.tick(recorder)) or sum(delivered) == 5, BOUND)
        assert recorder.ids == [1, 2, 3, 4, 5]
        committed = read_doc(store)
        store.plan.reset_counts()
        handler.release.set()
        released = True
        tick.join()
    finally:
        if not released:
            handler.release.set()
            tick.join()
    # The hung call's late return: cancelled, nothing written (fenced out).
    assert handler.cancelled_seen is True
    assert isinstance(tick.error, LostLeaseError)
    assert store.plan.count("write") == 0
    assert checkpoint_id(store) == 5
    assert read_doc(store) == committed


def test_a_timed_out_async_handler_is_cancelled_and_the_batch_taken_over(
    sqlite_db: TestDatabase,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = InMemoryCheckpointStore()
    hung = make_trigger(
        items_source(sqlite_db),
        store,
        lease_ttl_seconds=1,
        handler_timeout_seconds=0.3,
        owner_id="hung",
    )
    stopped = threading.Event()

    async def forever(events: list[RowChange], ctx: BatchContext) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    with pytest.raises(LostLeaseError):
        hung.tick(forever)
    assert stopped.is_set()  # the task really stopped before the tick returned
    assert checkpoint_id(store) is None
    other = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=1, owner_id="other")
    delivered: list[int] = []
    wait_for(lambda: delivered.append(other.tick(Recorder())) or sum(delivered) == 3, BOUND)
    assert checkpoint_id(store) == 3


def test_handler_timeout_is_checked_and_not_for_fan_out(sqlite_db: TestDatabase) -> None:
    items_table(sqlite_db)
    source, store = items_source(sqlite_db), InMemoryCheckpointStore()
    for bad in (0, -1, "x"):
        with pytest.raises(ConfigurationError, match="handler_timeout_seconds"):
            make_trigger(source, store, handler_timeout_seconds=bad)
    with pytest.raises(ConfigurationError, match="ack_timeout_seconds"):
        make_trigger(source, store, handler_timeout_seconds=5, subscribers={"a": Recorder()})


def test_health_calls_a_lease_held_without_a_commit_stale_without_a_source(
    sqlite_db: TestDatabase,
) -> None:
    """No failure is recorded for a hung call, so a probe without a source
    used to answer OK for ever; a live lease with no commit under it is stale."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    store = InMemoryCheckpointStore()
    # A long TTL keeps the lease live at the probe's "later" clock.
    trigger = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=3600, batch_size=2)
    trigger.tick(Recorder())  # one batch committed, then the tick's other batches
    handler = Blocked()
    add_items(sqlite_db, table, range(6, 9))
    tick = Ticking(lambda: trigger.tick(handler))
    try:
        assert handler.entered.wait(BOUND)
        now = dt.datetime.now(dt.timezone.utc)
        assert check_health(store, "items", stale_after_seconds=600, now=now).status == OK
        later = now + dt.timedelta(seconds=900)
        report = check_health(store, "items", stale_after_seconds=600, now=later)
        assert (report.status, report.http_status) == (STALE, 503)
        assert "held" in report.reason
        assert "without a commit" in report.reason
    finally:
        handler.release.set()
        tick.join()
    assert tick.error is None
    assert check_health(store, "items", stale_after_seconds=600, now=later).status == OK
