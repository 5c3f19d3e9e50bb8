"""Per-event outcomes: ``ctx.reject`` and ``ctx.retry`` on real databases and stores.

A retried event pins the checkpoint across batches, ticks and restarts while
later events keep flowing; a rejected one goes to the dead-letter sink; the
window of settled events above the checkpoint is persisted and bounded.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, HandlerError, PollTrigger, RowChange
from dbtrigger.cli.main import _print_error as print_error
from dbtrigger.errors import ConfigurationError, PartialBatchError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.window import Window
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    bump,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
)
from tests.test_blob_store import make_store, new_container

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class Clock:
    """A clock the test moves; the lease TTL and retry backoff both read it."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


@dataclass
class Scripted:
    """A handler driven by a script: pk -> list of outcomes, one per delivery
    ("accept", "reject", "retry"); past the end of a list, accept."""

    script: dict[int, list[str]] = field(default_factory=dict)
    seen: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    attempts: dict[int, list[int]] = field(default_factory=dict)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            pk = int(e.pk["id"])
            self.seen.append(pk)
            self.attempts.setdefault(pk, []).append(ctx.attempts(e))
            plan = self.script.get(pk, [])
            n = self.seen.count(pk) - 1
            what = plan[n] if n < len(plan) else "accept"
            if what == "reject":
                ctx.reject(e, f"bad item {pk}")
            elif what == "retry":
                ctx.retry(e, f"busy {pk}")
            else:
                self.accepted.append(pk)


def dead_letters(sink: JsonLinesQuarantineSink) -> list[tuple[int, str, int]]:
    return sorted((int(r.pk["id"]), r.error, r.attempts) for r in sink.records())


@pytest.fixture(params=["file", "blob"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    """The local file store and the Blob store (on Azurite)."""
    if request.param == "file":
        yield FileCheckpointStore(tmp_path / "state")
        return
    azurite = request.getfixturevalue("azurite")
    for container in new_container(azurite):
        blob = make_store(azurite, container)
        yield blob
        blob.close()


def trigger_for(
    db: TestDatabase,
    store: CheckpointStore,
    clock: Clock,
    tmp_path: Path,
    **kwargs: Any,
) -> tuple[PollTrigger, JsonLinesQuarantineSink]:
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    kwargs.setdefault("quarantine", sink)
    kwargs.setdefault("retry_delay_seconds", 10)
    trigger = make_trigger(items_source(db), store, clock=clock, **kwargs)
    return trigger, sink


# --- reject ---------------------------------------------------------------------------


def test_reject_dead_letters_the_event_and_moves_on(
    db: TestDatabase, store: CheckpointStore, tmp_path: Path
) -> None:
    table = items_table(db)
    add_items(db, table, range(1, 8))
    clock = Clock()
    metrics = InMemoryMetrics()
    trigger, sink = trigger_for(db, store, clock, tmp_path, metrics=metrics)
    handler = Scripted({3: ["reject"], 5: ["reject"]})

    assert trigger.drain(handler) == 7
    assert handler.accepted == [1, 2, 4, 6, 7]
    assert dead_letters(sink) == [
        (3, "EventRejected: bad item 3", 1),
        (5, "EventRejected: bad item 5", 1),
    ]
    assert checkpoint_id(store) == 7
    doc = read_doc(store)
    assert doc.window is None  # nothing pinned: no window in the document
    assert doc.journal[-1]["outcomes"] == {"accepted": 5, "rejected": 2, "failed": 0}
    assert metrics.total("event_outcomes_total", outcome="rejected") == 2
    assert metrics.total("event_outcomes_total", outcome="accepted") == 5
    assert metrics.total("quarantined_total") == 2
    # Never delivered again.
    assert trigger.drain(handler) == 0
    assert handler.seen == [1, 2, 3, 4, 5, 6, 7]


def test_reject_without_a_sink_is_a_configuration_error_at_the_first_call(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    store = FileCheckpointStore(tmp_path / "state")
    trigger, _ = trigger_for(sqlite_db, store, Clock(), tmp_path, quarantine=None)
    swallowed: list[Exception] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        try:
            ctx.reject(events[0], "nope")
        except ConfigurationError as exc:
            swallowed.append(exc)  # even a swallowed misuse fails the tick

    with pytest.raises(ConfigurationError, match="dead-letter sink"):
        trigger.tick(handler)
    assert len(swallowed) == 1
    assert "pk {'id': 1}" in str(swallowed[0])
    doc = read_doc(store)
    assert doc.checkpoint is None  # nothing settled, nothing skipped
    assert doc.lease is not None
    assert doc.lease.released


def test_a_misuse_the_handler_lets_through_is_not_its_own_cause(
    sqlite_db: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The misuse was raised ``from`` the handler's exception, which was the misuse
    itself: a cause chain with a cycle, and the CLI's error printer (which walks
    the chain) looped for ever at 100% CPU (``dbtrigger backfill`` of a handler
    calling ctx.reject with no dead-letter sink never exited)."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1])
    trigger, _ = trigger_for(
        sqlite_db, FileCheckpointStore(tmp_path / "state"), Clock(), tmp_path, quarantine=None
    )

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        ctx.reject(events[0], "nope")

    with pytest.raises(ConfigurationError, match="dead-letter sink") as raised:
        trigger.tick(handler)
    assert raised.value.__cause__ is not raised.value
    # And the printer stops at a cycle it meets anyway.
    looped = ConfigurationError("outer")
    inner = ValueError("inner")
    looped.__cause__, inner.__cause__ = inner, looped
    print_error(looped)
    assert capsys.readouterr().err.splitlines() == [
        "error: outer",
        "  caused by ValueError: inner",
    ]


@pytest.mark.parametrize("kind", ["reject", "retry"])
def test_marking_an_event_of_another_batch_names_it(
    sqlite_db: TestDatabase, tmp_path: Path, kind: str
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    trigger, _ = trigger_for(sqlite_db, store, Clock(), tmp_path, batch_size=2)
    first: list[RowChange] = []
    kept: list[BatchContext] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if not first:
            first.extend(events)
            kept.append(ctx)
            return
        getattr(ctx, kind)(first[0], "stale")

    trigger.tick(handler)
    with pytest.raises(ConfigurationError, match=rf"ctx.{kind}\(\) on event {first[0].event_id}"):
        trigger.tick(handler)
    with pytest.raises(ConfigurationError, match="after the handler returned"):
        getattr(kept[0], kind)(first[0], "too late")
    assert checkpoint_id(store) == 2


# --- retry ----------------------------------------------------------------------------


def test_retry_pins_the_checkpoint_while_later_events_flow(
    db: TestDatabase, store: CheckpointStore, tmp_path: Path
) -> None:
    table = items_table(db)
    add_items(db, table, range(1, 11))
    clock = Clock()
    metrics = InMemoryMetrics()
    trigger, sink = trigger_for(db, store, clock, tmp_path, batch_size=4, metrics=metrics)
    handler = Scripted({2: ["retry", "retry"]})

    # Batch 1..4: 2 asks for a retry; 3, 4 are settled into the window.
    assert trigger.tick(handler) == 4
    assert checkpoint_id(store) == 1
    window = read_doc(store).window or Window()
    assert [int(p.pk["id"]) for p in window.settled] == [3, 4]
    [pending] = window.pending
    assert (int(pending.position.pk["id"]), pending.attempts) == (2, 1)
    # Exponential backoff with jitter: 10 s for the first retry, times [0.5, 1).
    assert T0 + dt.timedelta(seconds=5) <= pending.not_before < T0 + dt.timedelta(seconds=10)
    assert metrics.gauge("window_events") == 3

    # Later events keep flowing; 2 is not due yet and is not delivered.
    assert trigger.tick(handler) == 4
    assert handler.seen == [1, 2, 3, 4, 5, 6, 7, 8]
    assert checkpoint_id(store) == 1  # still pinned by 2

    clock.advance(11)  # 2 is due again: retried a second time (backoff doubles)
    assert trigger.tick(handler) == 3  # 2, and the new rows 9, 10
    assert handler.seen[-3:] == [2, 9, 10]
    pending = (read_doc(store).window or Window()).pending[0]
    assert pending.attempts == 2
    assert clock.now + dt.timedelta(seconds=10) <= pending.not_before
    assert pending.not_before < clock.now + dt.timedelta(seconds=20)
    assert checkpoint_id(store) == 1

    assert trigger.tick_result(handler).outcome == "idle"  # only 2 remains, not due
    clock.advance(21)
    assert trigger.tick(handler) == 1  # accepted at last: the checkpoint jumps
    assert checkpoint_id(store) == 10
    assert read_doc(store).window is None
    assert sorted(handler.accepted) == list(range(1, 11))
    assert handler.attempts[2] == [1, 2, 3]
    assert dead_letters(sink) == []
    assert metrics.total("event_outcomes_total", outcome="failed") == 2
    assert metrics.gauge("window_events") == 0


def test_retry_survives_a_restart_and_settled_events_are_not_redelivered(
    db: TestDatabase, store: CheckpointStore, tmp_path: Path
) -> None:
    table = items_table(db)
    add_items(db, table, range(1, 7))
    clock = Clock()
    trigger, _ = trigger_for(db, store, clock, tmp_path, batch_size=6)
    handler = Scripted({3: ["retry"]})
    assert trigger.tick(handler) == 6
    assert checkpoint_id(store) == 2

    # A new process: same store, new trigger object, new owner.
    clock.advance(60)
    restarted, _ = trigger_for(db, store, clock, tmp_path, batch_size=6)
    again = Scripted()
    assert restarted.drain(again) == 1
    assert again.seen == [3]  # only the pinned event; 4..6 were settled
    assert checkpoint_id(store) == 6


def test_a_retried_event_is_dead_lettered_after_max_attempts(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    trigger, sink = trigger_for(sqlite_db, store, clock, tmp_path, max_attempts=3)
    handler = Scripted({2: ["retry"] * 10})
    for _ in range(5):
        trigger.tick(handler)
        clock.advance(3600)
    assert handler.seen.count(2) == 3
    assert dead_letters(sink) == [(2, "RetriesExhausted: busy 2", 3)]
    assert checkpoint_id(store) == 3
    assert read_doc(store).window is None


def test_without_a_sink_an_exhausted_retry_keeps_pinning_loudly(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    trigger, _ = trigger_for(sqlite_db, store, clock, tmp_path, max_attempts=2, quarantine=None)
    handler = Scripted({2: ["retry"] * 10})
    for _ in range(4):
        trigger.tick(handler)
        clock.advance(3600)
    assert handler.seen.count(2) == 4
    assert checkpoint_id(store) == 1  # never passes the unsettled event
    assert any(getattr(r, "event", None) == "poison_event" for r in caplog.records)


def test_rows_updated_or_committed_late_inside_the_window_are_delivered(
    db: TestDatabase, store: CheckpointStore, tmp_path: Path
) -> None:
    table = items_table(db)
    add_items(db, table, [1, 2, 3, 5])  # versions 10, 20, 30, 50
    clock = Clock()
    trigger, _ = trigger_for(db, store, clock, tmp_path, batch_size=10)
    handler = Scripted({1: ["retry"]})
    assert trigger.tick(handler) == 4
    # 3 is updated to a new cursor, and 4 commits late at version 40 (below 50).
    bump(db, table, 3, 60)
    add_items(db, table, [4])
    assert trigger.tick(handler) == 2
    assert handler.seen[-2:] == [4, 3]  # late row, then the row at its new cursor
    clock.advance(30)
    assert trigger.drain(handler) == 1
    assert checkpoint_id(store) == 3
    assert read_doc(store).window is None


# --- the bound ------------------------------------------------------------------------


def test_the_window_stops_fetching_at_75_percent_and_drains(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 41))
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    trigger, _ = trigger_for(sqlite_db, store, clock, tmp_path, batch_size=5, window_max_events=8)
    handler = Scripted({1: ["retry"]})
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        for _ in range(6):
            trigger.tick(handler)
    doc = read_doc(store)
    window = doc.window or Window()
    assert len(window) <= 8
    assert len(window) >= 6  # it filled up to the pressure mark, then stopped
    assert max(handler.seen) < 10
    # Said once, when it started to block, not on each of the ticks since.
    blocked = [r for r in caplog.records if getattr(r, "event", None) == "window_blocked"]
    assert len(blocked) == 1
    assert blocked[0].levelno == logging.WARNING
    clock.advance(60)
    assert trigger.drain(handler) > 0
    assert checkpoint_id(store) == 40
    assert sorted(set(handler.accepted)) == list(range(1, 41))


def test_a_window_full_of_rows_that_are_gone_is_tidied_without_a_delivery(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    trigger, _ = trigger_for(sqlite_db, store, clock, tmp_path)
    handler = Scripted({1: ["retry"]})
    trigger.tick(handler)
    assert read_doc(store).position.is_beginning  # pinned before the first row
    with sqlite_db.engine.begin() as conn:  # the pinned row is deleted
        conn.execute(sa.delete(table).where(table.c.id == 1))
    result = trigger.tick_result(handler)
    assert (result.outcome, result.rows) == ("committed", 0)
    assert checkpoint_id(store) == 3
    assert read_doc(store).window is None
    assert handler.seen == [1, 2, 3]


def test_the_window_is_an_optional_field_older_readers_ignore(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    store = FileCheckpointStore(tmp_path / "state")
    trigger, _ = trigger_for(sqlite_db, store, Clock(), tmp_path)
    trigger.tick(Scripted({1: ["retry"]}))
    stored = store.read("items")
    assert stored is not None
    raw = json.loads(stored.data)
    assert raw["version"] == 1
    assert set(raw["window"]) == {"settled", "pending", "bound"}
    assert raw["window"]["bound"] == {"max_events": 1000, "max_bytes": 48 * 1024}  # for status
    assert raw["window"]["pending"][0]["reason"] == "busy 1"


def test_marks_survive_a_partial_batch_error_and_stay_unsettled(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A handler that marks e1 for retry and then names e3 as failed must not
    have e1 counted as processed: both come back, nothing is skipped."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3, 4])
    store = FileCheckpointStore(tmp_path / "state")
    trigger, _ = trigger_for(sqlite_db, store, Clock(), tmp_path)
    calls: list[list[int]] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        calls.append([int(e.pk["id"]) for e in events])
        if len(calls) == 1:
            ctx.retry(events[0], "busy")
            raise PartialBatchError([events[2].pk])

    with pytest.raises(HandlerError):
        trigger.tick(handler)
    assert read_doc(store).position.is_beginning  # 1 is not settled: no advance
    trigger.tick(handler)
    assert calls == [[1, 2, 3, 4], [1, 3]]  # 2 and 4 were processed and are skipped
    assert checkpoint_id(store) == 4


def test_a_failed_call_takes_its_marks_with_it(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """The whole batch's call rejects 1, then fails on the poison row 3: that
    reject is taken back with the failed call, so bisection sets aside 3 alone
    and 1 is delivered (its own part's call made no mark)."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3, 4])
    store = FileCheckpointStore(tmp_path / "state")
    trigger, sink = trigger_for(sqlite_db, store, Clock(), tmp_path, max_attempts=1)
    calls: list[list[int]] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        pks = [int(e.pk["id"]) for e in events]
        calls.append(pks)
        if len(calls) == 1:
            ctx.reject(events[0], "rejected by a call that failed")
        if 3 in pks:
            raise RuntimeError("poison 3")

    assert trigger.tick(handler) == 4
    assert calls == [[1, 2, 3, 4], [1, 2], [3, 4], [3], [4]]
    assert dead_letters(sink) == [(3, "RuntimeError: poison 3", 1)]
    assert checkpoint_id(store) == 4
