"""Runtime edges of the lease: a heartbeat that never lands gives the lease up at
its expiry, ``drain`` does not mistake someone else's lease for "drained", and a
handler's own keyword default is not taken for the context slot.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from pathlib import Path

import pytest

from dbtrigger import (
    BatchContext,
    FileCheckpointStore,
    LeaseAcquireError,
    LostLeaseError,
    PollTrigger,
    RowChange,
)
from dbtrigger.faults import Fault, FaultPlan, FaultyStore
from dbtrigger.runtime.kernel import wants_context
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import decide_acquire
from tests.databases import TestDatabase
from tests.test_runtime_state_errors import make_events


def test_a_heartbeat_that_never_lands_gives_the_lease_up_at_its_expiry(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store outage longer than the TTL: the cut-off owner stops instead of
    running its handler beside a new owner."""
    inner = FileCheckpointStore(tmp_path)
    plan = FaultPlan()
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 3),
        checkpoint_store=FaultyStore(inner, plan),
        lease_ttl_seconds=1.5,
        heartbeat_interval_seconds=0.3,
    )
    cancelled = threading.Event()
    started = threading.Event()

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        started.set()
        # The store goes down as the handler starts, for longer than the TTL.
        plan.add("*", Fault.UNAVAILABLE, times=None)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if ctx.cancelled:
                cancelled.set()
                return
            time.sleep(0.02)

    caplog.set_level(logging.WARNING)
    began = time.monotonic()
    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert started.is_set()
    assert cancelled.is_set()
    assert time.monotonic() - began < 10  # at the expiry, not at the handler's own end
    errors = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR and "without a renewal landing" in r.getMessage()
    ]
    assert errors
    plan.clear()
    stored = inner.read("orders")
    assert stored is not None
    assert docmod.loads(stored.data).checkpoint is None  # nothing committed


def _leased_by_other(store: FileCheckpointStore, trigger: PollTrigger, seconds: float) -> None:
    stored = store.read("orders")
    doc = docmod.loads(stored.data) if stored else None
    decided = decide_acquire(
        doc,
        poller="orders",
        fingerprint=trigger.source.fingerprint(),
        owner="other-host",
        now=dt.datetime.now(dt.timezone.utc),
        ttl=dt.timedelta(seconds=seconds),
    )
    assert not isinstance(decided, type(None))
    store.write("orders", docmod.dumps(decided.document), if_match=stored.etag if stored else None)


def test_drain_says_so_when_another_instance_holds_the_lease(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    store = FileCheckpointStore(tmp_path)
    trigger = PollTrigger(name="orders", source=make_events(sqlite_db, 3), checkpoint_store=store)
    _leased_by_other(store, trigger, 60)
    seen: list[RowChange] = []
    with pytest.raises(LeaseAcquireError, match="held by other-host") as info:
        trigger.drain(seen.extend)
    assert "lease_wait_seconds" in str(info.value)
    assert seen == []


def test_drain_waits_for_the_lease_when_asked(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    trigger = PollTrigger(name="orders", source=make_events(sqlite_db, 3), checkpoint_store=store)
    _leased_by_other(store, trigger, 0.5)
    seen: list[RowChange] = []
    assert trigger.drain(seen.extend, lease_wait_seconds=30) == 3
    assert [e.pk["id"] for e in seen] == [1, 2, 3]


def test_a_keyword_default_is_not_the_context_slot(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    received: list[object] = []

    def handler(events: list[RowChange], retries: int = 3) -> None:
        received.append(retries)

    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 3),
        checkpoint_store=FileCheckpointStore(tmp_path),
    )
    assert trigger.tick(handler) == 3
    assert received == [3]


def _two(events: list[RowChange], ctx: BatchContext) -> None: ...
def _defaulted(events: list[RowChange], retries: int = 3) -> None: ...
def _named(events: list[RowChange], ctx: object = None) -> None: ...
def _annotated(events: list[RowChange], c: BatchContext | None = None) -> None: ...
def _var(*args: object) -> None: ...
def _one(events: list[RowChange]) -> None: ...


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (_two, True),
        (_defaulted, False),
        (_named, True),
        (_annotated, True),
        (_var, True),
        (_one, False),
    ],
)
def test_wants_context_table(handler: object, expected: bool) -> None:
    assert wants_context(handler) is expected  # type: ignore[arg-type]
