"""``poison_event`` is said at ERROR once per event, when it becomes poison,
then as one WARNING reminder now and then - not at ERROR on every redelivery.

Without a dead-letter sink an event that used up ``max_attempts`` is handed out
again after each backoff (12 times an hour with the default one, every tick
with ``retry_delay_seconds=0``) and failed again; each of those deliveries
logged ``poison_event`` at ERROR, for the single handler and for fan-out alike.
"""

from __future__ import annotations

import logging

import pytest

from dbtrigger import BatchContext, InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.runtime.poison_report import POISON_REMINDER
from dbtrigger.testing import MemorySource
from tests.test_event_outcomes import Clock


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "poison_event" and r.levelno == level
    ]


def retry_two(events: list[RowChange], ctx: BatchContext) -> None:
    for e in events:
        if e.pk["id"] == 2:
            ctx.retry(e, "downstream refuses 2")


def accept(events: list[RowChange]) -> None:
    del events


@pytest.mark.parametrize("fan_out", [False, True], ids=["handler", "subscribers"])
def test_a_poison_event_is_an_error_once_then_a_reminder(
    caplog: pytest.LogCaptureFixture, fan_out: bool
) -> None:
    caplog.set_level(logging.INFO, logger="dbtrigger")
    source = MemorySource(
        [{"id": i, "seq": i} for i in (1, 2, 3)], cursor_column="seq", pk_columns=["id"]
    )
    clock = Clock()
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        clock=clock,
        max_attempts=2,
        retry_delay_seconds=0,
        **({"subscribers": {"good": accept, "stuck": retry_two}} if fan_out else {}),
    )
    handler = None if fan_out else retry_two

    def tick() -> None:
        assert trigger.tick(handler) >= 1
        clock.advance(60)

    tick()  # attempt 1: a retry, nothing said
    assert records(caplog, logging.ERROR) == []
    tick()  # attempt 2 of 2: poison now
    assert len(records(caplog, logging.ERROR)) == 1
    for _ in range(8):  # eight redeliveries within the reminder's period
        tick()
    assert len(records(caplog, logging.ERROR)) == 1
    reminders = records(caplog, logging.WARNING)
    assert len(reminders) == 1
    assert reminders[0].__dict__["events"] == 1
    assert reminders[0].__dict__["again"] is True
    clock.advance(POISON_REMINDER.total_seconds())
    tick()
    assert len(records(caplog, logging.WARNING)) == 2
    assert len(records(caplog, logging.ERROR)) == 1
