"""The runtime tells a source that holds data (a replication slot) what is durably checkpointed.

``AcknowledgesCheckpoints.acknowledge(position)`` must be called only with a
position the state document holds *after* the write landed: after a commit,
after a partial commit, and on an idle tick with the stored checkpoint; never
for a batch whose commit failed. These run on the in-memory log source, so the
order of "write landed" and "acknowledged" is checked exactly.
"""

from __future__ import annotations

import logging

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import CommitError, DbTriggerError, HandlerError, PartialBatchError
from dbtrigger.faults import Fault, FaultPlan, FaultRule, FaultyStore
from dbtrigger.state import document as docmod
from dbtrigger.testing import MemoryLogSource


class Recording(MemoryLogSource):
    """Checks, at each acknowledgement, that the store already holds that checkpoint."""

    def __init__(self, store: InMemoryCheckpointStore) -> None:
        super().__init__("memory:orders")
        self.store = store
        self.stored_at_ack: list[Position] = []
        self.bound: list[tuple[str, object]] = []

    def acknowledge(self, position: Position) -> None:
        stored = self.store.read("orders")
        self.stored_at_ack.append(docmod.loads(stored.data).position if stored else BEGINNING)
        super().acknowledge(position)

    def bind_poller(self, name: str, metrics: object = None) -> None:
        self.bound.append((name, metrics))


def insert(source: MemoryLogSource, *keys: int) -> None:
    source.commit([{"op": "insert", "pk": {"id": k}, "after": {"id": k}} for k in keys])


def trigger(source: MemoryLogSource, store: object, **kw: object) -> PollTrigger:
    options: dict[str, object] = {"batch_size": 3, "retry": RetryPolicy.none()}
    options.update(kw)
    return PollTrigger(name="orders", source=source, checkpoint_store=store, **options)  # type: ignore[arg-type]


def ordinal(position: Position) -> tuple[str, int]:
    lp = LogPosition.of(position)
    assert lp is not None
    return lp.commit, lp.ordinal


def test_each_commit_is_acknowledged_after_it_landed() -> None:
    store = InMemoryCheckpointStore()
    source = Recording(store)
    insert(source, 1, 2, 3, 4, 5)  # one five-row transaction
    poller = trigger(source, store, max_batches_per_tick=5)
    assert source.bound
    assert source.bound[0][0] == "orders"
    assert poller.tick(lambda events: None) == 5
    assert [ordinal(p) for p in source.acknowledged] == [
        ("0000000000000001", 3),
        ("0000000000000001", 5),
    ]
    assert source.stored_at_ack == source.acknowledged  # durable before it was acknowledged


def test_an_idle_tick_acknowledges_the_stored_checkpoint() -> None:
    store = InMemoryCheckpointStore()
    source = Recording(store)
    poller = trigger(source, store)
    assert poller.tick(lambda events: None) == 0
    assert source.acknowledged == [BEGINNING]  # nothing delivered, nothing to hold
    insert(source, 1)
    poller.tick(lambda events: None)
    source.acknowledged.clear()
    assert poller.tick(lambda events: None) == 0
    assert [ordinal(p) for p in source.acknowledged] == [("0000000000000001", 1)]


def test_a_failed_commit_acknowledges_nothing() -> None:
    inner = InMemoryCheckpointStore()
    plan = FaultPlan([FaultRule("write", Fault.UNAVAILABLE, times=None, skip=1)])
    store = FaultyStore(inner, plan)  # the lease write lands, every later write fails
    source = Recording(inner)
    insert(source, 1, 2)
    with pytest.raises(CommitError):
        trigger(source, store).tick(lambda events: None)
    assert source.acknowledged == []


def test_a_partial_commit_acknowledges_the_part_that_landed() -> None:
    store = InMemoryCheckpointStore()
    source = Recording(store)
    insert(source, 1, 2, 3)

    def handler(events: list[object]) -> None:
        raise PartialBatchError([{"id": 2}])

    with pytest.raises(HandlerError):
        trigger(source, store).tick(handler)
    assert [ordinal(p) for p in source.acknowledged] == [("0000000000000001", 1)]
    assert source.stored_at_ack == source.acknowledged


def test_a_failed_batch_acknowledges_nothing_new() -> None:
    store = InMemoryCheckpointStore()
    source = Recording(store)
    insert(source, 1, 2)

    def handler(events: list[object]) -> None:
        raise RuntimeError("down")

    with pytest.raises(HandlerError):
        trigger(source, store).tick(handler)
    assert source.acknowledged == []


def test_a_source_that_cannot_release_does_not_fail_the_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = InMemoryCheckpointStore()

    class Failing(MemoryLogSource):
        def acknowledge(self, position: Position) -> None:
            raise DbTriggerError("slot busy")

    source = Failing("memory:orders")
    insert(source, 1)
    with caplog.at_level(logging.WARNING, logger="dbtrigger.runtime"):
        assert trigger(source, store).tick(lambda events: None) == 1
    assert [r.event for r in caplog.records] == ["acknowledge_failed"]  # type: ignore[attr-defined]
    assert docmod.loads(store.read("orders").data).position.cursor is not None  # type: ignore[union-attr]


def test_per_event_retries_hold_the_acknowledged_position_back() -> None:
    store = InMemoryCheckpointStore()
    source = Recording(store)
    insert(source, 1, 2, 3)
    poller = trigger(source, store, retry_delay_seconds=0, retry_delay_max_seconds=0)

    def handler(events: list[object], ctx: object) -> None:
        for event in events:
            if event.pk["id"] == 2:  # type: ignore[attr-defined]
                ctx.retry(event, "later")  # type: ignore[attr-defined]

    poller.tick(handler)
    # Key 1 settled; key 2 waits (key 3 is settled above it, in the window).
    assert [ordinal(p) for p in source.acknowledged] == [("0000000000000001", 1)]
    poller.tick(lambda events: None)
    assert ordinal(source.acknowledged[-1]) == ("0000000000000001", 3)
    assert source.stored_at_ack == source.acknowledged
