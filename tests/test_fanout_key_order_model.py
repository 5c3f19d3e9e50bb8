"""Fan-out and per-key order, as a pure model: an earlier event K@v of a key
that one subscriber dead-letters, rejects, retries, gives up on or is busy
for, while a later K@v' of the same key waits behind it (a change log holds
several events of one key).

No database and no threads: the decisions of :mod:`dbtrigger.state.fanout`,
the batch choice of :func:`dbtrigger.state.window.plan` and the settlement of
:func:`dbtrigger.runtime.windowing.settle_delivered`, composed the way
:class:`dbtrigger.runtime.subscribers.FanOut` composes them. What must hold in
every case: K@v' is never settled for a subscriber that was not handed it
after K@v was resolved for that subscriber (handed and accepted, or
dead-lettered), and a subscriber that accepted it is not owed it again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

import pytest

from dbtrigger.cursor import Position
from dbtrigger.event_identity import make_event_id
from dbtrigger.events import RowChange
from dbtrigger.runtime import windowing
from dbtrigger.state import fanout
from dbtrigger.state import window as windowmod
from dbtrigger.state.fanout import ACCEPT, Fate, Resolution, defer, fail, reject
from dbtrigger.state.window import Bound, Window

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 5, 1, tzinfo=UTC)
SUBS = ("s1", "s2")
MAX = 3
BOUND = Bound()


def change(seq: int, key: int = 1) -> RowChange:
    """The change-log event ``seq`` of row ``key``."""
    pk = {"id": key}
    return RowChange(make_event_id("log", pk, seq), "update", "memory:log", seq, pk, None, {})


KV, KV2, OTHER = change(1), change(2), change(3, key=2)


def where(event: RowChange) -> Position:
    return Position(cursor=event.cursor, pk=dict(event.pk))


def batch(
    events: list[RowChange],
    window: Window,
    results: Mapping[str, Mapping[str, Resolution]],
) -> tuple[windowmod.Settlement | None, dict[str, fanout.Decision], dict[str, list[str]]]:
    """One fan-out batch as FanOut runs it: who is handed what, their
    resolutions, each event's decision, and the settlement. ``results``:
    subscriber -> event id -> resolution (a subscriber handed an event it has
    no result for accepted it)."""
    waiting = {windowmod.key_of(p.position): p for p in window.pending}
    decisions: dict[str, fanout.Decision] = {}
    parts: dict[str, list[str]] = {name: [] for name in SUBS}
    for event in events:
        entry = waiting.get(windowmod.key_of(where(event)))
        before = entry.owed if entry is not None else None
        fan, gone = fanout.fan_out_set(before, SUBS, max_attempts=MAX, has_sink=True)
        spent = fanout.given_up(before, SUBS, max_attempts=MAX, has_sink=True)
        for name in fan:
            parts[name].append(event.event_id)
        mine = {name: results.get(name, {}).get(event.event_id, ACCEPT) for name in fan}
        decisions[event.event_id] = fanout.decide(
            fan, mine, max_attempts=MAX, has_sink=True, gone=gone, spent=spent
        )
    pending = {i: d for i, d in decisions.items() if d.fate is Fate.PENDING}
    selection = windowing.Selection(
        [{} for _ in events], window, tuple(where(e) for e in events), True, False
    )
    settlement = windowing.settle_delivered(
        selection,
        events,
        {i: d.reason or "failed" for i, d in pending.items()},
        now=NOW,
        bound=BOUND,
        backoff=(0.0, 0.0),
        jitter=lambda: 0.0,
        owed={i: dict(d.owed) for i, d in pending.items()},
        terminal=frozenset(i for i, d in decisions.items() if d.fate is Fate.DEAD_LETTER),
        deferred=frozenset(i for i, d in pending.items() if not d.counted),
    )
    return settlement, decisions, parts


def owed_in(settlement: windowmod.Settlement | None) -> dict[int, Mapping[str, int] | None]:
    assert settlement is not None
    return {int(p.position.cursor): p.owed for p in settlement.window.pending}


def checkpoint(settlement: windowmod.Settlement | None) -> int | None:
    assert settlement is not None
    return None if settlement.checkpoint is None else int(settlement.checkpoint.cursor)


def test_kv_dead_lettered_for_s2_in_the_same_batch_lets_kv2_settle_on_its_own() -> None:
    """s2 rejects K@v; K@v' in the same batch was accepted by both: settled."""
    settlement, decisions, _ = batch([KV, KV2], Window(), {"s2": {KV.event_id: reject("bad")}})
    assert decisions[KV.event_id].fate is Fate.DEAD_LETTER
    assert decisions[KV2.event_id].fate is Fate.SETTLED
    assert settlement is None  # no window, nothing waits: past the whole batch, as always


def test_kv_retried_by_s2_holds_kv2_for_s2_only() -> None:
    """s2 retries K@v; both accepted K@v': K@v' is owed again to s2 alone (it
    handled K@v' before K@v), never to s1, which accepted both."""
    settlement, _, _ = batch([KV, KV2], Window(), {"s2": {KV.event_id: fail("later")}})
    assert owed_in(settlement) == {1: {"s2": 1}, 2: {"s2": 0}}
    assert checkpoint(settlement) is None


def held_window() -> Window:
    """K@v owed to s2 (two failed attempts), K@v' held behind it for s2."""
    settlement, _, _ = batch([KV, KV2], Window(), {"s2": {KV.event_id: fail("later")}})
    assert settlement is not None
    window = settlement.window
    first = window.pending[0]
    return Window(
        settlement.window.settled,
        (
            first.__class__(first.position, 2, first.not_before, first.reason, {"s2": 2}),
            window.pending[1],
        ),
    )


@pytest.mark.parametrize(
    ("s2_on_kv", "kv_fate"),
    [
        (fail("later"), Fate.DEAD_LETTER),  # retries used up (3rd attempt): dead-lettered
        (reject("bad"), Fate.DEAD_LETTER),
        (ACCEPT, Fate.SETTLED),
    ],
    ids=["retries exhausted", "rejected", "accepted"],
)
def test_when_kv_is_resolved_for_s2_kv2_goes_to_s2_in_that_batch(
    s2_on_kv: Resolution, kv_fate: Fate
) -> None:
    window = held_window()
    plan = windowmod.plan(
        [windowmod.key_of(where(e)) for e in (KV, KV2, OTHER)],
        [windowmod.entry_size(where(e)) for e in (KV, KV2, OTHER)],
        window,
        now=NOW,
        batch_size=10,
        bound=BOUND,
        groups=[windowmod.row_key(where(e)) for e in (KV, KV2, OTHER)],
    )
    assert plan.deliver == (0, 1, 2)  # K@v due, K@v' right behind it, the new row
    settlement, decisions, parts = batch([KV, KV2, OTHER], window, {"s2": {KV.event_id: s2_on_kv}})
    assert parts == {"s1": [OTHER.event_id], "s2": [KV.event_id, KV2.event_id, OTHER.event_id]}
    assert decisions[KV.event_id].fate is kv_fate
    assert decisions[KV2.event_id].fate is Fate.SETTLED  # s2 was handed it and accepted it
    assert owed_in(settlement) == {}
    assert checkpoint(settlement) == 3


def test_while_s2_is_busy_kv_and_kv2_wait_for_it_uncounted() -> None:
    """s2 busy (a call past its ack timeout): both are held out of the batch
    (nobody else owes them); handed anyway (a read chosen before it became
    busy), its share is deferred and nothing settles or counts."""
    window = held_window()
    keys = [windowmod.key_of(where(e)) for e in (KV, KV2, OTHER)]
    hold = frozenset(
        windowmod.key_of(p.position)
        for p in window.pending
        if fanout.held(p.owed, SUBS, {"s2"}, has_sink=True, max_attempts=MAX)
    )
    plan = windowmod.plan(
        keys,
        [windowmod.entry_size(where(e)) for e in (KV, KV2, OTHER)],
        window,
        now=NOW,
        batch_size=10,
        bound=BOUND,
        groups=[windowmod.row_key(where(e)) for e in (KV, KV2, OTHER)],
        hold=hold,
    )
    assert plan.deliver == (2,)  # only the other key's new row
    busy = defer("busy")
    settlement, decisions, _ = batch(
        [KV, KV2], window, {"s2": {KV.event_id: busy, KV2.event_id: busy}}
    )
    assert {d.fate for d in decisions.values()} == {Fate.PENDING}
    assert owed_in(settlement) == {1: {"s2": 2}, 2: {"s2": 0}}  # counts unchanged


def test_s2_gives_up_on_kv_while_s1_still_owes_it_kv2_still_reaches_both() -> None:
    """K@v failed by both; s2's third failure is its last, s1 has attempts left:
    K@v stays owed to s1 (s2 waits, handed it no more), and K@v' behind it
    waits for both; when s1 accepts K@v, K@v is dead-lettered in s2's name and
    K@v' (held) is handed to s2 and settles."""
    first, _, _ = batch(
        [KV, KV2],
        Window(),
        {"s1": {KV.event_id: fail("x")}, "s2": {KV.event_id: fail("y")}},
    )
    assert first is not None
    kv, kv2 = first.window.pending
    window = Window((), (kv.__class__(kv.position, 2, NOW, kv.reason, {"s1": 1, "s2": 2}), kv2))
    second, decisions, parts = batch(
        [KV, KV2], window, {"s1": {KV.event_id: fail("x")}, "s2": {KV.event_id: fail("y")}}
    )
    assert decisions[KV.event_id].fate is Fate.PENDING  # s1 still owes it
    assert owed_in(second) == {1: {"s1": 2, "s2": 3}, 2: {"s1": 0, "s2": 0}}
    assert second is not None
    third, decisions, parts = batch([KV, KV2], second.window, {})
    assert parts == {"s1": [KV.event_id, KV2.event_id], "s2": [KV2.event_id]}
    assert decisions[KV.event_id].fate is Fate.DEAD_LETTER
    assert dict(decisions[KV.event_id].reasons).keys() == {"s2"}
    assert owed_in(third) == {}
    assert checkpoint(third) == 2


def test_a_restart_mid_batch_decides_the_same_from_the_stored_window() -> None:
    """The window is all a restarted process has: through its JSON, the same
    hand-out and the same decisions."""
    window = held_window()
    reread = Window.from_json(window.to_json())
    assert reread == window
    for results in ({}, {"s2": {KV.event_id: fail("later")}}):
        assert batch([KV, KV2], reread, results)[1] == batch([KV, KV2], window, results)[1]
