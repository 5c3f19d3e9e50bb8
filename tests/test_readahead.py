"""Read-ahead (dbtrigger.runtime.readahead): the next batch read on a thread of
its own while the handler and the commit run, used only when it is exactly the
read the tick would make, dropped in every other case; the source never used
by two threads at once; nothing lost or delivered twice under failing handlers."""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import (
    HandlerError,
    InMemoryCheckpointStore,
    LostLeaseError,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, PartialBatchError
from dbtrigger.runtime import readahead
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.readahead import CARRY_SECONDS, ReadAhead
from dbtrigger.sources.lag import LagReading
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.reliability_support import (
    NO_WAIT,
    add_items,
    items_source,
    items_table,
    read_doc,
    steal_lease,
)


class ThreadedSource(MemorySource):
    """A memory source that may be read ahead, and says so if two threads ever
    use it at once (every call takes a lock without waiting). ``gate``, when
    set, holds reads made off the test's thread until it opens."""

    concurrent_reads = True

    def __init__(self, rows: int) -> None:
        super().__init__(
            ({"id": i, "v": i * 10} for i in range(1, rows + 1)),
            cursor_column="v",
            pk_columns=["id"],
            name="threaded",
        )
        self.busy = threading.Lock()
        self.overlaps = 0
        self.reads: list[tuple[str, int]] = []  # (thread name, first id read after)
        self.gate: threading.Event | None = None
        self.main = threading.current_thread()
        self.lag_calls = 0

    def _enter(self) -> None:
        if not self.busy.acquire(blocking=False):
            self.overlaps += 1
            self.busy.acquire()

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        if self.gate is not None and threading.current_thread() is not self.main:
            assert self.gate.wait(10)
        self._enter()
        try:
            rows = super().fetch(after, limit)
            self.reads.append((threading.current_thread().name, int(after.pk.get("id", 0))))
            return rows
        finally:
            self.busy.release()

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        self._enter()
        try:
            return super().to_events(rows, poller=poller, batch_id=batch_id)
        finally:
            self.busy.release()

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """A call the commit makes (MeasuresLag), which may run beside a read."""
        self.lag_calls += 1
        return None

    def row_age(self, row: Mapping[str, Any], now: dt.datetime) -> LagReading:
        return LagReading(None, "observed")

    def ahead(self) -> list[int]:
        """Positions read off the test's thread (the read-ahead's reads)."""
        return [at for name, at in self.reads if name.startswith("dbtrigger-readahead")]


def ids(events: Sequence[RowChange]) -> list[int]:
    return [int(e.pk["id"]) for e in events]


def trigger_for(source: Any, store: Any = None, **options: Any) -> PollTrigger:
    options.setdefault("batch_size", 10)
    options.setdefault("retry", NO_WAIT)
    options.setdefault("history", False)
    # Every case here pins what a read-ahead does once started: start one after
    # every batch (the default starts them only while reads are slow, see
    # test_adaptive_*).
    options.setdefault("read_ahead", "always")
    # One read a batch, as the cases here count (dbtrigger.runtime.bulk reads several
    # batches of a SqlAlchemySource with one query, and reads nothing ahead meanwhile).
    options.setdefault("bulk_reads", False)
    return PollTrigger(
        name="items",
        source=source,
        checkpoint_store=store if store is not None else InMemoryCheckpointStore(),
        **options,
    )


def read_ahead_of(trigger: PollTrigger) -> ReadAhead:
    read_ahead = trigger._driver.reader.read_ahead
    assert read_ahead is not None
    return read_ahead


# --- it reads ahead, and uses what it read -------------------------------------------


def test_the_next_batch_is_read_while_the_handler_runs() -> None:
    source = ThreadedSource(35)
    trigger = trigger_for(source, max_batches_per_tick=100)
    source.gate = threading.Event()
    seen: list[int] = []

    def handler(events: list[RowChange]) -> None:
        seen.extend(ids(events))
        if len(seen) == 10:
            # The read of batch 2 started before this call and waits for the gate.
            pending = read_ahead_of(trigger).pending
            assert pending is not None
            assert not pending.done.is_set()
            assert int(pending.after.pk["id"]) == 10
            assert source.gate is not None
            source.gate.set()

    assert trigger.tick(handler) == 35
    assert seen == list(range(1, 36))
    assert source.ahead() == [10, 20, 30]  # batches 2-4 read ahead, none after the short one
    ra = read_ahead_of(trigger)
    assert (ra.started, ra.used, ra.dropped) == (3, 3, 0)
    assert source.overlaps == 0
    assert source.lag_calls == 4  # every commit measured
    trigger.close()


def test_read_ahead_off_reads_after_each_commit() -> None:
    source = ThreadedSource(35)
    trigger = trigger_for(source, max_batches_per_tick=100, read_ahead=False)
    assert trigger._driver.reader.read_ahead is None
    assert trigger.drain(lambda events: None) == 35
    assert source.ahead() == []
    with pytest.raises(ConfigurationError, match="read_ahead must be True, False or 'always'"):
        trigger_for(source, read_ahead="yes")


def test_a_source_that_cannot_be_read_concurrently_is_not_read_ahead() -> None:
    source = MemorySource(
        ({"id": i, "v": i} for i in range(1, 31)), cursor_column="v", pk_columns=["id"]
    )
    trigger = trigger_for(source, max_batches_per_tick=100)
    assert trigger.tick(lambda events: None) == 30
    assert read_ahead_of(trigger).started == 0


# --- dropped whenever it is not exactly the next read ----------------------------------


def test_a_failed_handler_drops_the_read_ahead() -> None:
    source = ThreadedSource(30)
    trigger = trigger_for(source, max_batches_per_tick=100)
    seen: list[list[int]] = []

    def failing(events: list[RowChange]) -> None:
        seen.append(ids(events))
        raise ValueError("downstream refused")

    with pytest.raises(HandlerError):
        trigger.tick(failing)
    ra = read_ahead_of(trigger)
    assert (ra.started, ra.used, ra.dropped) == (1, 0, 1)
    assert ra.pending is None
    seen.clear()
    assert trigger.drain(lambda events: seen.append(ids(events))) == 30
    assert seen[0] == list(range(1, 11))  # batch 1 again, not the batch read ahead
    assert [i for batch in seen for i in batch] == list(range(1, 31))
    assert source.overlaps == 0


def test_a_partial_batch_drops_the_read_ahead() -> None:
    source = ThreadedSource(30)
    trigger = trigger_for(source, max_batches_per_tick=100)

    def partial(events: list[RowChange]) -> None:
        raise PartialBatchError([{"id": 4}], "4 failed")

    with pytest.raises(HandlerError):
        trigger.tick(partial)
    ra = read_ahead_of(trigger)
    assert (ra.used, ra.dropped) == (0, 1)
    seen: list[int] = []
    assert trigger.drain(lambda events: seen.extend(ids(events))) > 0
    assert seen[0] == 4  # the failed row again (the others settled), not from 11 on
    assert sorted(set(seen)) == [4, *range(11, 31)]


def test_a_retry_that_moves_the_window_drops_the_read_ahead() -> None:
    """ctx.retry leaves the checkpoint and the window elsewhere than "all accepted":
    the read made from there is not the next read. The batches are exactly those
    of a trigger without read-ahead."""

    def batches(read_ahead: bool | str) -> tuple[list[list[int]], int]:
        source = ThreadedSource(40)
        trigger = trigger_for(
            source, max_batches_per_tick=100, read_ahead=read_ahead, retry_delay_seconds=0
        )
        retried: set[int] = set()
        seen: list[list[int]] = []

        def handler(events: list[RowChange], ctx: BatchContext) -> None:
            seen.append(ids(events))
            for e in events:
                key = int(e.pk["id"])
                if key % 7 == 0 and key not in retried:
                    retried.add(key)
                    ctx.retry(e, "busy")

        while trigger.tick(handler):
            pass
        dropped = read_ahead_of(trigger).dropped if read_ahead else 0
        trigger.close()
        return seen, dropped

    with_ahead, dropped = batches("always")
    without, _ = batches(False)
    assert with_ahead == without
    assert dropped >= 4  # the batches holding 7, 14, 21, 28 moved the window


def test_a_lost_lease_drops_the_read_ahead() -> None:
    source = ThreadedSource(30)
    store = InMemoryCheckpointStore()
    trigger = trigger_for(source, store, max_batches_per_tick=100, heartbeat_interval_seconds=0)
    handed: list[int] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        handed.append(ctx.batch_index)
        steal_lease(store)

    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert handed == [0]  # nothing of the batch read ahead was handed out
    ra = read_ahead_of(trigger)
    assert (ra.started, ra.used, ra.dropped, ra.pending) == (1, 0, 1, None)
    assert read_doc(store).checkpoint is None


def test_a_stopping_worker_drops_the_read_ahead() -> None:
    source = ThreadedSource(30)
    trigger = trigger_for(source, max_batches_per_tick=100)
    result = trigger.tick_result(lambda events: None, should_stop=lambda: True)
    assert (result.rows, result.more) == (10, True)
    ra = read_ahead_of(trigger)
    assert (ra.started, ra.used, ra.dropped, ra.pending) == (1, 0, 1, None)


# --- one batch a tick: a read carried to the next tick ---------------------------------


def test_one_batch_ticks_carry_the_read_to_the_next_tick() -> None:
    source = ThreadedSource(45)
    trigger = trigger_for(source, max_batches_per_tick=1)
    seen: list[int] = []
    while trigger.tick(lambda events: seen.extend(ids(events))):
        pass
    assert seen == list(range(1, 46))
    ra = read_ahead_of(trigger)
    # The first tick follows none: it reads nothing ahead. Ticks 2-4 read the
    # next tick's batch; the fifth tick reads its rows again itself, because
    # the read carried to it came back short (5 rows: rows committed since
    # may be missing from it).
    assert source.ahead() == [20, 30, 40]
    assert (ra.used, ra.dropped) == (2, 1)
    assert source.overlaps == 0
    trigger.close()


@pytest.mark.parametrize("left", [0, 5])
def test_a_short_carried_read_is_read_again(left: int) -> None:
    """A read carried to the next tick that came back short or empty is not
    that tick's read: a row committed between the ticks is delivered at once
    (it was missing from the carried read; a worker that re-polls after a
    delivering tick would otherwise find nothing and sleep its interval)."""
    source = ThreadedSource(20 + left)
    trigger = trigger_for(source, max_batches_per_tick=1)
    assert trigger.tick(lambda events: None) == 10
    assert trigger.tick(lambda events: None) == 10  # reads the third batch ahead
    ra = read_ahead_of(trigger)
    assert ra.pending is not None
    assert ra.pending.done.wait(10)  # it goes on while the tick returns
    assert ra.pending.rows is not None
    assert len(ra.pending.rows) == left
    source.put({"id": 100, "v": 10_000})
    seen: list[int] = []
    assert trigger.tick(lambda events: seen.extend(ids(events))) == left + 1
    assert seen == [*range(21, 21 + left), 100]
    assert (ra.used, ra.dropped) == (0, 1)
    trigger.close()


def carried(source: ThreadedSource, trigger: PollTrigger) -> ReadAhead:
    """Two one-batch ticks: the second leaves a read of batch 3 for the next."""
    assert trigger.tick(lambda events: None) == 10
    assert trigger.tick(lambda events: None) == 10
    ra = read_ahead_of(trigger)
    assert ra.pending is not None  # it goes on while the tick returns
    assert ra.pending.done.wait(10)
    return ra


def test_a_document_written_by_someone_else_drops_the_carried_read() -> None:
    source = ThreadedSource(40)
    store = InMemoryCheckpointStore()
    trigger = trigger_for(source, store, max_batches_per_tick=1)
    ra = carried(source, trigger)
    # Another writer rewrites the same document: same position, another etag.
    stored = store.read("items")
    assert stored is not None
    store.write("items", docmod.dumps(docmod.loads(stored.data)), if_match=stored.etag)
    seen: list[int] = []
    assert trigger.tick(lambda events: seen.extend(ids(events))) == 10
    assert seen == list(range(21, 31))
    assert (ra.used, ra.dropped) == (0, 1)
    assert (threading.current_thread().name, 20) in source.reads  # read again, here


def test_an_old_carried_read_is_dropped() -> None:
    source = ThreadedSource(40)
    trigger = trigger_for(source, max_batches_per_tick=1)
    ra = carried(source, trigger)
    clock = [0.0]
    ra.monotonic = lambda: clock[0]
    assert ra.pending is not None
    clock[0] = ra.pending.finished + CARRY_SECONDS + 0.5
    assert trigger.tick(lambda events: None) == 10
    assert (ra.used, ra.dropped) == (0, 1)


def test_close_drops_the_carried_read_and_ends_the_thread() -> None:
    source = ThreadedSource(40)
    trigger = trigger_for(source, max_batches_per_tick=1)
    ra = carried(source, trigger)
    thread = ra._thread
    assert thread is not None
    trigger.close()
    assert ra.pending is None
    assert ra.dropped == 1
    assert not thread.is_alive()
    seen: list[int] = []
    assert trigger.drain(lambda events: seen.extend(ids(events))) == 20
    assert seen == list(range(21, 41))  # after close the trigger reads again, and on


def test_the_reader_thread_exits_when_idle() -> None:
    ra = ReadAhead(lambda after, limit: [], name="idle", linger=0.01)
    ra.start(Position(), 10, "t")
    assert ra.take(Position(), 10, "t") is not None
    thread = ra._thread
    if thread is not None:
        thread.join(5)
        assert not thread.is_alive()
    ra.start(Position(), 10, "t")  # a new read starts it again
    assert ra.take(Position(), 10, "u") is None  # another tag: dropped
    assert (ra.started, ra.used, ra.dropped) == (2, 1, 1)
    ra.close()


# --- nothing lost, nothing twice, under a handler failing at random --------------------


@pytest.mark.parametrize("seed", range(6))
def test_a_randomly_failing_handler_loses_and_repeats_nothing(seed: int) -> None:
    rng = random.Random(seed)
    rows = rng.randint(60, 140)
    source = ThreadedSource(rows)
    trigger = trigger_for(
        source,
        batch_size=rng.choice([3, 7, 10]),
        max_batches_per_tick=rng.choice([1, 2, 5, 100]),
        retry_delay_seconds=0,
    )
    accepted: list[int] = []  # events of handler calls that returned, in order

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if rng.random() < 0.25:
            raise ValueError("flaky downstream")
        kept = []
        for e in events:
            if rng.random() < 0.05:
                ctx.retry(e, "later")
            else:
                kept.append(int(e.pk["id"]))
        accepted.extend(kept)

    for _ in range(2000):  # bounded: every tick makes progress with p >= 0.75
        try:
            if not trigger.tick(handler) and read_doc_window_empty(trigger):
                break
        except HandlerError:
            continue
    assert sorted(accepted) == list(range(1, rows + 1))  # each row accepted exactly once
    assert source.overlaps == 0
    trigger.close()


def read_doc_window_empty(trigger: PollTrigger) -> bool:
    stored = trigger.store.read(trigger.name)
    return stored is not None and docmod.loads(stored.data).window is None


# --- PostgreSQL: the connection a catch-up keeps ---------------------------------------


def test_a_catch_up_reads_ahead_on_the_connection_it_keeps(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """The fetches keep their connection between them whichever thread reads
    (no more checkouts than without read-ahead: the first fetch, the NULL-cursor
    probe's and the lag query's own connections, and a fetch after each of
    those), and no connection is ever used by two threads at once."""
    table = items_table(pg)
    add_items(pg, table, range(1, 201))
    runs = {flag: drain_counting(items_source(pg), flag) for flag in (False, "always")}
    assert runs["always"].clashes == runs[False].clashes == []
    assert runs["always"].used == 20  # batches 2-20 and the empty read after them
    assert "dbtrigger-readahead-items" in runs["always"].checkouts
    # No more checkouts than without read-ahead (fewer when the lag query, which
    # gives the kept connection back, runs while the reader holds it).
    assert len(runs["always"].checkouts) <= len(runs[False].checkouts) <= 8


@dataclass
class Counted:
    checkouts: list[str] = field(default_factory=list)
    clashes: list[str] = field(default_factory=list)
    used: int = 0


def drain_counting(source: SqlAlchemySource, read_ahead: bool | str) -> Counted:
    counted = Counted()
    in_use: dict[int, str] = {}
    lock = threading.Lock()
    engine = source._guarding.fetch_engine(source.engine)  # the fetches' pool

    @sa.event.listens_for(engine, "checkout")
    def checkout(dbapi: Any, record: Any, proxy: Any) -> None:
        counted.checkouts.append(threading.current_thread().name)

    original = source._read

    def read(conn: sa.Connection, after: Position, limit: int) -> Any:
        key = id(conn.connection.dbapi_connection)
        me = threading.current_thread().name
        with lock:
            if key in in_use:
                counted.clashes.append(f"{me} and {in_use[key]}")
            in_use[key] = me
        try:
            return original(conn, after, limit)
        finally:
            with lock:
                in_use.pop(key, None)

    source._read = read  # type: ignore[method-assign]
    trigger = trigger_for(source, max_batches_per_tick=100, history=True, read_ahead=read_ahead)
    seen: list[int] = []
    assert trigger.drain(lambda events: seen.extend(ids(events))) == 200
    assert seen == list(range(1, 201))
    if read_ahead:
        counted.used = read_ahead_of(trigger).used
    trigger.close()
    source.close()
    return counted


def test_only_exactly_the_read_asked_for_is_used() -> None:
    """Position, limit and tag must all match (the tick's checks in one place)."""
    at, elsewhere = Position(cursor=10, pk={"id": 1}), Position(cursor=20, pk={"id": 2})
    ra = ReadAhead(lambda after, limit: [{"id": 3, "v": 30}], name="exact")
    for asked in ((elsewhere, 10, "t"), (at, 11, "t"), (at, 10, "u")):
        ra.start(at, 10, "t")
        assert ra.take(*asked) is None
        assert ra.pending is None
    ra.start(at, 10, "t")
    flight = ra.take(at, 10, "t")
    assert flight is not None
    assert flight.rows == [{"id": 3, "v": 30}]
    assert (ra.started, ra.used, ra.dropped) == (4, 1, 3)
    ra.close()


def test_a_failed_read_is_dropped_and_read_again() -> None:
    def failing(after: Position, limit: int) -> list[dict[str, int]]:
        raise RuntimeError("server went away")

    ra = ReadAhead(failing, name="failing")
    ra.start(Position(), 10, "t")
    assert ra.take(Position(), 10, "t") is None
    assert (ra.used, ra.dropped) == (0, 1)
    ra.close()


def test_source_calls_between_ticks_beside_a_carried_read(pg: TestDatabase) -> None:
    """A carried read goes on while the tick returns; what the worker asks of
    the source meanwhile (a count, the lag) runs on connections of its own:
    no connection is used by two threads, and every row comes once, in order."""
    table = items_table(pg)
    add_items(pg, table, range(1, 61))
    source = items_source(pg)
    in_use: dict[int, str] = {}
    clashes: list[str] = []
    lock = threading.Lock()
    engine = source._guarding.fetch_engine(source.engine)

    @sa.event.listens_for(engine, "checkout")
    def checkout(dbapi: Any, record: Any, proxy: Any) -> None:
        me = threading.current_thread().name
        with lock:
            if id(dbapi) in in_use:
                clashes.append(f"{me} and {in_use[id(dbapi)]}")
            in_use[id(dbapi)] = me

    @sa.event.listens_for(engine, "checkin")
    def checkin(dbapi: Any, record: Any) -> None:
        with lock:
            in_use.pop(id(dbapi), None)

    trigger = trigger_for(source, max_batches_per_tick=1)
    seen: list[int] = []
    while trigger.tick(lambda events: seen.extend(ids(events))):
        source.count_after(Position())  # beside the read carried into the next tick
    assert seen == list(range(1, 61))
    assert read_ahead_of(trigger).used >= 4
    assert not clashes
    trigger.close()
    source.close()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_tick_does_not_wait_for_a_read_in_flight(
    interrupt: type[BaseException],
) -> None:
    """A second Ctrl-C to dbtrigger run raises KeyboardInterrupt in the handler:
    the tick and close() return without waiting for a read-ahead that a lock
    may hold (here: a gate), and the next tick waits for that read before its
    own, so two reads never run at once."""
    source = ThreadedSource(40)
    trigger = trigger_for(source, max_batches_per_tick=5)
    source.gate = threading.Event()
    raised: list[BaseException] = []

    def handler(events: Sequence[RowChange]) -> None:
        raise interrupt

    def interrupted() -> None:
        try:
            trigger.tick(handler)
        except BaseException as exc:  # what the tick raised, checked below
            raised.append(exc)
        trigger.close()

    worker = threading.Thread(target=interrupted)
    source.main = worker  # the gate holds the read-ahead's reads, not the tick's own
    worker.start()
    worker.join(5)
    ended = not worker.is_alive()
    source.gate.set()  # the read held at the gate ends now
    worker.join(15)
    assert ended, "the interrupted tick (or close()) waited for the read in flight"
    assert [type(e) for e in raised] == [interrupt]
    source.main = threading.current_thread()
    seen: list[int] = []
    while trigger.tick(lambda events: seen.extend(ids(events))):
        pass
    assert seen == list(range(1, 41))
    assert source.overlaps == 0


# --- adaptive: read ahead only while the reads wait ----------------------------------


def test_adaptive_reads_ahead_only_after_enough_slow_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decision, table by table: the last SAMPLES reads the tick made itself
    must each have waited MIN_WAIT_SECONDS; while on, one batch in PROBE_EVERY
    is read by the tick again; "always" does not look."""
    monkeypatch.setattr(readahead, "MIN_WAIT_SECONDS", 0.001)
    ra = ReadAhead(lambda after, limit: [], name="t")
    assert not ra.wanted()  # nothing measured yet
    ra.observe(0.002)
    ra.observe(0.002)
    assert not ra.wanted()  # too few
    ra.observe(0.002)
    assert [ra.wanted() for _ in range(readahead.PROBE_EVERY)] == [True] * (
        readahead.PROBE_EVERY - 1
    ) + [False]  # the probe: the tick reads itself
    ra.observe(0.0001)  # the probe's read was fast
    assert not ra.wanted()
    ra.observe(0.002)
    ra.observe(0.002)
    assert not ra.wanted()  # the fast one is still among the last SAMPLES
    ra.observe(0.002)
    assert ra.wanted()
    assert ra.skipped == 5
    always = ReadAhead(lambda after, limit: [], name="t", always=True)
    assert always.wanted()
    assert list(always.waits) == []


class SlowSource(ThreadedSource):
    """A ThreadedSource whose reads wait ``delay`` seconds (the GIL released, as
    a socket wait releases it), the tick's own and the read-ahead's."""

    delay = 0.0

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        if self.delay:
            time.sleep(self.delay)
        return super().fetch(after, limit)


def test_adaptive_default_reads_ahead_while_reads_wait_and_stops_when_they_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default: slow reads (a database across a network) are read ahead after
    the first SAMPLES batches; once they are fast, the next probe turns it off."""
    monkeypatch.setattr(readahead, "MIN_WAIT_SECONDS", 0.005)
    monkeypatch.setattr(readahead, "PROBE_EVERY", 4)
    source = SlowSource(400)
    source.delay = 0.02
    trigger = trigger_for(source, max_batches_per_tick=20, read_ahead=True)
    seen: list[int] = []
    assert trigger.tick(lambda events: seen.extend(ids(events))) == 200
    ra = read_ahead_of(trigger)
    # Batches 1-3 read by the tick (measured), then ahead but for each 4th (a probe).
    assert source.ahead()[:3] == [30, 40, 50]
    assert ra.used == ra.started >= 12
    source.delay = 0.0
    # From here the reads are instant; what the tick measures of them is the
    # machine's scheduling, which a loaded machine can stretch past any
    # threshold. The decision is then fed what the source waited (0), so the
    # bound below does not depend on load; the measuring itself is what the
    # slow half above relies on (a 20 ms wait is never measured shorter).
    observe = ra.observe
    monkeypatch.setattr(ra, "observe", lambda wait: observe(source.delay))
    before = len(source.ahead())
    assert trigger.tick(lambda events: seen.extend(ids(events))) == 200
    # At most until the next probe (PROBE_EVERY batches) is anything read ahead.
    assert len(source.ahead()) - before <= 4
    assert seen == list(range(1, 401))
    trigger.close()


def test_adaptive_default_does_not_read_ahead_fast_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(readahead, "MIN_WAIT_SECONDS", 1.0)
    source = SlowSource(100)
    trigger = trigger_for(source, max_batches_per_tick=100, read_ahead=True)
    assert trigger.drain(lambda events: None) == 100
    ra = read_ahead_of(trigger)
    assert source.ahead() == []
    assert ra.started == 0
    assert ra.skipped == 10  # after each full batch (the 10th too: more may come)
    assert len(ra.waits) == readahead.SAMPLES
    trigger.close()
