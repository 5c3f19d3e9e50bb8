"""The one drain loop (:func:`dbtrigger.runtime.drain.tick_until_drained`) under
every trigger: the old spelling of a partitioned poller drains as the member does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger
from dbtrigger.runtime.trigger import TickResult
from tests.databases import TestDatabase
from tests.test_partitions_poller import make_table, source


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
