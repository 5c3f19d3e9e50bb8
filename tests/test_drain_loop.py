"""The one drain loop (:func:`dbtrigger.runtime.drain.tick_until_drained`) under
every trigger: the old spelling of a partitioned poller drains as the member does,
and a poller's drain hears its stop as the queue's and a backfill's do."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger
from dbtrigger.errors import LostLeaseError
from dbtrigger.runtime.trigger import TickResult
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_source, items_table, make_trigger
from tests.test_partitions_poller import make_table, source

BOUND = 60.0  # seconds to reach an outcome: generous, a loaded machine is slower


def test_poll_trigger_with_partitions_drains_past_a_partition_taken_over(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A member's round whose partition was taken over mid-tick says ``lease_busy``
    with ``more`` (the new owner delivers its batch again): the member's drain ticks
    on. ``PollTrigger(partitions=N).drain()`` ran the poller's drain on those rounds
    and raised LeaseAcquireError ("the lease is held by another instance") though
    the member owns no lease of its own to wait for."""
    make_table(sqlite_db, 40)
    with pytest.warns(DeprecationWarning, match=r"PollTrigger\(partitions=N\) is deprecated"):
        trigger = PollTrigger(
            name="orders",
            source=source(sqlite_db),
            checkpoint_store=FileCheckpointStore(tmp_path / "state"),
            partitions=2,
            batch_size=10,
        )
    member = trigger.partitioned
    real = member.tick_result
    rounds: list[TickResult] = []

    def tick_result(*args: Any, **kwargs: Any) -> TickResult:
        # The first round: its partition was taken over mid-tick (and given back).
        result = TickResult(0, 0, "lease_busy", more=True) if not rounds else real(*args, **kwargs)
        rounds.append(result)
        return result

    member.tick_result = tick_result
    seen: list[int] = []
    try:
        assert trigger.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 40
    finally:
        trigger.close()
    assert sorted(seen) == list(range(1, 41))
    assert rounds[0].outcome == "lease_busy"
    assert rounds[-1].outcome == "idle"


def test_a_stop_lets_a_drain_go_of_a_call_given_up(sqlite_db: TestDatabase) -> None:
    """``handler_timeout_seconds`` gave a hung synchronous call up, and the caller set
    the drain's ``stop``: the drain went on waiting for the call (it ticked without
    ``should_stop``, so the call ran inline), for as long as it hung. The queue's
    drain, ``dbtrigger backfill`` and ``dbtrigger run`` let such a call go on a stop
    (LostLeaseError: nothing recorded, the rows come again); now so does the poller's."""
    add_items(sqlite_db, items_table(sqlite_db), range(1, 4))
    trigger = make_trigger(
        items_source(sqlite_db),
        InMemoryCheckpointStore(),
        lease_ttl_seconds=1,
        handler_timeout_seconds=0.3,
    )
    stop = threading.Event()
    release = threading.Event()
    outcome: list[object] = []

    def hang(events: Any, ctx: Any) -> None:
        while not ctx.cancelled:  # until given up at the timeout
            release.wait(0.01)
        stop.set()  # the caller's Ctrl-C
        release.wait(BOUND)  # and it hangs on

    def run() -> None:
        try:
            outcome.append(trigger.drain(hang, stop=stop))
        except Exception as exc:
            outcome.append(exc)

    drainer = threading.Thread(target=run, daemon=True)
    drainer.start()
    try:
        drainer.join(BOUND / 2)
        assert not drainer.is_alive(), "the stop did not end the drain while the call hung"
    finally:
        release.set()
        drainer.join(BOUND)
        trigger.close()
    assert [type(o) for o in outcome] == [LostLeaseError]
