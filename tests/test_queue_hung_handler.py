"""A queue handler call that never returns: reported while it runs, given up at
``handler_timeout_seconds`` - as a poller's (tests/test_hung_handler.py).

At default settings the claim heartbeat extends the claim for as long as the
call runs, so no other worker ever gets its rows; the call must be reported at
WARNING, then ERROR (runtime/call_watch.py). With ``handler_timeout_seconds``
the claim is no longer extended once the call runs out: it expires, another
worker delivers the rows, and the hung call's late return records nothing.
Handlers block on an Event released at the end; every wait is for an outcome,
with a generous bound, never a duration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue import ClaimContext
from tests.databases import TestDatabase
from tests.reliability_support import wait_for
from tests.test_hung_handler import BOUND, Blocked, Ticking, record
from tests.test_queue_columns import make_jobs, rows


def queue(db: TestDatabase, **kw: Any) -> QueueTrigger:
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    return QueueTrigger(name="jobs", source=source, batch_size=10, **kw)


def test_a_hung_queue_handler_is_reported_at_warning_then_error(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """Default settings (no timeout): the call is reported once it outlives the
    visibility timeout, then again at ERROR; no other worker gets its rows
    meanwhile; releasing it lets the claim settle."""
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    make_jobs(sqlite_db, 5)
    hung, other = queue(sqlite_db, visibility_timeout_seconds=1), queue(sqlite_db)
    handler = Blocked()
    tick = Ticking(lambda: hung.tick_result(handler))
    try:
        wait_for(lambda: record(caplog, "handler_stuck")() is not None, timeout=BOUND)
        assert other.tick(lambda events: None) == 0  # the claim is still extended
    finally:
        handler.release.set()
        tick.join()
        hung.close()
        other.close()
    slow, stuck = record(caplog, "handler_slow")(), record(caplog, "handler_stuck")()
    assert slow is not None
    assert stuck is not None
    assert (slow.levelno, stuck.levelno) == (logging.WARNING, logging.ERROR)
    for rec in (slow, stuck):
        fields = rec.__dict__
        assert fields["poller"] == "jobs"
        assert fields["rows"] == 5
        assert fields["claim_held"]
        assert fields["batch_id"] == tick.result.token
        assert fields["seconds"] > 0
        text = rec.getMessage()
        assert text.startswith("queue jobs: ")
        assert f"claim {tick.result.token} (5 rows)" in text
        assert "handler_timeout_seconds" in text
    assert tick.error is None
    assert (tick.result.rows, tick.result.claims_lost) == (5, 0)
    assert handler.cancelled_seen is False
    assert {r["dbt_status"] for r in rows(sqlite_db).values()} == {"done"}
    assert record(caplog, "handler_timeout")() is None


def test_a_timed_out_queue_call_lets_another_worker_deliver_and_records_nothing(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    make_jobs(sqlite_db, 5)
    hung = queue(sqlite_db, visibility_timeout_seconds=1, handler_timeout_seconds=0.5)
    other = queue(sqlite_db, visibility_timeout_seconds=30)
    handler = Blocked()
    tick = Ticking(lambda: hung.tick_result(handler))
    delivered: list[int] = []
    try:
        wait_for(lambda: record(caplog, "handler_timeout")() is not None, timeout=BOUND)
        timeout = record(caplog, "handler_timeout")()
        assert timeout is not None
        assert timeout.levelno == logging.ERROR
        assert (timeout.__dict__["poller"], timeout.__dict__["rows"]) == ("jobs", 5)
        assert "handler_timeout_seconds=0.5" in timeout.getMessage()
        # The claim is no longer extended: it expires and another worker delivers
        # the rows (claiming them again in halves, as for any expired claim).
        wait_for(lambda: delivered.append(other.tick(lambda events: None)) or sum(delivered) == 5)
    finally:
        handler.release.set()
        tick.join()
        hung.close()
        other.close()
    # The hung call's late return: cancelled, nothing recorded for its rows.
    assert handler.cancelled_seen is True
    assert tick.error is None
    assert (tick.result.rows, tick.result.claims_lost) == (0, 5)
    table = rows(sqlite_db)
    assert {r["dbt_status"] for r in table.values()} == {"done"}
    assert tick.result.token not in {r["dbt_claim_token"] for r in table.values()}


def test_a_timed_out_async_queue_handler_is_cancelled(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 3)
    hung = queue(sqlite_db, visibility_timeout_seconds=1, handler_timeout_seconds=0.3)
    stopped = threading.Event()

    async def forever(events: list[RowChange], ctx: ClaimContext) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    try:
        result = hung.tick_result(forever)
    finally:
        hung.close()
    assert stopped.is_set()  # the task really stopped before the tick returned
    assert (result.rows, result.claims_lost) == (0, 3)
    assert {r["dbt_status"] for r in rows(sqlite_db).values()} == {"claimed"}


def test_queue_handler_timeout_is_checked(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 0)
    for bad in (0, -1, "x"):
        with pytest.raises(ConfigurationError, match="handler_timeout_seconds"):
            queue(sqlite_db, handler_timeout_seconds=bad)
