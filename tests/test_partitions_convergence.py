"""Members converge at default settings: cadence, join window, fencing on steal and death.

The clocks here are moved by hand (``background=False``), except where the
background thread itself is what is tested; then the waits are outcomes with
generous bounds, never sleeps that count.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.errors import StoreUnavailableError
from dbtrigger.partitions import cadence, layout
from dbtrigger.partitions.layout import BalanceDecision, Member, Membership, even_ranges
from dbtrigger.partitions.member import PartitionedPoller, membership_key
from dbtrigger.state import document as docmod
from dbtrigger.state.document import Lease
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument
from tests.databases import TestDatabase


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(db: TestDatabase, rows: int) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (:id, :id)"),
            [{"id": i} for i in range(1, rows + 1)],
        )


def member(
    db: TestDatabase, store: CheckpointStore, name: str, clock: Clock, **options: Any
) -> PartitionedPoller:
    options.setdefault("partitions", 2)
    options.setdefault("join_window_seconds", 0)
    options.setdefault("background", False)
    return PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=db.url, table="orders", schema=db.schema, cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=store,
        balance_interval_seconds=1,
        member_ttl_seconds=3,
        member_id=name,
        monotonic=clock,
        **options,
    )


# --- the cadence: pure ---------------------------------------------------------------


def decision(*, changed: bool = False, settled: bool = True) -> BalanceDecision:
    return BalanceDecision(None, (), claimed=("p",) if changed else (), settled=settled)


DOC = Membership("o", "f", 1, even_ranges(2), {"a": Member(1, {"p000-128": 1})})


@pytest.mark.parametrize(
    ("what", "kwargs"),
    [
        ("claimed", {"decision": decision(changed=True)}),
        ("not settled", {"decision": decision(settled=False)}),
        ("joining", {"joining": True}),
        ("failed cycle", {"decision": None}),
        (
            "others moved",
            {"doc": dataclasses.replace(DOC, members={"a": Member(2, {"p128-256": 2})})},
        ),
    ],
)
def test_cycles_are_fast_while_anything_moves_then_slow_once_settled(
    what: str, kwargs: dict[str, Any]
) -> None:
    clock = Clock()
    pace = cadence.Cadence(3.0, clock, random.Random(1))
    args: dict[str, Any] = {"decision": decision(), "doc": DOC, "joining": False}
    pace.next(**{**args, "expiry_in": None})
    clock.now += 7  # settled for longer than the settling period: slow
    assert 3.0 <= pace.next(**args, expiry_in=None) <= 3.6
    assert 0.5 <= pace.next(**{**args, **kwargs}, expiry_in=None) <= 0.6, what
    args["doc"] = kwargs.get("doc", DOC)
    clock.now += 5.9  # still within two intervals of the movement: fast
    assert 0.5 <= pace.next(**args, expiry_in=None) <= 0.6, what
    clock.now += 0.2
    assert 3.0 <= pace.next(**args, expiry_in=None) <= 3.6, what


def test_the_next_cycle_is_never_after_a_due_death_and_failures_wait_long() -> None:
    clock = Clock()
    pace = cadence.Cadence(3.0, clock, random.Random(1))
    delay = pace.next(decision(), DOC, joining=False, expiry_in=0.2)
    assert delay == pytest.approx(0.2 + cadence.EXPIRY_MARGIN_SECONDS)
    assert 3.0 <= pace.after_failure() <= 3.6


def test_liveness_counts_from_the_first_sight_of_a_beat_on_our_clock() -> None:
    clock = Clock()
    live = cadence.Liveness(3.0, clock)
    doc = Membership("o", "f", 1, even_ranges(2), {"a": Member(5), "me": Member(1)})
    assert live.observe(doc, "me") == {"a"}  # first sight: alive
    clock.now += 2.9
    assert live.observe(doc, "me") == {"a"}
    assert live.seconds_to_first_expiry(["a"]) == pytest.approx(0.1)
    clock.now += 0.2
    assert live.observe(doc, "me") == frozenset()  # stood still for the TTL
    moved = dataclasses.replace(doc, members={"a": Member(6), "me": Member(1)})
    assert live.observe(moved, "me") == {"a"}  # beats again: alive again


def test_defaults_take_a_killed_member_over_within_fifteen_seconds() -> None:
    interval = cadence.DEFAULT_BALANCE_INTERVAL_SECONDS
    ttl = cadence.default_ttl(interval)
    worst = ttl + interval * (1 + cadence.JITTER) + cadence.EXPIRY_MARGIN_SECONDS
    assert ttl >= 10
    assert worst <= 15
    assert ttl >= 3 * interval  # a member that misses two cycles is not dead yet


# --- members -----------------------------------------------------------------------


def test_members_started_together_claim_their_shares_without_shedding(
    sqlite_db: TestDatabase,
) -> None:
    make_table(sqlite_db, 10)
    store, clock = InMemoryCheckpointStore(), Clock()
    a, b, c = (
        member(sqlite_db, store, n, clock, partitions=8, join_window_seconds=1.0) for n in "abc"
    )
    for m in (a, b, c):  # all three heartbeat inside their join windows: nobody claims
        m.balance()
        assert m.owned == ()
        assert m.last_decision is not None
        assert not m.last_decision.settled
    clock.now += 1.0
    released: list[str] = []
    for m in (a, b, c):
        d = m.balance()
        assert d is not None
        released.extend(d.released)
    assert sorted(len(m.owned) for m in (a, b, c)) == [2, 3, 3]
    assert released == []  # each claimed its share; nobody took all and shed
    for m in (a, b, c):
        assert m.balance().settled  # type: ignore[union-attr]
    clock.now += 2.0  # settled for two intervals: back to the slow interval
    c.balance()
    assert 1.0 <= c._loop.delay <= 1.2


def test_a_member_that_sees_a_newcomer_sheds_at_once_and_cycles_fast(
    sqlite_db: TestDatabase,
) -> None:
    make_table(sqlite_db, 10)
    store, clock = InMemoryCheckpointStore(), Clock()
    a = member(sqlite_db, store, "a", clock, partitions=4)
    a.balance()
    clock.now += 2.0
    a.balance()
    assert len(a.owned) == 4
    assert a._loop.delay >= 1.0  # alone and settled
    b = member(sqlite_db, store, "b", clock, partitions=4)
    b.balance()  # b's first beat: nothing is free, and a's partitions are too fresh to steal
    first = a.balance()
    assert first is not None
    assert len(first.released) == 2  # in the cycle that saw b's heartbeat
    assert a._loop.delay <= cadence.fast_interval(1.0) * 1.2
    b.balance()
    assert sorted([len(a.owned), len(b.owned)]) == [2, 2]


def move_partition(store: CheckpointStore, pid: str, source: str, target: str) -> None:
    """What another member's steal writes: ``pid`` leaves ``source``'s entry."""
    stored = store.read(membership_key("orders"))
    assert stored is not None
    doc = layout.loads(stored.data)
    members = dict(doc.members)
    members[source] = dataclasses.replace(
        members[source], owns={k: v for k, v in members[source].owns.items() if k != pid}
    )
    thief = members.get(target, Member(1))
    members[target] = dataclasses.replace(thief, owns={**thief.owns, pid: thief.beat})
    store.write(
        membership_key("orders"),
        layout.dumps(dataclasses.replace(doc, members=members)),
        if_match=stored.etag,
    )


def test_a_member_starts_no_further_batch_of_a_partition_taken_from_it(
    sqlite_db: TestDatabase,
) -> None:
    make_table(sqlite_db, 200)
    store, clock = InMemoryCheckpointStore(), Clock()
    a = member(sqlite_db, store, "a", clock, partitions=1, batch_size=10, max_batches_per_tick=5)
    a.balance()
    (pid,) = a.owned
    batches: list[list[int]] = []

    def handle(events: list[RowChange]) -> None:
        batches.append([e.pk["id"] for e in events])
        if len(batches) == 1:
            move_partition(store, pid, "a", "b")  # b steals it mid-tick
            a.balance()  # a's balance thread learns of it

    result = a.tick_result(handle)
    assert len(batches) == 1, "a started the next batch of a partition it no longer owns"
    assert result.rows == 10  # the batch in flight was committed normally
    state = a.trigger(pid).read_state()
    assert state is not None
    assert state.position.cursor == 10
    assert state.lease is not None
    assert state.lease.released


def settled_pair(
    db: TestDatabase, store: CheckpointStore, clock: Clock, **options: Any
) -> tuple[PartitionedPoller, PartitionedPoller]:
    """``a`` has held both partitions long enough to be stolen from; ``b`` not yet a member."""
    a = member(db, store, "a", clock, **options)
    for _ in range(3):
        a.balance()
        clock.now += 1
    assert len(a.owned) == 2
    return a, member(db, store, "b", clock, **options)


def test_a_steal_between_ticks_keeps_the_old_owner_off_the_partition(
    sqlite_db: TestDatabase,
) -> None:
    """b steals while a sits between two rounds, before a's next balance cycle is due:
    a's next round does not start the handler on the stolen partition, and every
    row is delivered once."""
    make_table(sqlite_db, 120)
    store, clock = InMemoryCheckpointStore(), Clock()
    a, b = settled_pair(sqlite_db, store, clock, batch_size=10, max_batches_per_tick=1)
    seen: Counter[int] = Counter()
    calls: dict[str, list[str]] = {"a": [], "b": []}

    def handler(who: str) -> Callable[[list[RowChange], Any], None]:
        def handle(events: list[RowChange], ctx: Any) -> None:
            calls[who].append(ctx.poller_name)
            seen.update(e.pk["id"] for e in events)

        return handle

    assert a.tick(handler("a")) > 0
    decision = b.balance()  # between a's rounds
    assert decision is not None
    (stolen,) = decision.stolen
    assert not a._loop.due()  # a's balance cycle has not seen it
    calls["a"].clear()
    a.tick(handler("a"))
    assert calls["a"], "a ticked nothing at all"
    assert f"orders.{stolen}" not in calls["a"], "a started the handler on a stolen partition"
    assert stolen not in a.owned
    for _ in range(40):  # both drain what is left; bounded
        clock.now += 0.3
        rows = a.tick(handler("a")) + b.tick(handler("b"))
        if rows == 0 and len(seen) == 120:
            break
    assert set(seen) == set(range(1, 121))
    assert max(seen.values()) == 1
    assert f"orders.{stolen}" in calls["b"]


def test_a_steal_mid_tick_stops_the_old_owner_before_its_next_batch(
    sqlite_db: TestDatabase,
) -> None:
    """No balance cycle of a runs while it ticks: the view it re-reads between
    batches (once older than the fast interval) shows the steal."""
    make_table(sqlite_db, 200)
    store, clock = InMemoryCheckpointStore(), Clock()
    a, _ = settled_pair(sqlite_db, store, clock, batch_size=10, max_batches_per_tick=5)
    order: list[str] = []

    def handle(events: list[RowChange], ctx: Any) -> None:
        order.append(ctx.poller_name)
        if len(order) == 1:  # b takes the partition a is delivering, a learns nothing yet
            move_partition(store, ctx.poller_name.removeprefix("orders."), "a", "b")
            clock.now += 1  # a's view is now older than its fast interval

    result = a.tick_result(handle)
    assert order.count(order[0]) == 1, f"a went on with a partition taken from it: {order}"
    assert result.rows == 10 + 10 * (len(order) - 1)  # the batch in flight committed


def test_the_lease_of_a_member_killed_mid_batch_is_fenced_at_takeover(
    sqlite_db: TestDatabase,
) -> None:
    make_table(sqlite_db, 30)
    store, clock = InMemoryCheckpointStore(), Clock()
    a = member(sqlite_db, store, "a", clock, partitions=1, batch_size=10)
    b = member(sqlite_db, store, "b", clock, partitions=1, batch_size=10)
    a.balance()
    b.balance()
    (pid,) = a.owned
    assert a.tick(lambda events: None) == 10
    # a is killed inside its next batch: its lease stays live (120 s) and it beats no more.
    key = a.trigger(pid).name
    stored = store.read(key)
    assert stored is not None
    doc = docmod.loads(stored.data)
    now = dt.datetime.now(dt.timezone.utc)
    assert doc.lease is not None
    killed = Lease(
        owner_id="a",
        fencing_token=doc.lease.fencing_token + 1,
        acquired_at=now,
        heartbeat_at=now,
        expires_at=now + dt.timedelta(seconds=120),
    )
    store.write(key, docmod.dumps(dataclasses.replace(doc, lease=killed)), if_match=stored.etag)
    for _ in range(4):  # past the member TTL on b's clock
        clock.now += 1
        b.balance()
    assert b.owned == (pid,)
    seen: list[int] = []
    assert b.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 10
    assert seen == list(range(11, 21))  # at once, not after the 120 s lease
    history = b.trigger(pid).read_state()
    assert history is not None
    fenced = [e for e in history.journal if e.get("operation") == "release_lease"]
    assert fenced
    assert "stopped heartbeating" in fenced[-1]["reason"]


def test_a_live_members_lease_is_not_fenced(sqlite_db: TestDatabase) -> None:
    """A steal from a live member lets its batch in flight commit: nothing is fenced."""
    make_table(sqlite_db, 30)
    store, clock = InMemoryCheckpointStore(), Clock()
    a = member(sqlite_db, store, "a", clock, partitions=2, batch_size=10)
    a.balance()
    for _ in range(3):  # old enough to be stolen
        clock.now += 1
        a.balance()
    b = member(sqlite_db, store, "b", clock, partitions=2, batch_size=10)
    stolen: list[str] = []

    def handle(events: list[RowChange], ctx: Any) -> None:
        if not stolen:
            decision = b.balance()  # b joins and steals one while a is mid-batch
            assert decision is not None
            stolen.extend(decision.stolen)

    result = a.tick_result(handle)
    assert len(stolen) == 1
    assert result.rows == 20  # both of a's batches committed, the stolen one's too
    for pid in ("p000-128", "p128-256"):
        state = a.trigger(pid).read_state()
        assert state is not None
        assert not any(e.get("operation") == "release_lease" for e in state.journal)


class FailingMembership:
    """A store whose membership writes fail while ``failing`` is set."""

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self.failing = False

    def read(self, key: str) -> StoredDocument | None:
        return self.inner.read(key)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        if self.failing and key.endswith(".members"):
            raise StoreUnavailableError("the store is down")
        return self.inner.write(key, data, if_match=if_match)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self.inner.delete(key, if_match=if_match)

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def wait_until(check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_member_whose_heartbeat_fails_for_the_ttl_ticks_nothing(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    make_table(sqlite_db, 50)
    store = FailingMembership(InMemoryCheckpointStore())
    poller = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=store,  # type: ignore[arg-type]
        partitions=2,
        balance_interval_seconds=0.1,
        member_ttl_seconds=0.3,
        join_window_seconds=0,
        batch_size=10,
    )
    try:
        assert poller.tick(lambda events: None) > 0
        store.failing = True
        wait_until(lambda: time.monotonic() - poller._loop.beat_at > poller.member_ttl)
        seen: list[RowChange] = []
        with caplog.at_level(logging.WARNING, logger="dbtrigger.partitions"):
            assert poller.tick(seen.extend) == 0
        assert seen == []
        assert any(getattr(r, "event", "") == "member_self_fenced" for r in caplog.records)
        store.failing = False
        wait_until(lambda: poller.tick(seen.extend) > 0)  # beats again: ticks again
    finally:
        store.failing = False
        poller.leave()


def test_idle_members_say_why_once_and_a_count_is_suggested(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    make_table(sqlite_db, 10)
    store, clock = InMemoryCheckpointStore(), Clock()
    members = [member(sqlite_db, store, n, clock, partitions=2) for n in "abc"]
    with caplog.at_level(logging.INFO, logger="dbtrigger.partitions"):
        for _ in range(5):
            for m in members:
                m.balance()
            clock.now += 0.5
    idle = [m for m in members if not m.owned]
    assert len(idle) == 1
    said = [r for r in caplog.records if getattr(r, "event", "") == "member_idle"]
    assert len(said) == 1
    assert "fair share is 0: 2 partitions for 3 members" in said[0].getMessage()
    warned = [
        r for r in caplog.records if getattr(r, "event", "") == "partitions_fewer_than_members"
    ]
    assert len(warned) == 3  # once per member
    assert "--count 4" in warned[0].getMessage()


def test_an_idle_worker_wakes_when_it_gains_partitions(sqlite_db: TestDatabase) -> None:
    make_table(sqlite_db, 10)
    store, clock = InMemoryCheckpointStore(), Clock()
    a = member(sqlite_db, store, "a", clock, partitions=1)
    b = member(sqlite_db, store, "b", clock, partitions=1)
    a.balance()
    b.balance()
    assert b.owned == ()
    stop = threading.Event()
    woke: list[bool] = []
    sleeper = threading.Thread(target=lambda: woke.append(b.wait_for_work(60, stop)))
    sleeper.start()
    a.leave()
    b.balance()
    sleeper.join(30)
    stop.set()
    assert woke == [True]


def test_every_row_once_while_members_come_and_go(sqlite_db: TestDatabase) -> None:
    make_table(sqlite_db, 600)
    store, clock = InMemoryCheckpointStore(), Clock()
    group = {n: member(sqlite_db, store, n, clock, partitions=4, batch_size=20) for n in "ab"}
    seen: Counter[int] = Counter()

    def handle(events: list[RowChange]) -> None:
        seen.update(e.pk["id"] for e in events)

    for step in range(60):
        clock.now += 0.3
        if step == 10:
            group["c"] = member(sqlite_db, store, "c", clock, partitions=4, batch_size=20)
        if step == 25:
            group.pop("a").leave()
        for m in group.values():
            m.tick(handle)
    for m in group.values():
        m.drain(handle)
    assert set(seen) == set(range(1, 601))
    assert max(seen.values()) == 1


def test_a_member_joining_a_working_group_does_not_wait(sqlite_db: TestDatabase) -> None:
    make_table(sqlite_db, 10)
    store, clock = InMemoryCheckpointStore(), Clock()
    a = member(sqlite_db, store, "a", clock, partitions=4, join_window_seconds=1.0)
    a.balance()
    clock.now += 1.0
    for _ in range(3):
        a.balance()
        clock.now += 1.0
    assert len(a.owned) == 4
    b = member(sqlite_db, store, "b", clock, partitions=4, join_window_seconds=1.0)
    first = b.balance()
    assert first is not None
    assert first.stolen  # at its first cycle, no join window: a already works
    assert not b.joining


@pytest.mark.parametrize("fails", [False, True])
def test_a_member_readies_its_source_in_the_join_window(
    sqlite_db: TestDatabase, fails: bool
) -> None:
    """The join window is spent connecting and reflecting, not asleep; a failure
    there is left to the first partition tick (which here reads fine)."""
    make_table(sqlite_db, 30)
    poller = member(
        sqlite_db,
        InMemoryCheckpointStore(),
        "a",
        time.monotonic,  # type: ignore[arg-type]  # the thread runs on real time
        join_window_seconds=0.3,
        background=True,
    )
    readied: list[tuple[tuple[str, ...], bool, bool]] = []
    validate = poller.source.validate

    def recording(position: Any = None) -> None:
        readied.append((poller.owned, poller.joining, poller.source.reflected_table() is None))
        if fails:
            raise StoreUnavailableError("database not there yet")
        validate(position)

    poller.source.validate = recording  # type: ignore[method-assign]
    seen: list[RowChange] = []
    try:
        assert poller.drain(seen.extend) == 30
    finally:
        poller.leave()
    assert readied == [((), True, True)]  # once, owning nothing yet, before any reflection
    assert sorted(e.pk["id"] for e in seen) == list(range(1, 31))
