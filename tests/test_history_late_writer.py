"""A worker whose history append was held up (its process paused past its lease:
a frozen VM, a long GC pause) while another took the poller over and recorded
more than a journal's worth of commits: when the first resumes, its append finds
the history moved on by the newer lease, which recorded its commits (from its
journal, which continues the first one's). It appends nothing.

It used to look for its entries in the history's last records only, found none
there and took the history for behind: with its journal full (the steady state,
past 20 commits) it appended a ``gap`` record - a replay or rewind across it was
then refused, though nothing was missing - and then its whole journal again
after the newer worker's records, with a ``history_gap`` WARNING.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger
from dbtrigger.history import FileHistory, Retention
from tests.test_history_runtime import memory_source


class HeldHistory:
    """A file history whose appends wait, once ``hold`` is set, until ``release``."""

    def __init__(self, directory: Path) -> None:
        self.inner = FileHistory(directory)
        self.retention = Retention()
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if self.hold:
            self.entered.set()
            assert self.release.wait(timeout=60)
        self.inner.append(poller, records, after_seq=after_seq)

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        return self.inner.tail(poller, count)

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        return self.inner.read(poller, since_seq=since_seq)

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        return self.inner.prune(poller, retention, now)

    def describe(self) -> str:
        return self.inner.describe()


def test_a_late_append_after_a_takeover_adds_no_copies_out_of_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dbtrigger")
    state = tmp_path / "state"
    source = memory_source(60)
    held = HeldHistory(state)
    first = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(state),
        batch_size=1,
        history=held,
    )
    first.tick(lambda events: None)
    held.hold = True
    for _ in range(25):  # commits 2-26 (its journal of 20 full): the appends wait
        first.tick_result(lambda events: None)
    assert held.entered.wait(timeout=30)

    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)  # the lease ran out
    second = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(state),
        batch_size=1,
        clock=lambda: later,
    )
    second.drain(lambda events: None)  # commits 27-60, and records from its journal
    second.close()
    held.release.set()
    assert first.flush_history()
    first.close()

    # The second recorded what the first's journal still held (a gap where it held
    # no more), and the first appended nothing after it: no copy, nothing out of order.
    records = list(FileHistory(state).read("orders"))
    assert [r["type"] for r in records] == ["commit", "gap"] + ["commit"] * (len(records) - 2)
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    commits = [r["to"]["value"] for r in records if r["type"] == "commit"]
    assert commits == [1, *range(commits[1], 61)]  # from the oldest its journal held
    said = [r for r in caplog.records if getattr(r, "event", None) == "history_overtaken"]
    assert said


def test_a_state_document_made_anew_still_records_after_the_older_records(
    tmp_path: Path,
) -> None:
    """Its fencing tokens start again below those of the history's older records:
    those are older, not a later lease's, and its commits are appended after them."""
    state = tmp_path / "state"
    for _ in range(2):
        trigger = PollTrigger(
            name="orders",
            source=memory_source(30),
            checkpoint_store=FileCheckpointStore(state),
            batch_size=1,
        )
        trigger.drain(lambda events: None)
        trigger.close()
        (state / "orders.json").unlink()  # removed by hand; its history stays
    records = list(FileHistory(state).read("orders"))
    commits = [r for r in records if r["type"] == "commit"]
    assert [r["fencing_token"] for r in commits] == [*range(1, 31), *range(1, 31)]
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))


def test_a_hanging_history_store_is_waited_for_once_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An append that never returns (a network partition to the history's database):
    every tick() waited its flush's 10 s for it, and nothing was logged - it had not
    failed. Now one flush waits, says so (history_append_hung), and the next ones
    return at once until the append returns; then everything is recorded."""
    caplog.set_level(logging.INFO, logger="dbtrigger")
    held = HeldHistory(tmp_path)
    trigger = PollTrigger(
        name="orders",
        source=memory_source(30),
        checkpoint_store=FileCheckpointStore(tmp_path),
        batch_size=10,
        history=held,
    )
    trigger.tick(lambda events: None)
    held.hold = True
    trigger.tick_result(lambda events: None)
    assert held.entered.wait(timeout=30)
    recorder = trigger._driver.writer.history  # (its flush bound, shortened)
    assert recorder.flush(0.05) is False
    trigger.tick_result(lambda events: None)
    # If the next flush waited for the held append, the watchdog would let it go.
    watchdog = threading.Timer(5, held.release.set)
    watchdog.start()
    try:
        assert trigger.flush_history() is False
        assert not held.release.is_set()
    finally:
        watchdog.cancel()
    said = [r for r in caplog.records if getattr(r, "event", None) == "history_append_hung"]
    assert len(said) == 1
    assert said[0].levelno == logging.WARNING
    held.release.set()
    deadline = time.monotonic() + 30  # until the held append returns: then flushes wait
    while not recorder.flush(1):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    trigger.close()
    assert [r["rows"] for r in held.inner.read("orders")] == [10, 10, 10]
    assert [r for r in caplog.records if getattr(r, "event", None) == "history_append_returned"]
