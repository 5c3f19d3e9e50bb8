"""One name per concept on both triggers and their contexts (issue #21 item 6).

The shared options of :class:`PollTrigger` and :class:`QueueTrigger` are
listed here; an option only one trigger has must be listed as its own. A new
constructor parameter, or a concept spelled two ways, fails
:func:`test_the_triggers_share_one_name_per_concept` until it is sorted in.
The old spellings still work and say so with a ``DeprecationWarning``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import threading
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import ClaimContext, ClaimSource, PollTrigger, QueueTrigger, RowChange
from dbtrigger.errors import ConfigurationError
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext, EventContext
from dbtrigger.runtime.trigger import DEFAULT_MAX_BATCHES_PER_TICK, Trigger
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs

#: Options both triggers take, by one name.
SHARED = {
    "name",
    "source",
    "batch_size",
    "max_batches_per_tick",
    "max_concurrency",
    "heartbeat_interval_seconds",
    "max_attempts",
    "quarantine",
    "metrics",
    "retry_delay_seconds",
    "retry_delay_max_seconds",
    "owner_id",
    "handler_timeout_seconds",  # a hung handler call is given up (the lease or claim lapses)
}

#: A poller's own: its state document, lease, window, fan-out and partitions.
POLLER_ONLY = {
    "checkpoint_store",
    "lease_ttl_seconds",
    "clock",
    "journal_limit",
    "null_check_interval_seconds",
    "retry",
    "quarantine_limit",
    "partitions",
    "balance_interval_seconds",
    "member_ttl_seconds",
    "window_max_events",
    "window_max_bytes",
    "subscribers",
    "ack_timeout_seconds",
    "history",  # the durable history beside the state document (dbtrigger.history)
    "start_from",  # where a new poller starts (recorded in its state document at creation)
    "read_ahead",  # the next batch read while the handler and the commit run
    "bulk_reads",  # several batches of a catch-up read with one query (dbtrigger.runtime.bulk)
}

#: A queue's own: claims instead of a lease, and its wake-up hint.
QUEUE_ONLY = {"visibility_timeout_seconds", "seed", "notify_channel"}

#: Old spellings, accepted with a DeprecationWarning: old -> the one name.
QUEUE_DEPRECATED = {
    "dead_letter": "quarantine",
    "retry_backoff_seconds": "retry_delay_seconds",
    "retry_backoff_max_seconds": "retry_delay_max_seconds",
    "worker_id": "owner_id",
}

#: What both contexts offer a handler (the EventContext protocol).
CONTEXT_SHARED = ("batch_id", "poller_name", "owner_id", "cancelled")
CONTEXT_METHODS = ("reject", "retry", "attempts")


def parameters(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def test_the_triggers_share_one_name_per_concept() -> None:
    poll, queue = parameters(PollTrigger), parameters(QueueTrigger)
    assert poll == SHARED | POLLER_ONLY, "sort a new PollTrigger option in"
    assert queue == SHARED | QUEUE_ONLY | set(QUEUE_DEPRECATED), "sort a new QueueTrigger option in"
    assert not POLLER_ONLY & QUEUE_ONLY
    # A deprecated spelling names a shared concept, and the poller has only the new name.
    assert set(QUEUE_DEPRECATED.values()) <= SHARED
    assert not set(QUEUE_DEPRECATED) & poll


def test_shared_options_have_the_same_default_where_the_concept_is_the_same() -> None:
    poll = inspect.signature(PollTrigger.__init__).parameters
    queue = inspect.signature(QueueTrigger.__init__).parameters
    for option in ("batch_size", "max_batches_per_tick", "max_concurrency", "max_attempts"):
        assert poll[option].default == queue[option].default, option
    assert poll["max_batches_per_tick"].default == DEFAULT_MAX_BATCHES_PER_TICK == 1


@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_both_contexts_offer_one_protocol(method: str) -> None:
    def shape(cls: type) -> list[tuple[str, Any, Any]]:
        params = inspect.signature(getattr(cls, method)).parameters.values()
        return [(p.name, p.kind, p.default) for p in params]

    assert shape(ClaimContext) == shape(BatchContext) == shape(EventContext)


def claim_context() -> ClaimContext:
    return ClaimContext(
        queue_name="q",
        claim_token="c" * 32,
        owner_id="w",
        claimed_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        keys={},
        attempts={},
        lost=threading.Event(),
    )


def test_both_contexts_satisfy_the_protocol_and_name_the_same_attributes() -> None:
    ctx = claim_context()
    assert isinstance(ctx, EventContext)
    for attribute in CONTEXT_SHARED:
        assert hasattr(ctx, attribute), attribute
        assert attribute in BatchContext.__dataclass_fields__ or hasattr(BatchContext, attribute)
    assert (ctx.owner_id, ctx.poller_name, ctx.batch_id) == ("w", "q", "c" * 32)
    with pytest.warns(DeprecationWarning, match=r"ctx\.owner_id"):
        assert ctx.worker_id == "w"


def claim_source(db: TestDatabase) -> ClaimSource:
    return ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])


def test_the_old_queue_spellings_still_work_and_warn(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    make_jobs(sqlite_db, 2)
    source = claim_source(sqlite_db)
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    try:
        with pytest.warns(DeprecationWarning, match="is deprecated: use") as caught:
            queue = QueueTrigger(
                name="jobs",
                source=source,
                dead_letter=sink,
                retry_backoff_seconds=2.0,
                retry_backoff_max_seconds=20.0,
                worker_id="old-name",
            )
        said = " ".join(str(w.message) for w in caught)
        for old, new in QUEUE_DEPRECATED.items():
            assert f"QueueTrigger({old}=...) is deprecated: use {new}=" in said
        assert queue.quarantine is sink
        assert (queue.backoff.base_seconds, queue.backoff.cap_seconds) == (2.0, 20.0)
        assert queue.owner_id == "old-name"
        with pytest.warns(DeprecationWarning, match=r"\.quarantine"):
            assert queue.dead_letter is sink
        with pytest.warns(DeprecationWarning, match=r"\.owner_id"):
            assert queue.worker_id == "old-name"
        with pytest.raises(ConfigurationError, match="both worker_id= and owner_id="):
            QueueTrigger(name="jobs", source=source, worker_id="a", owner_id="b")
    finally:
        source.close()


def test_run_is_one_tick_on_both_triggers(sqlite_db: TestDatabase) -> None:
    """``run()`` is a timer firing: one tick of up to ``max_batches_per_tick``
    batches, on a queue as on a poller (it used to drain a queue)."""
    make_jobs(sqlite_db, 10)
    source = claim_source(sqlite_db)
    try:
        queue = QueueTrigger(name="jobs", source=source, batch_size=2, max_batches_per_tick=3)
        assert queue.run(handler=lambda events: None) == 6
        result = queue.tick_result(lambda events: None)
        assert (result.rows, result.batches, result.more) == (4, 2, False)
        assert queue.last_result == result
        assert queue.run(handler=lambda events: None) == 0
    finally:
        source.close()


def test_every_trigger_is_what_the_worker_drives(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 0)
    source = claim_source(sqlite_db)
    try:
        queue = QueueTrigger(name="jobs", source=source)
        assert isinstance(queue, Trigger)
        assert queue.rows_behind() is None
        stop = threading.Event()
        stop.set()
        assert queue.wait_for_work(5, stop) is False
        assert asyncio.run(queue.tick_async(lambda events: None)) == 0
        text, fields = queue.tick_result(lambda events: None).summary(5)
        assert text == "idle: nothing claimable"
        assert fields == {"rows": 0, "batches": 0}
    finally:
        source.close()


def test_a_handler_written_against_the_protocol_runs_under_both(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    make_jobs(sqlite_db, 3)
    seen: list[tuple[str, int]] = []

    def handle(events: list[RowChange], ctx: EventContext) -> None:
        for e in events:
            seen.append((ctx.owner_id, ctx.attempts(e)))

    source = claim_source(sqlite_db)
    try:
        assert QueueTrigger(name="jobs", source=source, owner_id="me").tick(handle) == 3
    finally:
        source.close()
    assert seen == [("me", 1)] * 3
