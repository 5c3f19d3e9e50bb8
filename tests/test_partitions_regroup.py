"""Changing the partition count under load: nothing lost, nothing delivered twice."""

from __future__ import annotations

import contextlib
import datetime as dt
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.errors import ConfigurationError, LiveLeaseError
from dbtrigger.partitions import PartitionedPoller, bucket_of, regroup
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.state.stores.base import CheckpointStore
from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command
from tests.test_partitions_poller import insert, make_table, source

_MADE: list[PartitionedPoller] = []


@pytest.fixture(autouse=True)
def _members_leave() -> Iterator[None]:
    """Members a test made leave at its end, so no balance thread outlives its tmp dir."""
    yield
    while _MADE:
        member = _MADE.pop()
        with contextlib.suppress(Exception):  # the test is over; its store may be gone
            member.leave()


def members(db: TestDatabase, store: CheckpointStore, count: int) -> list[PartitionedPoller]:
    made = [
        PartitionedPoller(
            name="orders",
            source=source(db),
            checkpoint_store=store,
            partitions=4,
            balance_interval_seconds=0.2,
            # No member is ever declared dead here: under heavy machine load (load
            # average 14 on 2 cores) a batch took 1.5 s, past a 1 s TTL, and the other
            # member took the partitions over (delivering that batch again).
            member_ttl_seconds=60.0,
            min_hold_cycles=1,
            join_window_seconds=0,  # the test balances by hand
            member_id=f"m{i}",
            batch_size=20,
            max_batches_per_tick=2,
        )
        for i in range(count)
    ]
    _MADE.extend(made)
    return made


def test_split_and_merge_under_load_lose_and_repeat_nothing(
    db: TestDatabase, tmp_path: Path
) -> None:
    make_table(db, 200)
    store = FileCheckpointStore(tmp_path / "state")
    group = members(db, store, 2)
    admin = members(db, store, 1)[0]
    delivered: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    next_id = [201]

    def handle(events: list[RowChange]) -> None:
        with lock:
            delivered.extend(e.pk["id"] for e in events)

    def work(member: PartitionedPoller) -> None:
        try:
            while not stop.is_set():
                if member.tick(handle) == 0:
                    time.sleep(0.02)
        except BaseException as exc:
            errors.append(exc)

    def write() -> None:
        while not stop.is_set():
            insert(db, range(next_id[0], next_id[0] + 5))
            next_id[0] += 5
            time.sleep(0.01)

    threads = [threading.Thread(target=work, args=(m,)) for m in group]
    threads.append(threading.Thread(target=write))
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        split = regroup.apply(admin, 8, actor="test", reason="more throughput", wait_seconds=20)
        assert len(split.moves) == 8
        time.sleep(1.0)
        merged = regroup.apply(admin, 4, actor="test", reason="fewer", wait_seconds=20)
        assert len(merged.moves) == 4
        assert any(child.floors or True for child, _ in merged.moves)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors
    inserted = next_id[0] - 1
    for _ in range(20):  # ownership may move while they drain: again, until all is in
        for member in group:
            member.balance()
        for member in group:
            member.drain(handle)
        if set(delivered) >= set(range(1, inserted + 1)):
            break
    counts = Counter(delivered)
    assert sorted(counts) == list(range(1, inserted + 1)), "a row was lost"
    assert counts.most_common(1)[0][1] == 1, f"delivered twice: {counts.most_common(3)}"
    for member in group:
        member.leave()
    doc, _ = admin.load_membership()
    assert len(doc.partitions) == 4
    assert doc.generation == 3
    assert doc.members == {}


def test_regroup_waits_for_a_batch_in_flight_or_refuses(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    make_table(sqlite_db, 50)
    store = FileCheckpointStore(tmp_path / "state")
    (member,) = members(sqlite_db, store, 1)
    member.balance()
    started = threading.Event()
    release = threading.Event()

    def slow(events: list[RowChange]) -> None:
        started.set()
        release.wait(10)

    pid = member.owned[0]
    thread = threading.Thread(target=member.trigger(pid).tick, args=(slow,))
    thread.start()
    started.wait(10)
    with pytest.raises(LiveLeaseError, match="--force"):
        regroup.apply(member, 8, actor="t", reason="r", wait_seconds=0.3)
    release.set()
    thread.join(10)
    done = regroup.apply(member, 8, actor="t", reason="r", wait_seconds=5)
    assert len(done.moves) == 8
    member.leave()


def test_counts_that_would_rehash_are_refused(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    make_table(sqlite_db, 5)
    (member,) = members(sqlite_db, FileCheckpointStore(tmp_path / "s"), 1)
    member.balance()
    with pytest.raises(ConfigurationError, match="split or merge cleanly"):
        regroup.apply(member, 3, actor="t", reason="r")


def test_cli_show_split_and_merge(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    make_table(sqlite_db, 100)
    module = tmp_path / "app_partitions.py"
    module.write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import FileCheckpointStore, SqlAlchemySource
            from dbtrigger.partitions import PartitionedPoller

            trigger = PartitionedPoller(
                name="orders",
                source=SqlAlchemySource(url={sqlite_db.url!r}, table="orders",
                                        cursor_column="seq", pk_columns=["id"]),
                checkpoint_store=FileCheckpointStore({str(tmp_path / "state")!r}),
                partitions=2,
                batch_size=10,
                max_batches_per_tick=20,
            )

            @trigger.handler
            def handle(events):
                pass
            """
        )
    )
    exe = dbtrigger_command()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [exe, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False
        )

    ran = cli("run", "app_partitions:trigger", "--max-ticks", "2", "--interval", "0.1")
    assert ran.returncode == 0, ran.stderr
    shown = cli("partitions", "show", "--trigger", "app_partitions:trigger")
    assert shown.returncode == 0, shown.stderr
    assert "2 partitions" in shown.stdout
    assert shown.stdout.count(" 0  ") >= 2 or "lag" in shown.stdout
    dry = cli("partitions", "split", "--trigger", "app_partitions:trigger")
    assert "p000-064: split from p000-128" in dry.stdout
    assert "dry run" in dry.stdout
    no_reason = cli("partitions", "split", "--trigger", "app_partitions:trigger", "--yes")
    assert no_reason.returncode == 2
    assert "--reason" in no_reason.stderr
    split = cli(
        "partitions",
        "split",
        "--trigger",
        "app_partitions:trigger",
        "--yes",
        "--reason",
        "load",
        "--backup-dir",
        str(tmp_path / "bk"),
    )
    assert split.returncode == 0, split.stderr
    assert len(list((tmp_path / "bk").iterdir())) == 3  # membership + two parents
    shown = cli("partitions", "show", "--trigger", "app_partitions:trigger", "--json")
    assert '"p192-256"' in shown.stdout
    status = cli("status", "--store", str(tmp_path / "state"))
    assert status.returncode == 0, status.stdout + status.stderr
    assert "partitioned poller orders: 4 partitions" in status.stdout
    assert "p064-128" in status.stdout
    bad = cli("partitions", "set", "--trigger", "app_partitions:trigger", "--count", "3")
    assert bad.returncode == 2
    assert "split or merge cleanly" in bad.stderr
    assert sys.executable


def test_a_parent_never_ticked_is_locked_too(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """Without a document a parent still gets the lock: a first commit after the
    split's read would otherwise be delivered again by the children."""
    make_table(sqlite_db, 40)
    store = FileCheckpointStore(tmp_path / "state")
    (member,) = members(sqlite_db, store, 1)
    member.balance()
    parent = member.trigger(member.owned[0])  # built for the old layout, never ticked
    regroup.apply(member, 8, actor="t", reason="r", wait_seconds=1)
    seen: list[int] = []
    assert parent.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 0
    assert parent.last_result is not None
    assert parent.last_result.outcome == "lease_busy"
    member.balance()
    member.drain(lambda events: seen.extend(e.pk["id"] for e in events))
    assert sorted(seen) == list(range(1, 41))


def test_a_reset_of_a_merged_partition_delivers_its_rows_again(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A merge leaves floors (rows each parent delivered are skipped); they stayed
    after ``dbtrigger reset <partition> --to-beginning``, so that reset delivered
    only the rows of the parent with the lowest checkpoint. Here the member keeps
    the trigger it built before the reset (no balance cycle in between)."""
    from dbtrigger.cli import main  # noqa: PLC0415
    from dbtrigger.partitions import bucket_of  # noqa: PLC0415

    make_table(sqlite_db, 200)
    state = tmp_path / "state"
    store = FileCheckpointStore(state)
    (member,) = members(sqlite_db, store, 1)
    member.balance()
    member.drain(lambda events: None)
    insert(sqlite_db, range(201, 204))  # the parents' checkpoints now differ
    member.drain(lambda events: None)
    regroup.apply(member, 2, actor="t", reason="r", wait_seconds=5)
    member.balance()
    pid = "p000-128"
    assert member.membership is not None
    floors = member.membership.partition(pid).floors  # type: ignore[union-attr]
    assert floors, "the merge left no floor: the test proves nothing"
    delivered: list[int] = []
    member.drain(lambda events: delivered.extend(e.pk["id"] for e in events))
    assert delivered == []
    code = main(
        [
            *("reset", f"orders.{pid}", "--to-beginning", "--store", str(state)),
            *("--reason", "deliver again", "--yes", "--backup-dir", str(tmp_path / "b")),
        ]
    )
    assert code == 0
    trigger = member.trigger(pid)
    while trigger.tick(lambda events: delivered.extend(e.pk["id"] for e in events)):
        pass
    expected = sorted(i for i in range(1, 204) if bucket_of([i]) < 128)
    assert sorted(delivered) == expected


def test_a_merged_partition_past_its_floors_stops_reading_the_layout(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """While a merged partition has floors, each fetch reads the layout again (a reset
    may have dropped them); once its checkpoint is past every floor they exclude
    nothing, and the fetches stop costing a store read each."""
    make_table(sqlite_db, 200)
    store = FileCheckpointStore(tmp_path / "state")
    (member,) = members(sqlite_db, store, 1)
    member.balance()
    member.drain(lambda events: None)
    insert(sqlite_db, range(201, 204))  # the parents' checkpoints now differ
    member.drain(lambda events: None)
    regroup.apply(member, 2, actor="t", reason="r", wait_seconds=5)
    member.balance()
    pid = "p000-128"
    assert member.membership is not None
    assert member.membership.partition(pid).floors  # type: ignore[union-attr]
    trigger = member.trigger(pid)
    source = trigger.source
    assert isinstance(source, PartitionSource)
    reads: list[int] = []
    follow = source._floors_now
    assert follow is not None

    def floors_now() -> Any:  # what the partition asks the layout (a store read)
        reads.append(1)
        return follow()

    source._floors_now = floors_now
    delivered: list[int] = []
    trigger.tick(lambda events: delivered.extend(e.pk["id"] for e in events))
    assert reads, "below its floors the partition follows the layout"
    insert(sqlite_db, range(300, 400))  # rows of every bucket, above every floor
    while trigger.tick(lambda events: delivered.extend(e.pk["id"] for e in events)):
        pass
    reads.clear()
    insert(sqlite_db, range(400, 500))
    while trigger.tick(lambda events: delivered.extend(e.pk["id"] for e in events)):
        pass
    assert not reads, f"{len(reads)} layout reads past the floors"
    expected = sorted(i for i in range(300, 500) if bucket_of([i]) < 128)
    assert sorted(delivered) == expected


def test_a_fenced_sink_accepts_a_partition_made_again_by_a_regroup(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """The sink reliability.md describes (the highest ``ctx.fencing_token`` per
    poller, lower ones refused), keyed by ``ctx.poller_name``: a regroup wrote each
    new partition's document afresh, so a partition made again (split, merge, split
    back) restarted at token 1 below what the sink had accepted from it, and the
    sink refused every batch of it for good. A regrouped partition's first token is
    above its own earlier ones and its parents'."""
    make_table(sqlite_db, 120)
    store = FileCheckpointStore(tmp_path / "state")
    (member,) = members(sqlite_db, store, 1)
    highest: dict[str, int] = {}
    refused: list[tuple[str, int, int]] = []

    def fenced_sink(events: list[RowChange], ctx: Any) -> None:
        seen = highest.get(ctx.poller_name, 0)
        if ctx.fencing_token < seen:
            refused.append((ctx.poller_name, ctx.fencing_token, seen))
            raise RuntimeError("stale writer")
        highest[ctx.poller_name] = ctx.fencing_token

    def drain() -> None:
        member.balance()
        with contextlib.suppress(Exception):
            member.drain(fenced_sink, max_ticks=20)

    drain()
    next_id = 1000
    for count in (8, 4, 8):
        for _ in range(3):  # every tick with rows takes the lease again: tokens climb
            insert(sqlite_db, range(next_id, next_id + 40))
            next_id += 40
            drain()
        regroup.apply(member, count, actor="t", reason="r", wait_seconds=5)
    insert(sqlite_db, range(next_id, next_id + 40))
    drain()
    assert refused == []
    assert set(highest) >= {f"orders.{p}" for p in ("p000-032", "p000-064")}


def test_a_split_right_after_a_merge_keeps_the_floors(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Text keys: a merge starts its partitions from the beginning with a floor per
    parent (only the database knows the order). Split again before any tick, the
    children get those floors clipped to their ranges: nothing the first layout
    delivered comes again, and rows updated since (a higher cursor) come once."""
    table = sqlite_db.qualified("orders")
    sqlite_db.execute(f"CREATE TABLE {table} (id VARCHAR(10) PRIMARY KEY, seq INTEGER NOT NULL)")

    def write(keys: list[str], seq0: int) -> None:
        with sqlite_db.engine.begin() as conn:
            conn.exec_driver_sql(
                f"INSERT OR REPLACE INTO {table} (id, seq) VALUES (?, ?)",
                [(k, seq0 + i) for i, k in enumerate(keys)],
            )

    keys = [f"k{i:03d}" for i in range(120)]
    write(keys, 1)
    member = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        join_window_seconds=0,
        background=False,
        batch_size=7,
    )
    _MADE.append(member)
    delivered: list[tuple[str, int]] = []

    def handle(events: list[RowChange]) -> None:
        delivered.extend((e.pk["id"], e.after["seq"]) for e in events)  # type: ignore[index]

    member.drain(handle)
    assert len(delivered) == 120
    write(keys[:30], 500)  # the parents' checkpoints now differ from one another
    member.drain(handle)
    delivered.clear()
    regroup.apply(member, 2, actor="t", reason="r", wait_seconds=5)
    regroup.apply(member, 4, actor="t", reason="r", wait_seconds=5)
    doc, _ = member.load_membership()
    assert all(p.floors for p in doc.partitions), "no floors: the test proves nothing"
    write(keys[100:110], 900)  # updated after the regroups
    write(["new1", "new2"], 950)
    member.balance()
    member.drain(handle)
    expected = [(k, 900 + i) for i, k in enumerate(keys[100:110])] + [("new1", 950), ("new2", 951)]
    assert sorted(delivered) == sorted(expected)


@pytest.mark.parametrize("count", [8, 2], ids=["split", "merge"])
def test_a_regroup_keeps_the_partitions_retries_and_rejections(
    sqlite_db: TestDatabase, tmp_path: Path, count: int
) -> None:
    """A partition's window (events settled above its checkpoint while an earlier
    one waits for a retry, and the retries with their attempts) lives in its state
    document. A regroup wrote the new partitions without it: a rejected event,
    dead-lettered and 'never delivered again', was delivered again, and a retry
    started over at attempt 1 at once, past its backoff."""
    from dbtrigger.quarantine import JsonLinesQuarantineSink  # noqa: PLC0415

    make_table(sqlite_db, 80)
    by_partition: dict[int, list[int]] = {}
    for i in range(1, 81):
        by_partition.setdefault(bucket_of([i]) // 64, []).append(i)
    retried, rejected = by_partition[0][1], by_partition[0][3]  # one partition, in order
    member = PartitionedPoller(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        join_window_seconds=0,
        background=False,
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
    )
    _MADE.append(member)
    seen: list[tuple[int, int]] = []

    def handle(events: list[RowChange], ctx: Any) -> None:
        for event in events:
            key = int(event.pk["id"])
            seen.append((key, ctx.attempt))
            if key == rejected:
                ctx.reject(event, "refused downstream")
            elif key == retried and len([k for k, _ in seen if k == retried]) == 1:
                ctx.retry(event, "later", delay_seconds=3600)

    def tick_all() -> None:  # drain() would wait for the retry, an hour away
        for _ in range(50):
            if member.tick(handle) == 0:
                return
        pytest.fail("the member never caught up")

    tick_all()
    assert sorted(k for k, _ in seen) == list(range(1, 81))
    seen.clear()
    regroup.apply(member, count, actor="t", reason="r", wait_seconds=5)
    member.balance()
    tick_all()
    assert seen == [], "the regroup delivered again what the window had settled or held"


def test_a_merge_of_decimal_keys_starts_at_the_lowest_parent_checkpoint(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """Decimals order in Python as in the database, like integers: a merged
    partition starts at its lowest parent's checkpoint, not from the beginning
    (a scan of everything its parents delivered, only for the floors to skip it)."""
    table = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {table} (id NUMERIC(12, 2) PRIMARY KEY, seq INT NOT NULL)")
    pg.execute(f"INSERT INTO {table} SELECT g + 0.5, g FROM generate_series(1, 60) g")
    member = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=pg.url, table="orders", schema=pg.schema, cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        join_window_seconds=0,
        background=False,
    )
    _MADE.append(member)
    assert member.drain(lambda events: None) == 60
    merged = regroup.apply(member, 2, actor="t", reason="r", wait_seconds=5)
    assert all(start is not None for start in merged.starts.values()), merged.starts
    pg.execute(f"INSERT INTO {table} VALUES (100.25, 100)")
    seen: list[Any] = []
    member.balance()
    assert member.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 1
    assert [str(k) for k in seen] == ["100.25"]


def test_a_regroup_deletes_only_its_own_retired_partitions(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """The cleanup matched every key starting with '<name>.p': a regroup of
    'orders' deleted the retired partition documents of a group named 'orders.pay'
    (its own next regroup, or a rebuild of its layout from them, needs them)."""
    make_table(sqlite_db, 20)
    store = FileCheckpointStore(tmp_path / "state")

    def group(name: str) -> PartitionedPoller:
        made = PartitionedPoller(
            name=name,
            source=source(sqlite_db),
            checkpoint_store=store,
            partitions=4,
            join_window_seconds=0,
            background=False,
        )
        _MADE.append(made)
        made.drain(lambda events: None)
        return made

    pay, orders = group("orders.pay"), group("orders")
    start = dt.datetime.now(dt.timezone.utc)
    regroup.apply(pay, 8, actor="t", reason="r", wait_seconds=5, now=lambda: start)
    retired = {k for k in store.list_keys() if k.startswith("orders.pay.p")} - {
        f"orders.pay.{p.id}" for p in pay.load_membership()[0].partitions
    }
    assert len(retired) == 4
    later = start + dt.timedelta(seconds=regroup.LOCK_SECONDS + 60)
    regroup.apply(orders, 8, actor="t", reason="r", wait_seconds=5, now=lambda: later)
    assert retired <= set(store.list_keys())
    assert all("pay" not in pid for pid in orders.group_state(lag=False).retired)


@pytest.mark.parametrize("count", [8, 2], ids=["split", "merge"])
def test_a_regroup_keeps_a_failing_batchs_attempts(
    sqlite_db: TestDatabase, tmp_path: Path, count: int
) -> None:
    """A partition's failing batch counts its attempts in its state document. A
    regroup wrote the new partitions without that count: a poison row had
    max_attempts deliveries again after every regroup before it was set aside
    (with regroups often enough, never)."""
    from dbtrigger.errors import DbTriggerError  # noqa: PLC0415
    from dbtrigger.quarantine import JsonLinesQuarantineSink  # noqa: PLC0415
    from tests.test_partitions_poller import Clock  # noqa: PLC0415

    make_table(sqlite_db, 80)
    first = sorted(i for i in range(1, 81) if bucket_of([i]) // 64 == 0)
    poison = first[2]
    clock = Clock()
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    member = PartitionedPoller(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        join_window_seconds=0,
        background=False,
        quarantine=sink,
        max_attempts=3,
        monotonic=clock,
    )
    _MADE.append(member)
    attempts: list[int] = []

    def handle(events: list[RowChange], ctx: Any) -> None:
        for event in events:
            if int(event.pk["id"]) == poison:
                attempts.append(ctx.attempt)
                raise RuntimeError("poison")

    def tick() -> None:
        clock.now += 3600  # past the failing partition's backoff
        with contextlib.suppress(DbTriggerError):
            member.tick(handle)

    while len(attempts) < 2:
        tick()
    assert attempts == [1, 2]
    regroup.apply(member, count, actor="t", reason="r", wait_seconds=5)
    member.balance()
    for _ in range(20):
        if sink.records():
            break
        tick()
    assert [r.pk for r in sink.records()] == [{"id": poison}]
    assert attempts[2] == 3, f"the regroup started the attempts over: {attempts}"
    assert attempts == sorted(attempts)
