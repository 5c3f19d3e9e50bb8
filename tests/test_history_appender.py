"""The history append is off the tick's path: commits queue their records, the
appender thread writes them, several commits in one append when the store is
slower than the commits; a flush (tick(), drain(), close(), the runner's stop)
waits for them; a queue that outgrows its bound drops details, not records.

No timings: a store whose append blocks on an Event shows that ticks complete
while the history is stuck, and what lands once it is let go.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import PollTrigger
from dbtrigger.history import FileHistory, HistoryStore, MemoryHistory, recorder
from dbtrigger.history.store import Retention
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.runtime.runner import Runner
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state.document import position_from_json
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.test_history_runtime import assert_chain, store_position

#: Bound on every wait for the appender thread (never reached when it works).
WAIT = 30.0


class GatedHistory:
    """A history store whose appends wait until ``gate`` is set; ``entered`` is set
    when an append is waiting. Records each append's size."""

    def __init__(self, inner: HistoryStore | None = None) -> None:
        self.inner = inner or MemoryHistory()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sizes: list[int] = []

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT), "the test never opened the gate"
        self.inner.append(poller, records, after_seq=after_seq)
        self.sizes.append(len(records))

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        return self.inner.tail(poller, count)

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        return self.inner.read(poller, since_seq=since_seq)

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        return self.inner.prune(poller, retention, now)

    def describe(self) -> str:
        return "gated"


def trigger_with(history: GatedHistory, rows: int = 50, **options: Any) -> PollTrigger:
    return PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i, "v": f"row {i}"} for i in range(1, rows + 1)],
            cursor_column="seq",
            pk_columns=["id"],
        ),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=10,
        history=history,
        **options,
    )


def records(history: GatedHistory) -> list[dict[str, Any]]:
    return list(history.inner.read("orders"))


def test_ticks_commit_while_the_history_append_is_blocked_and_one_append_catches_up() -> None:
    history = GatedHistory()
    trigger = trigger_with(history)
    try:
        assert trigger.tick_result(lambda events: None).rows == 10
        assert history.entered.wait(WAIT)  # the appender holds batch 1, stuck in the store
        for _ in range(4):  # the ticks do not wait for it
            assert trigger.tick_result(lambda events: None).rows == 10
        assert store_position(trigger.store).cursor == 50
        assert records(history) == []  # nothing written yet: the append is still blocked
        history.gate.set()
        assert trigger.flush_history()
        assert history.sizes == [1, 4]  # the four commits queued meanwhile: one append
        written = records(history)
        assert_chain(written, 50, store_position(trigger.store))
        assert all("detail" in r for r in written)  # each with its own detail
    finally:
        history.gate.set()
        trigger.close()


def test_tick_and_drain_return_with_their_history_written() -> None:
    history = GatedHistory()
    history.gate.set()
    trigger = trigger_with(history)
    assert trigger.tick(lambda events: None) == 10
    assert len(records(history)) == 1
    assert trigger.drain(lambda events: None) == 40
    assert_chain(records(history), 50, store_position(trigger.store))
    trigger.close()


def appender_threads() -> set[threading.Thread]:
    """The appender threads of pollers named ``orders`` in this process (other
    tests' included: under xdist one worker runs many tests)."""
    return {t for t in threading.enumerate() if t.name == "dbtrigger-history-orders"}


def test_run_returns_with_its_history_written_and_a_closed_trigger_ticks_again() -> None:
    """run() is a timer firing (a Functions invocation): the host may freeze the
    process once it returns, so the record is written by then; close() stops the
    appender thread, and the next commit starts it again."""
    others = appender_threads()  # of earlier tests' triggers, ending on their own
    history = GatedHistory()
    history.gate.set()
    trigger = trigger_with(history)
    assert trigger.run(handler=lambda events: None) == 10
    assert len(records(history)) == 1
    trigger.close()
    assert not appender_threads() - others
    assert trigger.tick(lambda events: None) == 10
    assert len(records(history)) == 2
    trigger.close()


def test_an_idle_appender_thread_ends_and_the_next_commit_starts_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trigger dropped without close() leaves no thread behind for long."""
    others = appender_threads()  # of earlier tests' triggers, ending on their own
    monkeypatch.setattr(recorder, "IDLE_SECONDS", 0.01)
    history = GatedHistory()
    history.gate.set()
    trigger = trigger_with(history)
    assert trigger.tick(lambda events: None) == 10
    for thread in appender_threads() - others:
        thread.join(WAIT)
        assert not thread.is_alive()
    assert trigger.tick(lambda events: None) == 10
    assert_chain(records(history), 20, store_position(trigger.store))
    trigger.close()


def test_close_waits_for_what_is_queued() -> None:
    history = GatedHistory()
    trigger = trigger_with(history)
    for _ in range(3):
        trigger.tick_result(lambda events: None)
    assert history.entered.wait(WAIT)
    history.gate.set()  # let go, and close at once: close must wait for the rounds
    trigger.close()
    assert_chain(records(history), 30, store_position(trigger.store))


def test_a_runner_stop_flushes_the_history() -> None:
    history = GatedHistory()
    trigger = trigger_with(history)
    ticks: list[int] = []

    def on_tick(result: Any) -> None:
        ticks.append(result.rows)
        if len(ticks) == 5:
            history.gate.set()  # the last commit is in: let the appender go, then stop

    runner = Runner(trigger, lambda events: None, interval_seconds=0, on_tick=on_tick)
    runner.run(max_ticks=5, install_signals=False)
    assert ticks == [10] * 5
    assert_chain(records(history), 50, store_position(trigger.store))


def test_a_store_behind_by_more_than_the_journal_still_gets_every_commit() -> None:
    """The queued documents' journals chain: eight commits while the store is stuck,
    with a journal of three, all land, each with its detail, and no gap."""
    history = GatedHistory()
    trigger = trigger_with(history, rows=80, journal_limit=3)
    try:
        trigger.tick_result(lambda events: None)
        assert history.entered.wait(WAIT)
        for _ in range(7):
            trigger.tick_result(lambda events: None)
        history.gate.set()
        assert trigger.flush_history()
        written = records(history)
        assert_chain(written, 80, store_position(trigger.store))
        assert all("detail" in r for r in written)
    finally:
        history.gate.set()
        trigger.close()


def test_details_past_their_bound_are_let_go_and_the_records_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queue keeps the details of two 10-row batches: with the store stuck on
    batch 1, batches 2-4 lose theirs, and are recorded without (as recovered)."""
    monkeypatch.setattr(recorder, "PENDING_DETAIL_BYTES", 2 * (256 + recorder.EVENT_BYTES * 10))
    history = GatedHistory()
    metrics = InMemoryMetrics()
    trigger = trigger_with(history, rows=60, metrics=metrics)
    try:
        trigger.tick_result(lambda events: None)
        assert history.entered.wait(WAIT)
        for _ in range(5):
            trigger.tick_result(lambda events: None)
        history.gate.set()
        assert trigger.flush_history()
        written = records(history)
        assert_chain(written, 60, store_position(trigger.store))
        assert ["detail" in r for r in written] == [True, False, False, False, True, True]
        assert metrics.total("history_queue_overflow_total") == 3
    finally:
        history.gate.set()
        trigger.close()


def test_commits_past_the_queue_bound_come_from_the_journal_or_a_gap_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queue holds two commits: with the store stuck on batch 1, batches 2-6
    leave it; 4-6 are still in the journals of the queued documents (four entries
    each) and come back from them without their detail, 2-3 are not, and a gap
    record marks them."""
    monkeypatch.setattr(recorder, "MAX_PENDING", 2)
    history = GatedHistory()
    trigger = trigger_with(history, rows=100, journal_limit=4)
    try:
        trigger.tick_result(lambda events: None)
        assert history.entered.wait(WAIT)
        for _ in range(7):
            trigger.tick_result(lambda events: None)
        history.gate.set()
        assert trigger.flush_history()
        written = records(history)
        assert [r["type"] for r in written] == ["commit", "gap"] + ["commit"] * 5
        # batches 4-8: batch 4 from the oldest queued journal (batch 7's), none twice
        froms = [position_from_json(r["from"]).cursor for r in written[2:]]
        assert froms == [30, 40, 50, 60, 70]
        assert ["detail" in r for r in written] == [True, False, False, False, False, True, True]
    finally:
        history.gate.set()
        trigger.close()


def test_without_a_journal_the_queued_commits_are_all_recorded() -> None:
    history = GatedHistory()
    trigger = trigger_with(history, journal_limit=0)
    try:
        trigger.tick_result(lambda events: None)
        assert history.entered.wait(WAIT)
        for _ in range(4):
            trigger.tick_result(lambda events: None)
        history.gate.set()
        assert trigger.flush_history()
        assert history.sizes == [1, 4]
        assert [r["rows"] for r in records(history)] == [10] * 5
    finally:
        history.gate.set()
        trigger.close()


def test_a_file_history_rolls_its_segments_within_one_append(tmp_path: Path) -> None:
    """A round of several records rolls over where one record an append would:
    segments stay about segment_bytes, which retention prunes by."""
    history = FileHistory(tmp_path, segment_bytes=1024)
    records = [{"id": str(i), "type": "commit", "note": "x" * 300} for i in range(10)]
    history.append("orders", records, after_seq=0)
    segments = sorted(tmp_path.glob("orders.history.*.jsonl"))
    assert len(segments) > 2
    assert all(p.stat().st_size < 1024 + 400 for p in segments)
    assert [r["seq"] for r in history.read("orders")] == list(range(1, 11))
    history.append("orders", records[:1], after_seq=10)
    assert [r["seq"] for r in history.tail("orders", 2)] == [10, 11]


def test_commits_wake_the_appender_only_when_it_has_something_to_do() -> None:
    """A wake-up costs the committing thread the GIL twice: commits queued while the
    appender is busy wake it only at the first commit queued and at a store write's
    worth (APPEND_RECORDS), not each one; all of them are written."""
    history = GatedHistory()
    trigger = trigger_with(history, rows=100)
    appender = trigger._driver.writer.history
    assert isinstance(appender, recorder.HistoryRecorder)
    wakes = 0
    notify_all = appender._cond.notify_all

    def counted() -> None:
        nonlocal wakes
        wakes += 1
        notify_all()

    try:
        trigger.tick_result(lambda events: None)
        assert history.entered.wait(WAIT)  # the appender is stuck in batch 1's append
        appender._cond.notify_all = counted  # type: ignore[method-assign]
        for _ in range(9):  # queued: 1, 2, ... 9
            trigger.tick_result(lambda events: None)
        assert wakes == 2  # at 1 and at APPEND_RECORDS (8)
        history.gate.set()
        assert trigger.flush_history()
        assert_chain(records(history), 100, store_position(trigger.store))
    finally:
        history.gate.set()
        trigger.close()
