"""Fan-out subscribers that cannot take their events (issue #20, items 4 and 19).

* A subscriber still inside a call that outlived ``ack_timeout_seconds`` is
  busy: its share of later batches is not handed to it, so it is not an
  attempt - nothing is dead-lettered in its name that it never received -
  and the events wait for it (held out of the batches meanwhile) and come to
  it once it returns.
* A lost lease ends the wait for a hung subscriber at once, not after its
  ack timeout.
* A removed subscriber with no dead-letter sink holds the checkpoint: the
  poller says so once, at WARNING, does not report ``committed`` ticks that
  deliver nothing, and ``dbtrigger status`` shows who holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, LostLeaseError, PollTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime import async_calls
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state.fanout import ACCEPT, BUSY, GONE, Fate, decide, defer, fail, held, reject
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.window import Window
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    steal_lease,
    wait_for,
)
from tests.test_event_outcomes import Clock
from tests.test_fanout import Sub, checkpoint_id, store  # noqa: F401 - the store fixture

HELD = "checkpoint_held"

# --- the pure decisions -----------------------------------------------------------------

# (description, handed, results, fate, owed, counted)
DEFERRED = [
    (
        "busy alone: owed, count unchanged, no attempt",
        {"a": 0, "b": 0},
        {"a": ACCEPT, "b": defer("busy")},
        Fate.PENDING,
        {"b": 0},
        False,
    ),
    (
        "busy on its last attempt: still owed, never exhausted by waiting",
        {"a": 0, "b": 1},
        {"a": ACCEPT, "b": defer("busy")},
        Fate.PENDING,
        {"b": 1},
        False,
    ),
    (
        "one busy, one failing: the failure is an attempt",
        {"a": 0, "b": 0},
        {"a": fail("x"), "b": defer("busy")},
        Fate.PENDING,
        {"a": 1, "b": 0},
        True,
    ),
    (
        "a reject is terminal even while another is busy",
        {"a": 0, "b": 0},
        {"a": reject("bad"), "b": defer("busy")},
        Fate.DEAD_LETTER,
        {},
        True,
    ),
]


@pytest.mark.parametrize(
    ("handed", "results", "fate", "owed_after", "counted"),
    [row[1:] for row in DEFERRED],
    ids=[row[0] for row in DEFERRED],
)
def test_a_deferred_share_is_owed_but_never_an_attempt(
    handed: dict[str, int],
    results: dict[str, Any],
    fate: Fate,
    owed_after: dict[str, int],
    counted: bool,
) -> None:
    decision = decide(handed, results, max_attempts=2, has_sink=True)
    assert decision.fate is fate
    assert dict(decision.owed) == owed_after
    assert decision.counted is counted


# (description, owed, busy, has_sink, held)
HOLD = [
    ("a free subscriber owes it", {"a": 1, "b": 1}, {"b"}, False, None),
    ("only busy subscribers owe it", {"b": 1}, {"b"}, True, BUSY),
    ("busy and removed", {"b": 1, "old": 2}, {"b"}, False, BUSY),
    ("only removed, no sink", {"old": 1}, set(), False, GONE),
    ("only removed, a sink takes it", {"old": 1}, set(), True, None),
    ("a single handler's retry: owed to all, one free", None, {"a"}, False, None),
    ("a single handler's retry: all busy", None, {"a", "b"}, False, BUSY),
]


@pytest.mark.parametrize(
    ("owed_by", "busy", "sink", "why"), [r[1:] for r in HOLD], ids=[r[0] for r in HOLD]
)
def test_held(owed_by: dict[str, int] | None, busy: set[str], sink: bool, why: str | None) -> None:
    assert held(owed_by, ["a", "b"], busy, has_sink=sink) == why


# --- on real databases and stores --------------------------------------------------------

RELEASED = "checkpoint_released"


def events_logged(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


class Hang:
    """A subscriber whose first call blocks until the test releases it (bounded)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.attempts: dict[int, list[int]] = {}
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        self.calls.append([int(e.pk["id"]) for e in events])
        for e in events:
            self.attempts.setdefault(int(e.pk["id"]), []).append(ctx.attempts(e))
        if len(self.calls) == 1:
            self.entered.set()
            try:
                self.release.wait(60)
            finally:
                self.returned.set()


def owed(state: CheckpointStore) -> dict[int, dict[str, int] | None]:
    window = read_doc(state).window or Window()
    return {int(p.position.pk["id"]): p.owed for p in window.pending}


def test_a_busy_subscriber_is_not_charged_for_events_it_never_received(
    db: TestDatabase,
    store: CheckpointStore,  # noqa: F811 - the fixture
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The issue's case: 20 rows in 4 batches while one subscriber hangs, with
    max_attempts=2 and a sink. Before the fix its share of every later batch
    counted as failed attempts and 15 of 20 rows were dead-lettered in its name."""
    # Threads of other tests in this process (a hung subscriber of theirs may
    # still be finishing) are not this trigger's.
    others = {t for t in threading.enumerate() if t.name.endswith("-slow")}
    table = items_table(db)
    clock = Clock()
    billing = Sub("billing")
    slow = Hang()
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    trigger = make_trigger(
        items_source(db),
        store,
        clock=clock,
        subscribers={"billing": billing, "slow": slow},
        ack_timeout_seconds=0.3,
        quarantine=sink,
        max_attempts=2,
        retry_delay_seconds=1,
        batch_size=50,
    )
    caplog.set_level(logging.INFO, logger="dbtrigger")
    try:
        add_items(db, table, range(1, 6))
        assert trigger.tick() == 5
        assert slow.entered.is_set()  # and timed out: 1-5 failed once for it
        for first in (6, 11, 16):
            add_items(db, table, range(first, first + 5))
            clock.advance(100)  # every backoff is over
            # 1-5 are due, but only slow owes them and it is busy: held back.
            # The new rows go to billing; slow's share waits, uncounted.
            assert trigger.tick() == 5
        assert trigger.tick_result().outcome == "idle"  # nothing anyone can take
        assert list(sink.records()) == []
        assert slow.calls == [[1, 2, 3, 4, 5]]
        assert sorted(billing.accepted) == list(range(1, 21))
        assert owed(store) == {i: {"slow": 1 if i <= 5 else 0} for i in range(1, 21)}
        assert checkpoint_id(store) is None
        assert len(events_logged(caplog, HELD)) == 1  # said once, not per tick
    finally:
        slow.release.set()
    wait_for(slow.returned.is_set)
    wait_for(
        lambda: not any(t.name.endswith("-slow") and t not in others for t in threading.enumerate())
    )
    clock.advance(100)
    assert trigger.tick() == 20
    assert slow.calls[1] == list(range(1, 21))
    # Attempts count deliveries to slow only: 1-5 were delivered once before.
    assert {i: a[-1] for i, a in slow.attempts.items()} == {
        i: 2 if i <= 5 else 1 for i in range(1, 21)
    }
    assert billing.seen == list(range(1, 21))  # billing never got them again
    assert list(sink.records()) == []
    assert checkpoint_id(store) == 20
    assert read_doc(store).window is None
    assert len(events_logged(caplog, RELEASED)) == 1


@pytest.mark.parametrize("ticks", ["tick_async", "tick"])
def test_an_async_subscriber_ignoring_its_cancel_stays_busy(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
    ticks: str,
) -> None:
    """Under ``tick_async`` an async subscriber runs on the caller's loop (under
    ``tick``, on a loop of its own). One that swallows its cancellation is let
    go after the grace (ERROR naming the subscriber), but it still runs: it
    must stay busy, as a hung synchronous one does, or it is handed its events
    again while its first call still works on them (two calls of one
    subscriber on one key at once; so it was under ``tick_async``)."""
    monkeypatch.setattr(async_calls, "CANCEL_GRACE_SECONDS", 0.2)
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    clock = Clock()
    release = threading.Event()
    calls: list[list[int]] = []
    billing = Sub("billing")

    async def stubborn(events: list[RowChange]) -> None:
        calls.append([int(e.pk["id"]) for e in events])
        while len(calls) == 1 and not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # it carries on
                await asyncio.sleep(0.01)

    trigger = make_trigger(
        items_source(sqlite_db),
        FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        subscribers={"billing": billing, "stubborn": stubborn},
        ack_timeout_seconds=0.3,
        retry_delay_seconds=1,
    )

    def let_go() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "event", "") == "handler_ignored_cancel"]

    async def until(predicate: Any) -> None:
        for _ in range(1000):  # bounded: 10 s
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached in time")

    async def tick() -> int:
        if ticks == "tick_async":
            return await trigger.tick_async()
        return await asyncio.to_thread(trigger.tick)

    async def scenario() -> None:
        assert await tick() == 2
        await until(lambda: bool(let_go()))  # the loop must run for the grace to end
        add_items(sqlite_db, table, [3])
        clock.advance(5)
        assert await tick() == 1  # billing takes 3; stubborn still runs
        assert calls == [[1, 2]]
        release.set()
        await until(lambda: not any(t.name.endswith("-stubborn") for t in threading.enumerate()))
        clock.advance(30)
        assert await tick() == 3
        assert calls[-1] == [1, 2, 3]

    with caplog.at_level(logging.ERROR, logger="dbtrigger.runtime"):
        asyncio.run(scenario())
    (record,) = let_go()
    assert getattr(record, "subscriber", None) == "stubborn"
    assert "subscriber 'stubborn'" in record.getMessage()
    assert billing.seen == [1, 2, 3]


def test_a_lost_lease_ends_the_wait_for_a_hung_subscriber_at_once(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    state = FileCheckpointStore(tmp_path / "state")
    release = threading.Event()
    billing = Sub("billing")

    def stuck(events: list[RowChange], ctx: BatchContext) -> None:
        steal_lease(state)  # another instance takes over while this call hangs
        release.wait(120)  # ignores ctx.cancelled: a subscriber that cannot be stopped

    trigger = make_trigger(
        items_source(sqlite_db),
        state,
        subscribers={"billing": billing, "stuck": stuck},
        ack_timeout_seconds=90,
        lease_ttl_seconds=3,
        heartbeat_interval_seconds=0.2,
    )
    started = time.monotonic()
    try:
        with pytest.raises(LostLeaseError):
            trigger.tick()
        # Noticed by the heartbeat within a beat or two, not after 90 s.
        assert time.monotonic() - started < 45
        doc = read_doc(state)
        assert doc.checkpoint is None  # nothing committed after the loss
        assert doc.lease is not None
        assert doc.lease.owner_id == "thief"
    finally:
        release.set()


def test_a_removed_subscriber_without_a_sink_holds_the_checkpoint_and_says_so_once(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    state = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    keep, old = Sub("keep"), Sub("old", {1: ["retry"], 2: ["retry"]})
    first = make_trigger(
        items_source(sqlite_db), state, clock=clock, subscribers={"keep": keep, "old": old}
    )
    assert first.tick() == 3
    assert checkpoint_id(state) is None  # 1 and 2 wait for old

    # "old" is removed; nothing can take events 1 and 2 now.
    trigger = make_trigger(items_source(sqlite_db), state, clock=clock, subscribers={"keep": keep})
    caplog.set_level(logging.INFO, logger="dbtrigger")
    outcomes = []
    for _ in range(4):
        clock.advance(1000)
        outcomes.append(trigger.tick_result().outcome)
    assert outcomes == ["idle"] * 4  # not "committed" while nothing is delivered
    assert keep.seen == [1, 2, 3]
    held = events_logged(caplog, HELD)
    assert len(held) == 1, [r.getMessage() for r in held]
    message = held[0].getMessage()
    assert "2 event(s) are owed only to subscriber(s) old" in message
    assert "no dead-letter sink" in message
    assert "quarantine=" in message
    assert held[0].levelno == logging.WARNING
    assert owed(state) == {1: {"old": 1}, 2: {"old": 1}}

    # New rows still flow (until the window's pressure mark).
    add_items(sqlite_db, table, [4])
    assert trigger.tick() == 1
    assert len(events_logged(caplog, HELD)) == 1

    # `dbtrigger status` names who holds the checkpoint.
    module = f"fanout_held_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    capsys.readouterr()
    argv = ["status", "items", "--store", str(tmp_path / "state"), "--source", f"{module}:trigger"]
    main(argv)
    out = capsys.readouterr().out
    assert "old 2 event(s) - HOLDS THE CHECKPOINT" in out, out
    assert "NOT delivered: owed only to old" in out, out  # not "due now"
    main([*argv, "--json"])
    status: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert status["owed"] == [
        {"subscriber": "old", "events": 2, "configured": False, "holds_checkpoint": True}
    ]

    # With a sink configured, they are dead-lettered and the checkpoint moves on.
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    fixed = make_trigger(
        items_source(sqlite_db), state, clock=clock, subscribers={"keep": keep}, quarantine=sink
    )
    clock.advance(1000)
    assert fixed.tick() == 2
    assert [int(r.pk["id"]) for r in sink.records()] == [1, 2]
    assert checkpoint_id(state) == 4


def test_while_every_subscriber_is_busy_nothing_is_handed_out(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """New rows too stay where they are (they would only fill the window): the
    ticks are idle, and the store is not written."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    state = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    only = Hang()
    trigger = make_trigger(
        items_source(sqlite_db),
        state,
        clock=clock,
        subscribers={"only": only},
        ack_timeout_seconds=0.3,
        retry_delay_seconds=1,
    )
    caplog.set_level(logging.INFO, logger="dbtrigger")
    try:
        assert trigger.tick() == 3
        written = read_doc(state)
        add_items(sqlite_db, table, [4, 5])
        for _ in range(3):
            clock.advance(100)
            assert trigger.tick_result().outcome == "idle"
        assert read_doc(state) == written
        assert only.calls == [[1, 2, 3]]
        [held] = events_logged(caplog, HELD)
        assert "every subscriber (only)" in held.getMessage()
    finally:
        only.release.set()
    wait_for(only.returned.is_set)
    wait_for(lambda: not any(t.name.endswith("-only") for t in threading.enumerate()))
    clock.advance(100)
    assert trigger.drain() == 5
    assert only.calls[1:] == [[1, 2, 3, 4, 5]]
    assert only.attempts[4] == [1]
    assert checkpoint_id(state) == 5


def test_a_subscriber_failing_everything_without_a_sink_stops_the_others_loudly(
    pg: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Default settings, no dead-letter sink, one subscriber failing every
    event: nothing can take its events off the checkpoint, so once the window
    reaches its 75% mark the healthy subscriber gets no new rows either
    (back-pressure: the window is bounded, and the checkpoint cannot pass an
    event a subscriber still owes). That stop is said at WARNING naming the
    failing subscriber and what to do (before, the line named no subscriber
    and promised a dead-lettering that never comes without a sink)."""
    table = items_table(pg)
    add_items(pg, table, range(1, 1001))
    good: list[int] = []

    def healthy(events: list[RowChange]) -> None:
        good.extend(int(e.pk["id"]) for e in events)

    def broken(events: list[RowChange]) -> None:
        raise RuntimeError("downstream is down")

    trigger = PollTrigger(
        name="items",
        source=items_source(pg),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=Clock(),  # never moves: no retry falls due
        subscribers={"good": healthy, "bad": broken},
    )
    caplog.set_level(logging.INFO, logger="dbtrigger")
    for _ in range(10):
        trigger.tick()
        if events_logged(caplog, "window_blocked"):
            break
    [blocked] = events_logged(caplog, "window_blocked")
    assert blocked.levelno == logging.WARNING
    message = blocked.getMessage()
    assert "owed to subscriber(s) bad" in message
    assert "no dead-letter sink" in message
    assert "quarantine=" in message
    assert "dead-lettered after max_attempts" not in message
    assert 0 < len(good) < 1000  # the healthy subscriber stopped: held by the window
    assert trigger.tick() == 0
    failed = events_logged(caplog, "subscriber_failed")
    assert failed
    assert all(r.levelno == logging.WARNING and "bad" in r.getMessage() for r in failed)


@pytest.mark.parametrize("how", ["run", "run_async"])
def test_under_a_timer_a_hung_subscriber_is_given_up_within_the_invocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``run(timer=...)`` is a Functions invocation, which the host ends (restarting
    the worker) at ``functionTimeout``, 5 minutes by default. Waiting the default
    ack timeout (300 s) for a hung subscriber, nothing committed before that, and
    every firing handed the same batch to every subscriber again. Under a timer
    the default is cut (to TIMER_ACK_TIMEOUT, made short here): the hung one is
    given up and the others' outcomes commit in the invocation. One given stays."""
    from dbtrigger.runtime import subscribers  # noqa: PLC0415
    from dbtrigger.testing import MemorySource  # noqa: PLC0415

    monkeypatch.setattr(subscribers, "TIMER_ACK_TIMEOUT", 0.2, raising=False)
    release = threading.Event()
    took: list[int] = []

    def hung(events: list[RowChange]) -> None:
        release.wait(30)  # (bounded: without the cut the tick waits for this)

    def billing(events: list[RowChange]) -> None:
        took.extend(int(e.pk["id"]) for e in events)

    def make(**options: Any) -> PollTrigger:
        return PollTrigger(
            name="orders",
            source=MemorySource(
                [{"id": i, "seq": i} for i in range(1, 4)], cursor_column="seq", pk_columns=["id"]
            ),
            checkpoint_store=FileCheckpointStore(tmp_path / "state"),
            subscribers={"billing": billing, "hung": hung},
            **options,
        )

    trigger = make()
    try:
        if how == "run":
            assert trigger.run(timer=object()) == 3
        else:
            assert asyncio.run(trigger.run_async(timer=object())) == 3
        assert took == [1, 2, 3]
        doc = trigger.read_state()
        assert doc.window is not None
        assert [p.owed for p in doc.window.pending] == [{"hung": 1}] * 3
        assert not release.is_set()  # given up while still hung
    finally:
        release.set()
    given = make(ack_timeout_seconds=300)
    given.run(timer=object())
    assert given._driver.reader.delivery.ack_timeout == 300
    plain = make()
    assert plain._driver.reader.delivery.ack_timeout == 300  # no timer: kept
