"""Heartbeat: a batch slower than the lease TTL keeps its lease; a lost lease stops it.

Real SQLite source, in-memory or file state behind a FaultyStore that counts
every storage operation. Timings are generous (the machine is shared); no
test asserts a duration, only outcomes and operation counts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest

from dbtrigger import (
    FileCheckpointStore,
    HandlerError,
    InMemoryCheckpointStore,
    LostLeaseError,
    RowChange,
)
from dbtrigger.errors import ConfigurationError
from dbtrigger.faults import Fault, FaultPlan, FaultyStore
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
    steal_lease,
    wait_for,
)


class Competitor:
    """Another instance ticking in a loop until stopped."""

    def __init__(self, trigger: object, handler: Recorder) -> None:
        self.trigger = trigger
        self.handler = handler
        self.outcomes: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.outcomes.append(self.trigger.tick_result(self.handler).outcome)  # type: ignore[attr-defined]
            except Exception as exc:
                self.errors.append(exc)

    def __enter__(self) -> Competitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_fast_batches_pay_no_heartbeat_and_idle_ticks_write_nothing(
    sqlite_db: TestDatabase,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 31))
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(
        items_source(sqlite_db),
        store,
        lease_ttl_seconds=3,
        max_batches_per_tick=3,
        heartbeat_interval_seconds=0.5,
    )
    assert trigger.tick(Recorder()) == 30
    # k = 3 batches: 1 read + 3 commits + 1 acquisition, no heartbeat.
    assert (store.plan.count("read"), store.plan.count("write")) == (1, 4)
    store.plan.reset_counts()
    assert trigger.tick(Recorder()) == 0
    assert (store.plan.count("read"), store.plan.count("write")) == (1, 0)


def test_handler_slower_than_ttl_keeps_its_lease_and_commits(sqlite_db: TestDatabase) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    store = FaultyStore(InMemoryCheckpointStore())
    ttl = 1.5
    slow = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=ttl, owner_id="slow")
    other = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=ttl, owner_id="other")
    competitor_handler = Recorder()

    def heartbeats() -> int:
        return sum(
            1
            for i in list(store.plan.calls)
            if i.call.op == "write"
            and i.call.document is not None
            and i.call.document.checkpoint is None
            and i.call.document.lease is not None
            and i.call.document.lease.heartbeat_at > i.call.document.lease.acquired_at
        )

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        # Well past the TTL and its grace window, and until three renewals
        # landed (waited for, bounded: a loaded machine renews later, not less).
        started = time.monotonic()
        wait_for(lambda: time.monotonic() - started >= 2.2 * ttl and heartbeats() >= 3, timeout=60)
        assert not ctx.cancelled

    with Competitor(other, competitor_handler) as competitor:
        result = slow.tick_result(handler)
    assert result.rows == 5
    assert competitor.errors == []
    assert competitor_handler.calls == 0, "the competitor stole a renewed lease"
    # lost_race: the competitor saw a late renewal as expiry and lost the CAS to it (load).
    assert set(competitor.outcomes) <= {"lease_busy", "idle", "lost_race"}
    doc = read_doc(store)
    assert doc.lease is not None
    assert (doc.lease.owner_id, doc.lease.fencing_token) == ("slow", 1), "token climbed"
    assert checkpoint_id(store) == 5
    assert heartbeats() >= 3


def test_without_competitor_a_batch_past_its_expired_lease_still_commits(
    sqlite_db: TestDatabase,
) -> None:
    """Even with renewal off: the etag proves nobody wrote, so the work is kept."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=0.2, heartbeat_interval_seconds=0
    )

    def handler(events: list[RowChange]) -> None:
        time.sleep(0.6)  # three TTLs

    assert trigger.tick(handler) == 3
    assert store.plan.count("write") == 2  # acquisition and commit, nothing else
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.fencing_token == 1
    assert checkpoint_id(store) == 3


def test_without_heartbeat_a_slow_batch_loses_its_lease_and_is_redelivered(
    sqlite_db: TestDatabase,
) -> None:
    """The seed's behaviour (5.8 / W4) when renewal is switched off."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = InMemoryCheckpointStore()
    ttl = 0.4
    slow = make_trigger(
        items_source(sqlite_db),
        store,
        lease_ttl_seconds=ttl,
        owner_id="slow",
        heartbeat_interval_seconds=0,
    )
    other = make_trigger(items_source(sqlite_db), store, lease_ttl_seconds=ttl, owner_id="other")
    competitor_handler = Recorder()
    seen: list[int] = []

    def handler(events: list[RowChange]) -> None:
        seen.extend(int(e.pk["id"]) for e in events)
        # Slow until the competitor has taken over and redelivered (bounded wait
        # for that outcome, not a fixed time a loaded machine may not honour).
        wait_for(lambda: competitor_handler.ids == [1, 2, 3], timeout=60)

    with Competitor(other, competitor_handler), pytest.raises(LostLeaseError):
        slow.tick(handler)
    assert seen == [1, 2, 3]
    assert competitor_handler.ids == [1, 2, 3], "the next owner redelivers the whole batch"
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.owner_id == "other"
    assert doc.lease.fencing_token == 2
    assert checkpoint_id(store) == 3


def test_rejected_heartbeat_cancels_the_batch_and_commits_nothing(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = FaultyStore(InMemoryCheckpointStore())
    trigger = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.2
    )
    observed: list[int] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        observed.append(ctx.fencing_token)
        steal_lease(store.inner)
        deadline = time.monotonic() + 10
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctx.lease_lost.is_set()

    with caplog.at_level(logging.WARNING, logger="dbtrigger"), pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert observed == [1]
    doc = read_doc(store)
    assert doc.checkpoint is None, "a commit went through after the lease was lost"
    assert doc.failure is None, "a lost lease is not a failed attempt"
    assert doc.lease is not None
    assert (doc.lease.owner_id, doc.lease.fencing_token) == ("thief", 2)
    assert any(getattr(r, "during", None) == "heartbeat" for r in caplog.records)


def test_handler_that_bails_out_on_cancel_reports_lost_lease_not_failure(
    sqlite_db: TestDatabase,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.2
    )

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        steal_lease(store)
        while not ctx.cancelled:
            time.sleep(0.01)
        raise RuntimeError("stopping: lease lost")

    with pytest.raises(LostLeaseError) as info:
        trigger.tick(handler)
    assert not isinstance(info.value, HandlerError)
    assert read_doc(store).failure is None


def _async_handler(store: InMemoryCheckpointStore, log: list[str]) -> object:
    async def handler(events: list[RowChange], ctx: BatchContext) -> None:
        log.append("started")
        steal_lease(store)
        try:
            await asyncio.sleep(30)
            log.append("side effect after sleep")
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        finally:
            log.append("cleanup")

    return handler


def test_async_handler_task_is_cancelled_when_the_lease_is_lost(
    sqlite_db: TestDatabase,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 3))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.2
    )
    log: list[str] = []
    with pytest.raises(LostLeaseError):
        trigger.tick(_async_handler(store, log))
    assert log == ["started", "cancelled", "cleanup"], "cleanup must finish before the tick ends"
    assert read_doc(store).checkpoint is None


def test_tick_async_cancels_the_handler_on_the_callers_loop(sqlite_db: TestDatabase) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 3))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.2
    )
    log: list[str] = []
    loops: list[asyncio.AbstractEventLoop] = []
    inner = _async_handler(store, log)

    async def handler(events: list[RowChange], ctx: BatchContext) -> None:
        loops.append(asyncio.get_running_loop())
        await inner(events, ctx)  # type: ignore[operator]

    async def main() -> None:
        with pytest.raises(LostLeaseError):
            await trigger.tick_async(handler)
        assert loops == [asyncio.get_running_loop()]

    asyncio.run(main())
    assert log == ["started", "cancelled", "cleanup"]
    assert read_doc(store).checkpoint is None


def test_tick_async_commits_a_normal_async_batch(sqlite_db: TestDatabase) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store)
    seen: list[int] = []

    async def handler(events: list[RowChange]) -> None:
        await asyncio.sleep(0)
        seen.extend(int(e.pk["id"]) for e in events)

    assert asyncio.run(trigger.tick_async(handler)) == 3
    assert seen == [1, 2, 3]
    assert checkpoint_id(store) == 3


def test_a_failed_renewal_is_not_a_lost_lease(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Storage down for one heartbeat: keep going, renew later, commit."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    plan = FaultPlan()
    # Every try of the first heartbeat fails (more than the retry policy allows).
    rule = plan.add(
        "write",
        Fault.UNAVAILABLE,
        times=3,
        match=lambda c: (
            c.document is not None
            and c.document.checkpoint is None
            and c.document.lease is not None
            and c.document.lease.heartbeat_at > c.document.lease.acquired_at
        ),
    )
    store = FaultyStore(FileCheckpointStore(tmp_path / "state"), plan)
    trigger = make_trigger(
        items_source(sqlite_db), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.3
    )

    def renewed() -> bool:  # a heartbeat landed after the three failed tries
        calls = list(store.plan.calls)
        failed = [n for n, i in enumerate(calls) if i.fault is Fault.UNAVAILABLE]
        return len(failed) == 3 and any(
            i.fault is None
            and i.call.op == "write"
            and i.call.document is not None
            and i.call.document.lease is not None
            and i.call.document.lease.heartbeat_at > i.call.document.lease.acquired_at
            for i in calls[failed[-1] + 1 :]
        )

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        wait_for(renewed, timeout=60)  # the outcome, not a fixed time
        assert not ctx.cancelled

    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        assert trigger.tick(handler) == 3
    assert rule.fired == 3
    assert any(getattr(r, "event", None) == "heartbeat_failed" for r in caplog.records)
    assert checkpoint_id(store) == 3


@pytest.mark.parametrize("interval", [1.5, 2.0, 5.0, -1.0])
def test_heartbeat_interval_must_stay_below_half_the_ttl(
    sqlite_db: TestDatabase, interval: float
) -> None:
    with pytest.raises(ConfigurationError, match="heartbeat_interval_seconds"):
        make_trigger(
            items_source(sqlite_db),
            InMemoryCheckpointStore(),
            lease_ttl_seconds=3,
            heartbeat_interval_seconds=interval,
        )


def test_heartbeat_default_is_a_third_of_the_ttl(sqlite_db: TestDatabase) -> None:
    trigger = make_trigger(items_source(sqlite_db), InMemoryCheckpointStore(), lease_ttl_seconds=90)
    assert trigger.heartbeat_interval == pytest.approx(30)
