"""Fan-out: one subscriber using up its attempts does not take the event from
the others (the chaos run's "lost 10, dead-lettered 10, all earned").

A subscriber that fails an event on its ``max_attempts``-th delivery has given
up on it: with a sink, the event is dead-lettered in its name. Before, that
happened at once, for the *event*: a subscriber still owed it - busy inside a
call that outlived its ack timeout, so never handed it, or with attempts of
its own left - never got it, although its share was not an attempt ("nothing
is dead-lettered in its name") and attempts count per subscriber. In the
fan-out chaos run one subscriber failed a batch of 10 three times while the
other was busy each time: 10 dead letters, all earned, and 10 row states that
subscriber was never handed.

Now the spent subscriber is handed the event no more and waits for the
others: the event goes on to every subscriber that still owes it, with its
own attempts, and is dead-lettered once none does - once, naming the
subscribers that gave up (and any that rejected it or gave up later), never
one that accepted it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, RowChange
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state.fanout import (
    ACCEPT,
    BUSY,
    Fate,
    decide,
    defer,
    fail,
    fan_out_set,
    held,
    reject,
)
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.window import Window
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    wait_for,
)
from tests.test_event_outcomes import Clock
from tests.test_fanout import Sub

# --- the pure decisions -----------------------------------------------------------------

# (description, handed, spent, results, fate, owed, exhausted names)
SPENT = [
    (
        "a gives up while b is busy: b still owes it, a waits for b",
        {"a": 1, "b": 0},
        {},
        {"a": fail("x"), "b": defer("busy")},
        Fate.PENDING,
        {"a": 2, "b": 0},
        (),
    ),
    (
        "a gives up while b has attempts left: b still owes it",
        {"a": 1, "b": 0},
        {},
        {"a": fail("x"), "b": fail("y")},
        Fate.PENDING,
        {"a": 2, "b": 1},
        (),
    ),
    (
        "a gave up earlier; b accepts: dead-lettered in a's name only",
        {"b": 0},
        {"a": 2},
        {"b": ACCEPT},
        Fate.DEAD_LETTER,
        {},
        ("a",),
    ),
    (
        "a gave up earlier; b gives up too: dead-lettered once, in both names",
        {"b": 1},
        {"a": 2},
        {"b": fail("y")},
        Fate.DEAD_LETTER,
        {},
        ("a", "b"),
    ),
    (
        "a gave up earlier; b fails with attempts left: still owed to b",
        {"b": 0},
        {"a": 2},
        {"b": fail("y")},
        Fate.PENDING,
        {"a": 2, "b": 1},
        (),
    ),
    (
        "a gave up earlier; b is busy: still owed to b, no attempt",
        {"b": 0},
        {"a": 2},
        {"b": defer("busy")},
        Fate.PENDING,
        {"a": 2, "b": 0},
        (),
    ),
    (
        "a gives up, b accepted: dead-lettered at once, in a's name",
        {"a": 1, "b": 0},
        {},
        {"a": fail("x"), "b": ACCEPT},
        Fate.DEAD_LETTER,
        {},
        ("a",),
    ),
    (
        "a gave up earlier; b rejects: a reject is terminal",
        {"b": 0},
        {"a": 2},
        {"b": reject("bad")},
        Fate.DEAD_LETTER,
        {},
        (),
    ),
    (
        "a gave up earlier and nobody else is left (removed): dead-lettered",
        {},
        {"a": 2},
        {},
        Fate.DEAD_LETTER,
        {},
        ("a",),
    ),
]


@pytest.mark.parametrize(
    ("handed", "spent", "results", "fate", "owed_after", "exhausted"),
    [row[1:] for row in SPENT],
    ids=[row[0] for row in SPENT],
)
def test_a_subscriber_that_gave_up_waits_for_the_others(
    handed: dict[str, int],
    spent: dict[str, int],
    results: dict[str, Any],
    fate: Fate,
    owed_after: dict[str, int],
    exhausted: tuple[str, ...],
) -> None:
    decision = decide(handed, results, max_attempts=2, has_sink=True, spent=spent)
    assert decision.fate is fate
    assert dict(decision.owed) == owed_after
    if exhausted:
        assert decision.exhausted
        assert tuple(sorted(decision.reasons)) == exhausted  # never one that accepted it
    assert decision.counted or fate is Fate.PENDING


def test_without_a_sink_a_spent_subscriber_is_still_handed_the_event() -> None:
    """Nothing can take it off the checkpoint: it stays owed (and handed, loudly
    reported as poison) to the subscriber that gave up, as before."""
    fan, gone = fan_out_set({"a": 2, "b": 0}, ["a", "b"])
    assert (fan, gone) == ({"a": 2, "b": 0}, ())
    decision = decide(
        {"a": 2, "b": 0}, {"a": fail("x"), "b": ACCEPT}, max_attempts=2, has_sink=False
    )
    assert decision.fate is Fate.PENDING
    assert decision.stuck == ("a",)


def test_a_spent_subscriber_is_handed_it_no_more_with_a_sink() -> None:
    fan, gone = fan_out_set({"a": 2, "b": 0}, ["a", "b"], max_attempts=2, has_sink=True)
    assert (fan, gone) == ({"b": 0}, ())


# (description, owed, busy, held)
HOLD = [
    ("the one still owing it is busy", {"a": 2, "b": 0}, {"b"}, BUSY),
    ("the one still owing it is free", {"a": 2, "b": 0}, {"a"}, None),
    ("only spent subscribers left: handed out to be dead-lettered", {"a": 2}, set(), None),
]


@pytest.mark.parametrize(
    ("owed_by", "busy", "why"), [r[1:] for r in HOLD], ids=[r[0] for r in HOLD]
)
def test_held_leaves_out_who_gave_up(
    owed_by: dict[str, int], busy: set[str], why: str | None
) -> None:
    assert held(owed_by, ["a", "b"], busy, has_sink=True, max_attempts=2) == why


# --- on a real database -----------------------------------------------------------------


class HangOnce:
    """A subscriber whose first call blocks until the test releases it (bounded)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.release = threading.Event()
        self.returned = threading.Event()

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        self.calls.append([int(e.pk["id"]) for e in events])
        if len(self.calls) == 1:
            try:
                self.release.wait(60)
            finally:
                self.returned.set()


def owed(state: CheckpointStore) -> dict[int, dict[str, int] | None]:
    window = read_doc(state, "exhausted").window or Window()
    return {int(p.position.pk["id"]): p.owed for p in window.pending}


#: The hung call's thread (runtime/subscribers.py names it after poller and subscriber).
THREAD = "dbtrigger-subscriber-exhausted-search"


def test_a_subscriber_busy_while_another_gives_up_still_gets_the_event(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """search hangs past its ack timeout on row 1; billing then fails row 2 on
    both its attempts while search is still busy. Before, row 2 was
    dead-lettered ("billing: ...; search: busy") and search never saw it."""
    table = items_table(sqlite_db)
    clock = Clock()
    billing = Sub("billing", {2: ["retry", "retry"]})
    search = HangOnce()
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    state = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(
        items_source(sqlite_db),
        state,
        name="exhausted",
        clock=clock,
        subscribers={"billing": billing, "search": search},
        ack_timeout_seconds=0.3,
        quarantine=sink,
        max_attempts=2,
        retry_delay_seconds=1,
    )
    try:
        add_items(sqlite_db, table, [1])
        assert trigger.tick() == 1  # search hangs on it: timed out, busy from now on
        add_items(sqlite_db, table, [2])
        trigger.tick()  # row 2: billing retries it (1 of 2); search is busy (no attempt)
        clock.advance(100)
        trigger.tick()  # billing fails row 2 again: it gave up; search still owes it
        assert billing.seen == [1, 2, 2]
        assert list(sink.records()) == []  # not while search owes it and never had it
        assert owed(state) == {1: {"search": 1}, 2: {"billing": 2, "search": 0}}
    finally:
        search.release.set()
    wait_for(search.returned.is_set)
    wait_for(lambda: not any(t.name == THREAD and t.is_alive() for t in threading.enumerate()))
    clock.advance(100)
    trigger.drain()
    assert search.calls[1:] == [[1, 2]]  # search gets both, billing not row 2 again
    assert billing.seen == [1, 2, 2]
    records = list(sink.records())
    assert [int(r.pk["id"]) for r in records] == [2]
    assert records[0].error.startswith("RetriesExhausted: billing: ")
    assert "search" not in records[0].error  # search accepted it
    assert read_doc(state, "exhausted").position.pk == {"id": 2}
    doc = trigger.read_state()
    assert doc is not None
    assert doc.window is None
