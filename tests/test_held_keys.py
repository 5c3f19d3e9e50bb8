"""Rows held back by per-key order do not fill the read (a stall with a small ``batch_size``).

A change the handler retries holds back the later changes of its key until it
settles (docs/reliability.md, "Per-key order"). The read of a batch was
``batch_size`` rows plus the window's entries, and held rows are neither: with
``batch_size=1``, key 1's first change retried and one more change of key 1
after it, every read returned only key 1's rows, and key 2's row, committed
after them, was not handed out until the retry settled - never, while the
handler kept failing it and no dead-letter sink took it. Ticks reported
``idle``; the one WARNING said only that rows wait behind the retried change.
Now the read widens past the held rows (up to ``window_max_events`` of them),
and what lies beyond even that is said at WARNING with what to do.

On every log source, where one key has many rows: the in-memory log (and a
Hypothesis search over it), the change log on SQLite, PostgreSQL and MariaDB,
PostgreSQL logical decoding and the MariaDB binlog. (A claim queue cannot
have it: one row per key, no per-key holding, and its claim selects due rows
only, ordered by when they are due.)
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import BinlogSource, PgLogicalSource
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources import SourceAdapter
from dbtrigger.testing import MemoryLogSource
from tests.cdc_servers import BinlogDatabase, CdcDatabase
from tests.databases import TestDatabase

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

#: A change: (key, version); each key's versions count up from 0 in commit order.
Change = tuple[int, int]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now


@dataclass
class Pinning:
    """Retries the changes in ``pinned`` while ``pin`` is set; applies the rest."""

    pinned: set[Change]
    pin: bool = True
    handed: list[Change] = field(default_factory=list)
    applied: list[Change] = field(default_factory=list)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            assert e.after is not None
            change = (int(e.pk["id"]), int(e.after["n"]))
            self.handed.append(change)
            if self.pin and change in self.pinned:
                ctx.retry(e, "downstream answers 429")
                continue
            self.applied.append(change)


def poller(source: SourceAdapter, clock: Clock, batch_size: int, **kw: Any) -> PollTrigger:
    return PollTrigger(
        name=f"held_{uuid.uuid4().hex[:8]}",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        clock=clock,
        batch_size=batch_size,
        retry=RetryPolicy.none(),
        **kw,
    )


def flows_past(
    trigger: PollTrigger,
    clock: Clock,
    handler: Pinning,
    changes: list[Change],
    *,
    fan_out: bool = False,
) -> int:
    """Tick with the clock stopped (the pinned changes never come due) until every
    change of the keys nothing pins is applied; then let the pinned ones settle
    and drain. Returns the ticks it took; checks none is lost and each key's
    changes were last applied in commit order. ``fan_out``: ``handler`` is one
    of the trigger's subscribers."""
    pinned_keys = {k for k, _ in handler.pinned}
    others = {c for c in changes if c[0] not in pinned_keys}
    bound = len(changes) + 2  # each tick hands out a batch while one is there
    ticks = 0
    while not others <= set(handler.applied):
        if ticks == bound:
            missing = sorted(others - set(handler.applied))
            pytest.fail(f"after {bound} ticks {missing} still not handed out: {handler.handed}")
        trigger.tick(None if fan_out else handler)
        ticks += 1
    handler.pin = False
    clock.now += dt.timedelta(hours=1)  # past any backoff
    trigger.drain(None if fan_out else handler)
    assert set(handler.applied) == set(changes)  # none lost
    for key in {k for k, _ in changes}:
        last: dict[int, int] = {}
        for n, (k, version) in enumerate(handler.applied):
            if k == key:
                last[version] = n
        order = sorted(last, key=last.__getitem__)
        assert order == sorted(order), f"key {key}: changes last applied in order {order}"
    return ticks


def commit_memory(source: MemoryLogSource, changes: list[Change]) -> None:
    for key, version in changes:
        op = "insert" if version == 0 else "update"
        source.commit([{"op": op, "pk": {"id": key}, "after": {"id": key, "n": version}}])


#: Key 1 inserted and updated five times, then key 2 inserted, each in its own transaction.
SCENARIO: list[Change] = [(1, v) for v in range(6)] + [(2, 0)]


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_a_retried_key_with_later_changes_does_not_stop_other_keys(batch_size: int) -> None:
    source = MemoryLogSource()
    commit_memory(source, SCENARIO)
    clock = Clock()
    handler = Pinning({(1, 0)})
    ticks = flows_past(poller(source, clock, batch_size), clock, handler, SCENARIO)
    assert ticks <= 2  # the retry's batch, then key 2 (before: never, while 1 waited)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_fan_out_other_keys_flow_past_a_key_one_subscriber_retries(batch_size: int) -> None:
    """With subscribers the changes a retrying subscriber owes wait in the window;
    the changes not read yet are held as they are for a single handler."""
    source = MemoryLogSource()
    commit_memory(source, SCENARIO)
    clock = Clock()
    replica, audit = Pinning({(1, 0)}), Pinning(set())
    subscribers = {"replica": replica, "audit": audit}
    trigger = poller(source, clock, batch_size, subscribers=subscribers)
    assert flows_past(trigger, clock, replica, SCENARIO, fan_out=True) <= 2
    assert sorted(audit.applied) == sorted(SCENARIO)  # each once, each key in order:
    assert [c for c in audit.applied if c[0] == 1] == [c for c in SCENARIO if c[0] == 1]


def test_held_rows_beyond_the_window_bound_are_said_at_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More held rows than ``window_max_events``: the read goes no further, and
    the WARNING says so and what to do; the rows flow once the retry settles."""
    source = MemoryLogSource()
    changes = [(1, v) for v in range(12)] + [(2, 0)]
    commit_memory(source, changes)
    clock = Clock()
    trigger = poller(source, clock, 1, window_max_events=4)
    handler = Pinning({(1, 0)})
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        for _ in range(3):
            trigger.tick(handler)
    assert (2, 0) not in handler.handed  # 11 held rows, more than the 4 read past
    blocked = [r for r in caplog.records if getattr(r, "event", None) == "window_blocked"]
    assert [getattr(r, "blocked_by", None) for r in blocked] == ["crowded"]
    assert "raise window_max_events" in blocked[0].getMessage()
    handler.pin = False
    clock.now += dt.timedelta(hours=1)
    trigger.drain(handler)
    assert handler.applied == changes


@given(
    writes=st.lists(st.integers(1, 4), min_size=1, max_size=30),
    pinned=st.sets(st.tuples(st.integers(1, 4), st.integers(0, 3)), max_size=4),
    batch_size=st.integers(1, 3),
    lanes=st.sampled_from([1, 2]),
)
def test_other_keys_flow_past_any_retried_changes(
    writes: list[int], pinned: set[Change], batch_size: int, lanes: int
) -> None:
    """Any commits over four keys, any changes retried while the clock stands
    still: every change of a key nothing pins is handed out within a bounded
    number of ticks, none is lost, and each key's last applications are in
    commit order."""
    versions: dict[int, int] = {}
    changes: list[Change] = []
    for key in writes:
        changes.append((key, versions.get(key, 0)))
        versions[key] = versions.get(key, 0) + 1
    source = MemoryLogSource()
    commit_memory(source, changes)
    clock = Clock()
    handler = Pinning({c for c in pinned if c in changes})
    trigger = poller(source, clock, batch_size, max_concurrency=lanes)
    flows_past(trigger, clock, handler, changes)


# --- the same on real databases ---------------------------------------------------------------


def orders_table(db: TestDatabase) -> str:
    db.execute(f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, n INTEGER)")
    install(db.engine, "orders", schema=db.schema)
    return db.qualified("orders")


def write_sql(execute: Callable[[str], None], table: str, changes: list[Change]) -> None:
    for key, version in changes:
        if version == 0:
            execute(f"INSERT INTO {table} (id, n) VALUES ({key}, 0)")
        else:
            execute(f"UPDATE {table} SET n = {version} WHERE id = {key}")


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_change_log(db: TestDatabase, batch_size: int) -> None:
    table = orders_table(db)
    write_sql(db.execute, table, SCENARIO)
    source = ChangeLogSource(
        url=db.url,
        table="orders",
        schema=db.schema,
        visibility="none" if db.kind == "mariadb" else "auto",
    )
    clock = Clock()
    trigger = poller(source, clock, batch_size)
    try:
        assert flows_past(trigger, clock, Pinning({(1, 0)}), SCENARIO) <= 2
    finally:
        trigger.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_postgresql_logical_decoding(cdc_db: CdcDatabase, batch_size: int) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, n int)")
    source = PgLogicalSource(cdc_db.url, ["t"], snapshot="never")
    clock = Clock()
    trigger = poller(source, clock, batch_size)
    try:
        trigger.drain(lambda events: None)  # the slot, before the changes
        write_sql(cdc_db.execute, "t", SCENARIO)
        assert flows_past(trigger, clock, Pinning({(1, 0)}), SCENARIO) <= 2
    finally:
        trigger.close()
        source.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_mariadb_binlog(binlog_db: BinlogDatabase, batch_size: int) -> None:
    binlog_db.execute("CREATE TABLE items (id INT PRIMARY KEY, n INT)")
    source = BinlogSource(binlog_db.url, ["items"], reader="r1")
    clock = Clock()
    trigger = poller(source, clock, batch_size)
    try:
        trigger.drain(lambda events: None)  # set up on the table, before the changes
        write_sql(binlog_db.execute, "items", SCENARIO)
        assert flows_past(trigger, clock, Pinning({(1, 0)}), SCENARIO) <= 2
    finally:
        trigger.close()
        source.close()


class CountingLog(MemoryLogSource):
    """Counts reads and the rows they asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.limits: list[int] = []

    def fetch(self, after: Any, limit: int) -> Any:
        self.limits.append(limit)
        return super().fetch(after, limit)


def test_the_read_widens_in_few_steps() -> None:
    """500 held changes before key 2's row: a handful of reads a batch (the read
    doubles its reach), not one per held row, and never past the bound."""
    source = CountingLog()
    changes = [(1, v) for v in range(501)] + [(2, 0)]
    commit_memory(source, changes)
    clock = Clock()
    trigger = poller(source, clock, 1, max_batches_per_tick=1)
    handler = Pinning({(1, 0)})
    trigger.tick(handler)  # (1, 0), retried
    source.limits.clear()
    trigger.tick(handler)
    assert handler.handed == [(1, 0), (2, 0)]
    assert len(source.limits) <= 10
    assert max(source.limits) <= 2 + 1000  # batch_size and the window, and the bound
