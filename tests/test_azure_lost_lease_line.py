"""What a @db.trigger invocation says when it loses its lease.

Its INFO line said "another instance holds the lease (LostLeaseError); this
invocation does nothing" whatever had happened: after a handler given up by
``handler_timeout_seconds`` (no other instance anywhere, the handler ran and
was cancelled) that was wrong twice over. It now says the lease was lost and
why, in the error's own words.
"""

from __future__ import annotations

import logging
import threading

import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import BatchContext, DbBindings, InMemoryCheckpointStore, RowChange
from dbtrigger.testing import MemorySource


def test_a_handler_given_up_is_not_reported_as_another_instance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    db = DbBindings()
    cancelled = threading.Event()

    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        name="orders",
        lease_ttl_seconds=4,
        handler_timeout_seconds=0.2,
    )
    def orders_poll(timer: object, events: list[RowChange], context: BatchContext) -> None:
        if context.lease_lost.wait(30):  # the timeout cancels the call (bounded)
            cancelled.set()

    caplog.set_level(logging.INFO, logger="dbtrigger")
    orders_poll(timer=TimerRequest(past_due=False))  # the invocation does not fail
    assert cancelled.is_set()
    (line,) = [r for r in caplog.records if getattr(r, "event", "") == "lease_contention"]
    text = line.getMessage()
    assert "another instance holds the lease" not in text
    assert "the lease was lost during this invocation (LostLeaseError: lease lost while" in text
