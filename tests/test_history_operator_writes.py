"""An operator's write (a replay's journal entry, a reset, a bookmark) while a poller
runs: the poller's latest commit, journaled but still on its way to the history
through the appender, keeps its per-event detail - the operator's write waits
(bounded) for it instead of recording it from the journal without.
"""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger
from dbtrigger.history import FileHistory, history_for, wiring
from dbtrigger.replay import batches as rp
from dbtrigger.testing import MemorySource


class Gated(FileHistory):
    """A history whose appender thread waits at ``gate`` (a slow store)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.gate = threading.Event()

    def append(self, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith("dbtrigger-history-"):
            assert self.gate.wait(60)
        FileHistory.append(self, *args, **kwargs)


def test_a_replay_journaled_while_a_commit_is_being_recorded_leaves_it_its_detail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    store = FileCheckpointStore(state)
    history = Gated(state)
    source = MemorySource(
        [{"id": i, "seq": i} for i in range(1, 21)], cursor_column="seq", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=10, history=history
    )
    history.gate.set()
    trigger.tick(lambda events: None)  # recorded, detail and all
    history.gate.clear()
    assert trigger.tick_result(lambda events: None).rows == 10  # queued for the appender

    # The appender is let through once the operator's write has either appended
    # or looked at the history twice (it waits for the commit to be recorded).
    real_tail, real_append = FileHistory.tail, FileHistory.append
    looks = [0]

    def tail(self: FileHistory, poller: str, count: int) -> list[dict[str, Any]]:
        if threading.current_thread() is threading.main_thread():
            looks[0] += 1
            if looks[0] == 2:
                history.gate.set()
        return real_tail(self, poller, count)

    def append(self: FileHistory, *args: Any, **kwargs: Any) -> None:
        real_append(self, *args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            history.gate.set()

    monkeypatch.setattr(FileHistory, "tail", tail)
    monkeypatch.setattr(FileHistory, "append", append)
    monkeypatch.setattr(wiring, "WRITER_WAIT_SECONDS", 60.0, raising=False)  # met at once
    entry = rp.manual_entry(
        "replay",
        doc_position=None,
        actor="ops",
        reason="reindex",
        now=dt.datetime.now(dt.timezone.utc),
        details={"batches": []},
    )
    assert rp.journal_live(store, "orders", entry) is None
    assert trigger.flush_history()
    recorded = history_for(store)
    assert recorded is not None
    records = list(recorded.read("orders"))
    assert [r["type"] for r in records] == ["commit", "commit", "manual"]
    assert ["detail" in r for r in records[:2]] == [True, True]
    assert [r["seq"] for r in records] == [1, 2, 3]
