"""``poison_batch`` is said at ERROR once per poison batch, then as a WARNING
reminder now and then - not at ERROR on every failed attempt of every worker.

Without a dead-letter sink a batch that failed ``max_attempts`` times is
retried for ever; each of those attempts logged ``poison_batch`` at ERROR, in
whichever worker took it. The ERROR now comes on the attempt that made the
batch poison (the attempt count is the state document's, shared by every
worker), and again when the batch changed (its rows are no longer the ones the
failure record describes); the other attempts say so in one WARNING under the
same event name (``again`` true) at most every 15 minutes per batch.
"""

from __future__ import annotations

import logging

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.errors import HandlerError
from dbtrigger.runtime.poison_report import POISON_REMINDER
from dbtrigger.testing import MemorySource
from tests.test_event_outcomes import Clock


def said(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "poison_batch" and r.levelno == level
    ]


def fail_on_two(events: list[RowChange]) -> None:
    if any(e.pk["id"] == 2 for e in events):
        raise ValueError("row 2 is malformed")


def test_a_poison_batch_is_an_error_once_per_batch_then_a_reminder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dbtrigger")
    source = MemorySource(
        [{"id": i, "seq": i} for i in (1, 2, 3)], cursor_column="seq", pk_columns=["id"]
    )
    store = InMemoryCheckpointStore()
    clock = Clock()

    def worker(owner: str) -> PollTrigger:
        return PollTrigger(
            name="orders",
            source=source,
            checkpoint_store=store,
            owner_id=owner,
            clock=clock,
            max_attempts=2,
            retry_delay_seconds=0,
        )

    workers = [worker("worker-a"), worker("worker-b")]

    def tick(n: int) -> None:
        with pytest.raises(HandlerError):
            workers[n % 2].tick(fail_on_two)
        clock.advance(60)

    tick(0)  # attempt 1: retried, nothing said
    assert said(caplog, logging.ERROR) == []
    tick(1)  # attempt 2 of 2: poison now, said by the worker that found it so
    [error] = said(caplog, logging.ERROR)
    for key in ("batch_id", "fencing_token", "checkpoint_before", "rows", "attempt"):
        assert key in error.__dict__
    assert "quarantine sink" in error.getMessage()
    for n in range(8):  # eight more attempts, by both workers, within the reminder's period
        tick(n)
    assert len(said(caplog, logging.ERROR)) == 1
    reminders = said(caplog, logging.WARNING)
    assert len(reminders) == 1  # the worker that had not said it yet, once
    assert reminders[0].__dict__["again"] is True
    assert reminders[0].__dict__["batch_id"] == error.__dict__["batch_id"]
    clock.advance(POISON_REMINDER.total_seconds())
    tick(0)
    tick(1)
    assert len(said(caplog, logging.WARNING)) == 3  # each worker once more
    assert len(said(caplog, logging.ERROR)) == 1
    source.put({"id": 4, "seq": 4})  # the batch changed: a new ERROR
    tick(0)
    assert len(said(caplog, logging.ERROR)) == 2
    tick(1)
    assert len(said(caplog, logging.ERROR)) == 2
