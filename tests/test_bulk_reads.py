"""Bulk reads (dbtrigger.runtime.bulk): one query for several batches of a
catch-up. The handler gets what a read of ``batch_size`` rows at each batch
would give (the same batches, each committed before the next is handed out);
kept rows are used only where the batch before them landed exactly at their
start, under the same lease, and dropped in every other case."""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from dbtrigger import HandlerError, InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime import bulk
from dbtrigger.runtime.bulk import BulkReads, depth_for
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.memory import MemorySource
from dbtrigger.sources.rows import Rows, rows_to_events
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.reliability_support import NO_WAIT, add_items, items_source, items_table


class BulkSource(MemorySource):
    """A memory source that may be read in bulk, recording each read's limit."""

    bulk_reads = True

    def __init__(self, rows: int) -> None:
        super().__init__(
            ({"id": i, "v": i * 10} for i in range(1, rows + 1)),
            cursor_column="v",
            pk_columns=["id"],
            name="bulk",
        )
        self.limits: list[int] = []

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        self.limits.append(limit)
        return super().fetch(after, limit)


def trigger_for(source: Any, **options: Any) -> PollTrigger:
    options.setdefault("batch_size", 10)
    options.setdefault("max_batches_per_tick", 100)
    options.setdefault("retry", NO_WAIT)
    options.setdefault("history", False)
    options.setdefault("read_ahead", False)
    return PollTrigger(
        name="items", source=source, checkpoint_store=InMemoryCheckpointStore(), **options
    )


def ids(events: Sequence[RowChange]) -> list[int]:
    return [int(e.pk["id"]) for e in events]


def stored_position(trigger: PollTrigger) -> Any:
    stored = trigger.store.read(trigger.name)
    assert stored is not None
    return docmod.loads(stored.data).position


# --- how deep ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_size", "per_tick", "depth"),
    [
        (100, 10**6, 10),
        (10, 10**6, 10),
        (300, 10**6, 3),
        (500, 100, 2),
        (1000, 100, 1),
        (5000, 100, 1),
        (100, 1, 1),
        (100, 4, 4),
    ],
)
def test_depth(batch_size: int, per_tick: int, depth: int) -> None:
    assert depth_for(batch_size, per_tick) == depth


def test_one_batch_ticks_and_other_sources_read_one_batch_a_query() -> None:
    assert trigger_for(BulkSource(5), max_batches_per_tick=1)._driver.reader.bulk is None
    plain = MemorySource([], cursor_column="v", pk_columns=["id"])
    assert trigger_for(plain)._driver.reader.bulk is None


# --- the same batches, fewer queries ---------------------------------------------------


def test_a_catch_up_gets_the_batches_of_one_read_a_batch() -> None:
    source = BulkSource(235)
    trigger = trigger_for(source)
    batches: list[list[int]] = []
    positions: list[Any] = []

    def handler(events: list[RowChange]) -> None:
        # The batch before this one is committed before this one is handed out.
        positions.append(stored_position(trigger) if batches else None)
        batches.append(ids(events))

    assert trigger.tick(handler) == 235
    assert batches == [list(range(i, min(i + 10, 236))) for i in range(1, 236, 10)]
    assert [p.pk["id"] if p else None for p in positions] == [None, *range(10, 235, 10)]
    assert stored_position(trigger).pk == {"id": 235}
    # 24 batches from three reads of 100 rows (the last one short: nothing after it).
    assert source.limits == [100, 100, 100]
    assert trigger._driver.reader.bulk is not None
    assert trigger._driver.reader.bulk.served == 21


def test_a_stopping_tick_drops_the_rest() -> None:
    """A worker told to stop ends the tick after the batch it is on; the rows read
    beyond it are not kept for the next tick, which reads again (and so sees a
    row committed meanwhile before the rows the dropped rest held)."""
    source = BulkSource(100)
    trigger = trigger_for(source)
    seen: list[int] = []
    stop = [False]

    def handler(events: list[RowChange]) -> None:
        seen.extend(ids(events))
        stop[0] = len(seen) >= 20

    assert trigger.tick(handler, should_stop=lambda: stop[0]) == 20
    assert trigger._driver.reader.bulk is not None
    assert not trigger._driver.reader.bulk.holds
    source.put({"id": 1000, "v": 205})  # between ids 20 (v=200) and 21 (v=210)
    stop[0] = True
    assert trigger.tick(handler, should_stop=lambda: stop[0]) == 10
    assert seen[20:] == [1000, *range(21, 30)]
    assert source.limits == [100, 100]


def test_a_retry_drops_the_rest_and_reads_again() -> None:
    """ctx.retry leaves the window non-empty: the next batch is read (batch_size
    and the window's entry), not taken from the rest."""
    source = BulkSource(50)
    trigger = trigger_for(source, retry_delay_seconds=0)
    accepted: list[int] = []
    retried = False

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        nonlocal retried
        for e in events:
            if int(e.pk["id"]) == 15 and not retried:
                retried = True
                ctx.retry(e, "later")
            else:
                accepted.append(int(e.pk["id"]))

    for _ in range(20):
        trigger.tick(handler)
    assert sorted(accepted) == list(range(1, 51))
    # The bulk read, then batch_size and the window's entries (id 15 waiting, 16-20
    # settled after it), read again rather than taken from the rest.
    assert source.limits[:2] == [100, 16]


def test_a_failed_batch_drops_the_rest() -> None:
    source = BulkSource(40)
    trigger = trigger_for(source)
    calls = 0

    def handler(events: list[RowChange]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ValueError("downstream")

    with pytest.raises(HandlerError):
        trigger.tick(handler)
    assert stored_position(trigger).pk == {"id": 10}
    assert trigger._driver.reader.bulk is not None
    assert not trigger._driver.reader.bulk.holds
    assert trigger.tick(handler) == 30
    # Read again from id 10; the last batch was full, so one more (empty) read.
    assert source.limits == [100, 100, 100]


@pytest.mark.parametrize("seed", range(6))
def test_a_randomly_failing_handler_loses_and_repeats_nothing(seed: int) -> None:
    rng = random.Random(seed)
    rows = rng.randint(60, 240)
    source = BulkSource(rows)
    trigger = trigger_for(
        source,
        batch_size=rng.choice([3, 7, 10, 40]),
        max_batches_per_tick=rng.choice([2, 5, 100]),
        retry_delay_seconds=0,
    )
    accepted: list[int] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if rng.random() < 0.2:
            raise ValueError("flaky downstream")
        kept = []
        for e in events:
            if rng.random() < 0.03:
                ctx.retry(e, "later")
            else:
                kept.append(int(e.pk["id"]))
        accepted.extend(kept)

    for _ in range(3000):  # bounded: every tick makes progress with p >= 0.8
        try:
            if not trigger.tick(handler):
                stored = trigger.store.read(trigger.name)
                if stored is not None and docmod.loads(stored.data).window is None:
                    break
        except HandlerError:
            continue
    assert sorted(accepted) == list(range(1, rows + 1))  # each row accepted exactly once


# --- the rest itself -------------------------------------------------------------------


def narrow_rows(n: int, *, null_key_at: int | None = None) -> Rows:
    tuples = [(i, i * 10, f"p{i}") for i in range(1, n + 1)]
    if null_key_at is not None:
        tuples[null_key_at] = (None, tuples[null_key_at][1], "x")
    rows = Rows(("id", "v", "payload"), tuples, plain=True)
    rows.types = {0: {type(t[0]) for t in tuples}, 1: {int}}
    return rows


def test_rows_are_cut_into_batches_that_continue_exactly() -> None:
    now = [0.0]
    reads = BulkReads(depth=10, columns=("v", ["id"]), monotonic=lambda: now[0])
    first = reads.keep(narrow_rows(25), 10, "lease")
    assert isinstance(first, Rows)
    assert [t[0] for t in first.tuples] == list(range(1, 11))
    assert first.types == {0: {int}, 1: {int}}
    after = Position(cursor=100, pk={"id": 10})
    assert reads.take(Position(cursor=100, pk={"id": 9}), "lease", 10) is None  # elsewhere
    assert not reads.holds
    reads.keep(narrow_rows(25), 10, "lease")
    assert reads.take(after, "another lease", 10) is None
    reads.keep(narrow_rows(25), 10, "lease")
    assert reads.take(after, "lease", 10, plain=False) is None  # the window holds entries
    reads.keep(narrow_rows(25), 10, "lease")
    now[0] = bulk.MAX_AGE_SECONDS + 0.5
    assert reads.take(after, "lease", 10) is None  # too old
    now[0] = 0.0
    reads.keep(narrow_rows(25), 10, "lease")
    second = reads.take(after, "lease", 10)
    assert isinstance(second, Rows)
    assert [t[0] for t in second.tuples] == list(range(11, 21))
    third = reads.take(Position(cursor=200, pk={"id": 20}), "lease", 10)
    assert isinstance(third, Rows)
    assert [t[0] for t in third.tuples] == list(range(21, 26))
    assert not reads.holds


def test_a_part_checks_its_own_null_keys() -> None:
    """The types the source collected cover the whole read; a part is given them
    only when they hold no NULL, so a NULL key is named in the part holding it."""
    reads = BulkReads(depth=10, columns=("v", ["id"]))
    first = reads.keep(narrow_rows(30, null_key_at=25), 10, "t")
    assert isinstance(first, Rows)
    assert first.types is None
    events = rows_to_events(
        first, cursor_column="v", pk_columns=["id"], source="s", poller="p", batch_id="b"
    )
    assert ids(events) == list(range(1, 11))
    reads.take(Position(cursor=100, pk={"id": 10}), "t", 10)
    third = reads.take(Position(cursor=200, pk={"id": 20}), "t", 10)
    assert third is not None
    with pytest.raises(Exception, match="NULL primary key"):
        rows_to_events(
            third, cursor_column="v", pk_columns=["id"], source="s", poller="p", batch_id="b"
        )


# --- PostgreSQL ----------------------------------------------------------------------


@pytest.mark.parametrize("read_ahead", [False, "always"])
def test_a_postgresql_catch_up_reads_a_query_for_ten_batches(
    pg: TestDatabase, read_ahead: bool | str
) -> None:
    table = items_table(pg)
    add_items(pg, table, range(1, 251))
    source = items_source(pg)
    limits: list[int] = []
    fetch = source.fetch

    def counted(after: Position, limit: int) -> Any:
        limits.append(limit)
        return fetch(after, limit)

    source.fetch = counted  # type: ignore[method-assign]
    trigger = trigger_for(source, history=True, read_ahead=read_ahead)
    batches: list[list[int]] = []
    assert trigger.drain(lambda events: batches.append(ids(events))) == 250
    assert batches == [list(range(i, i + 10)) for i in range(1, 251, 10)]
    # Three reads of 100 rows, and after the last (full) batch one that comes back
    # empty, and the drain's last tick's: 5 queries instead of 27 (read ahead or not).
    assert limits == [100] * 5
    trigger.close()
    source.close()


def test_lanes_take_the_batches_from_the_rest_too() -> None:
    """With lanes the next batch is prefetched while they run: not while the rest
    holds it (the prefetch would read it again), and under the tick's lease when
    it does read, so its own rest serves the batches after it."""
    source = BulkSource(250)
    trigger = trigger_for(source, max_concurrency=2)
    seen: list[int] = []
    assert trigger.tick(lambda events: seen.extend(ids(events))) == 250
    assert sorted(seen) == list(range(1, 251))
    # The first read, then two made by the prefetch while batches 10 and 20 ran,
    # and after the last, full batch one that came back empty.
    assert source.limits == [100, 100, 100, 100]
    trigger.close()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bulk_reads_is_true_or_false(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="bulk_reads"):
        trigger_for(BulkSource(1), bulk_reads=bad)
    assert trigger_for(BulkSource(1), bulk_reads=False)._driver.reader.bulk is None


# --- with the read-ahead ---------------------------------------------------------------


class ThreadedBulkSource(BulkSource):
    """A bulk source that may be read ahead; records which thread made each read."""

    concurrent_reads = True

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.threads: list[str] = []
        self.lock = threading.Lock()

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        with self.lock:
            self.threads.append(threading.current_thread().name)
            return super().fetch(after, limit)


def test_the_read_after_the_kept_rows_is_made_while_they_are_handed_out() -> None:
    source = ThreadedBulkSource(350)
    trigger = trigger_for(source, read_ahead="always")
    batches: list[list[int]] = []
    assert trigger.tick(lambda events: batches.append(ids(events))) == 350
    assert batches == [list(range(i, i + 10)) for i in range(1, 351, 10)]
    # The first read by the tick, the three after it by the read-ahead's thread
    # while the rows before them were handed out (the last came back short, so
    # nothing was read after it meanwhile), and after the last, full batch the
    # read that comes back empty.
    assert source.limits == [100] * 5
    assert source.threads[0] == "MainThread"
    assert all(name.startswith("dbtrigger-readahead") for name in source.threads[1:])
    read_ahead = trigger._driver.reader.read_ahead
    assert read_ahead is not None
    assert (read_ahead.started, read_ahead.used, read_ahead.dropped) == (4, 4, 0)
    trigger.close()


def test_a_retry_drops_the_read_after_the_kept_rows() -> None:
    source = ThreadedBulkSource(250)
    trigger = trigger_for(source, read_ahead="always", retry_delay_seconds=0)
    accepted: list[int] = []
    retried = False

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        nonlocal retried
        for e in events:
            if int(e.pk["id"]) == 35 and not retried:
                retried = True
                ctx.retry(e, "later")
            else:
                accepted.append(int(e.pk["id"]))

    for _ in range(20):
        trigger.tick(handler)
    assert sorted(accepted) == list(range(1, 251))
    read_ahead = trigger._driver.reader.read_ahead
    assert read_ahead is not None
    assert read_ahead.dropped >= 1
    trigger.close()


@pytest.mark.parametrize("seed", range(4))
def test_read_ahead_and_a_randomly_failing_handler_lose_and_repeat_nothing(seed: int) -> None:
    rng = random.Random(seed)
    rows = rng.randint(150, 400)
    source = ThreadedBulkSource(rows)
    trigger = trigger_for(
        source,
        batch_size=rng.choice([7, 10, 40]),
        max_batches_per_tick=rng.choice([3, 100]),
        retry_delay_seconds=0,
        read_ahead="always",
    )
    accepted: list[int] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if rng.random() < 0.15:
            raise ValueError("flaky downstream")
        kept = []
        for e in events:
            if rng.random() < 0.02:
                ctx.retry(e, "later")
            else:
                kept.append(int(e.pk["id"]))
        accepted.extend(kept)

    for _ in range(3000):  # bounded: every tick makes progress with p >= 0.85
        try:
            if not trigger.tick(handler):
                stored = trigger.store.read(trigger.name)
                if stored is not None and docmod.loads(stored.data).window is None:
                    break
        except HandlerError:
            continue
    assert sorted(accepted) == list(range(1, rows + 1))
    trigger.close()
