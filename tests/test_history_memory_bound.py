"""The in-process history is bounded by a record count: the process's memory is its store."""

from __future__ import annotations

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.errors import ConfigurationError
from dbtrigger.history.memory import MemoryHistory
from dbtrigger.sources.memory import MemorySource


def test_a_long_running_poller_keeps_the_last_records_only() -> None:
    source = MemorySource(
        [{"id": i, "seq": i} for i in range(1, 61)], cursor_column="seq", pk_columns=["id"]
    )
    history = MemoryHistory(max_records=5)
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=2,
        history=history,
    )
    assert trigger.drain(lambda events: None) == 60
    records = list(history.read("orders"))
    assert [r["seq"] for r in records] == [26, 27, 28, 29, 30]  # 30 commits, the last 5 kept
    assert records[-1]["to"] is not None


def test_the_bound_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="max_records"):
        MemoryHistory(max_records=0)
