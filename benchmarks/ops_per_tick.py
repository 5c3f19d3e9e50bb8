"""Storage operations per tick, and what one storage round trip costs.

Every read and write of the state document is a paid, throttled request to the
checkpoint store (a blob GET or PUT), so the number per tick is a cost in its
own right. Each scenario runs one tick through :class:`dbtrigger.testing.CountingStore`
and prints the counted reads/writes next to the target:

* ``first tick``: no state yet, nothing to do -> 1 read, 0 writes
* ``idle``: state exists, nothing new -> 1 read, 0 writes
* ``1 batch``: fewer rows than a batch -> 1 read, 2 writes (lease, commit+release)
* ``k batches``: k batches, the last one short -> <= 1 read + k + 1 writes
* ``k batches, capped``: ``max_batches_per_tick = k`` with rows left over
* ``contended``: another instance holds a live lease -> 1 read, 0 writes

azure-functions-db 0.8.3 runs the same scenarios through its own
``BlobCheckpointStore`` (Azurite) or, for the in-memory row, through a store
that makes the same calls; its requests are counted at the blob client.

The second table is the round-trip time of a read and a write per store,
measured over ``--round-trips`` one-batch ticks (median and p95).

    python -m benchmarks.ops_per_tick                   # memory, file, blob
    python -m benchmarks.ops_per_tick --stores memory,file
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.afdb import AfdbMemoryStateStore, afdb_version
from benchmarks.common import (
    TimingStore,
    azurite,
    blob_store_class,
    dbtrigger_blob_store,
    median,
    noop_handler,
    percentile,
    print_table,
    str_list,
)
from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.testing import CountingStore

BATCH = 100
K = 5
#: Seconds to wait out azure-functions-db's lease grace period (0.5 s at ttl 1 s).
AFDB_GRACE_WAIT = 0.6
BASE = dt.datetime(2026, 1, 1)


class Table:
    """A small SQLite table that grows between ticks (timestamps in the past)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"ops_{uuid.uuid4().hex[:8]}.sqlite"
        self.next_id = 0
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            conn.execute(
                "CREATE TABLE events (id INTEGER PRIMARY KEY, updated_at DATETIME NOT NULL,"
                " payload TEXT NOT NULL)"
            )
            conn.execute("CREATE INDEX events_cursor ON events (updated_at, id)")
            conn.commit()

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    def add(self, n: int) -> None:
        rows = []
        for _ in range(n):
            ts = BASE + dt.timedelta(milliseconds=self.next_id)
            rows.append((self.next_id, ts.strftime("%Y-%m-%d %H:%M:%S.%f"), "x" * 40))
            self.next_id += 1
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            conn.executemany("INSERT INTO events VALUES (?, ?, ?)", rows)
            conn.commit()

    def source(self) -> SqlAlchemySource:
        return SqlAlchemySource(
            url=self.url,
            table="events",
            cursor_column="updated_at",
            pk_columns=["id"],
            visibility="none",
        )


@dataclass
class Scenario:
    name: str
    target_reads: int
    target_writes: int  # an upper bound
    rows_to_add: int
    max_batches: int


SCENARIOS = (
    Scenario("first tick (no state, no rows)", 1, 0, 0, K * 2),
    Scenario("idle (nothing new)", 1, 0, 0, K * 2),
    Scenario("1 batch", 1, 2, BATCH // 2, K * 2),
    Scenario(f"{K} batches", 1, K + 1, (K - 1) * BATCH + BATCH // 2, K * 2),
    Scenario(f"{K} batches, capped (rows left)", 1, K + 1, K * BATCH + BATCH // 2, K),
)


def dbtrigger_scenarios(store: CheckpointStore, workdir: Path) -> list[tuple[str, int, int, int]]:
    """(scenario, reads, writes, rows) for each scenario, on one poller and one table."""
    table = Table(workdir)
    counting = CountingStore(store)
    poller = f"ops{uuid.uuid4().hex[:8]}"
    source = table.source()
    results = []
    try:
        for scenario in SCENARIOS:
            if scenario.name.startswith("idle"):
                # Drain first so the state document exists with nothing pending.
                drain = PollTrigger(
                    name=poller, source=source, checkpoint_store=store, batch_size=BATCH
                )
                drain.drain(noop_handler)
            table.add(scenario.rows_to_add)
            trigger = PollTrigger(
                name=poller,
                source=source,
                checkpoint_store=counting,
                batch_size=BATCH,
                max_batches_per_tick=scenario.max_batches,
            )
            counting.reset()
            rows = trigger.tick(noop_handler)
            counts = counting.counts
            results.append((scenario.name, counts.reads, counts.writes, rows))
            # Leave nothing pending for the next scenario.
            PollTrigger(name=poller, source=source, checkpoint_store=store, batch_size=BATCH).drain(
                noop_handler
            )
        results.append(("contended (lease held elsewhere)", *_contended(store, table, poller)))
    finally:
        source.close()
    return results


def _contended(store: CheckpointStore, table: Table, poller: str) -> tuple[int, int, int]:
    """Owner A is inside its handler (lease live) while B ticks; B's calls are counted."""
    table.add(BATCH // 2)
    source_a, source_b = table.source(), table.source()
    counting = CountingStore(store)
    b = PollTrigger(name=poller, source=source_b, checkpoint_store=counting, batch_size=BATCH)
    seen: dict[str, int] = {}

    def handler_a(events: Any) -> None:
        del events
        counting.reset()
        rows = b.tick(noop_handler)
        counts = counting.counts
        seen.update(reads=counts.reads, writes=counts.writes, rows=rows)

    try:
        a = PollTrigger(name=poller, source=source_a, checkpoint_store=store, batch_size=BATCH)
        a.tick(handler_a)
    finally:
        source_a.close()
        source_b.close()
    return seen["reads"], seen["writes"], seen["rows"]


# --- azure-functions-db, counted at its blob client ------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.reads = 0
        self.writes = 0
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.reads = self.writes = 0


class _CountingBlobClient:
    def __init__(self, inner: Any, counter: _Counter) -> None:
        self._inner, self._counter = inner, counter

    def download_blob(self, *args: Any, **kwargs: Any) -> Any:
        self._counter.reads += 1
        return self._inner.download_blob(*args, **kwargs)

    def upload_blob(self, *args: Any, **kwargs: Any) -> Any:
        self._counter.writes += 1
        return self._inner.upload_blob(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CountingContainer:
    def __init__(self, inner: Any, counter: _Counter) -> None:
        self._inner, self._counter = inner, counter

    def get_blob_client(self, *args: Any, **kwargs: Any) -> Any:
        return _CountingBlobClient(self._inner.get_blob_client(*args, **kwargs), self._counter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CountingAfdbMemory(AfdbMemoryStateStore):
    """azure-functions-db's calls kept in memory; counts what its blob store would send."""

    def reset(self) -> None:
        self.reads = self.writes = 0


def afdb_scenarios(
    make_store: Callable[[str], tuple[Any, Callable[[], tuple[int, int]], Callable[[], None]]],
    workdir: Path,
) -> list[tuple[str, int, int, int]]:
    import azure_functions_db as afdb  # noqa: PLC0415 - optional comparison package

    table = Table(workdir)
    source = afdb.SqlAlchemySource(
        url=table.url, table="events", cursor_column="updated_at", pk_columns=["id"]
    )
    store, counts, reset = make_store(source.source_descriptor.fingerprint)
    results = []
    poller = f"ops{uuid.uuid4().hex[:8]}"

    def trigger(max_batches: int) -> Any:
        # A one-second lease: its grace period (min(ttl / 2, 5 s)) is then 0.5 s.
        return afdb.PollTrigger(
            name=poller,
            source=source,
            checkpoint_store=store,
            batch_size=BATCH,
            max_batches_per_tick=max_batches,
            lease_ttl_seconds=1,
        )

    def settle() -> None:
        # A released lease is only free after its grace period: wait it out, so
        # that no scenario but "contended" meets a lease.
        time.sleep(AFDB_GRACE_WAIT)

    def drain() -> None:
        settle()
        while trigger(1000).run(timer=None, handler=noop_handler):
            settle()

    try:
        for scenario in SCENARIOS:
            # The previous scenario left its state behind and (unless capped)
            # nothing pending, which is what "idle" needs.
            table.add(scenario.rows_to_add)
            settle()
            reset()
            rows = trigger(scenario.max_batches).run(timer=None, handler=noop_handler)
            results.append((scenario.name, *counts(), rows))
            if rows < scenario.rows_to_add:
                drain()
        table.add(BATCH // 2)
        settle()
        seen: dict[str, Any] = {}

        def handler_a(events: Any) -> None:
            del events
            reset()
            seen["rows"] = trigger(1).run(timer=None, handler=noop_handler)
            seen["counts"] = counts()

        trigger(1).run(timer=None, handler=handler_a)
        results.append(("contended (lease held elsewhere)", *seen["counts"], seen["rows"]))
    finally:
        source.dispose()
    return results


def afdb_memory_factory(
    fingerprint: str,
) -> tuple[Any, Callable[[], tuple[int, int]], Callable[[], None]]:
    del fingerprint
    store = _CountingAfdbMemory()
    return store, lambda: (store.reads, store.writes), store.reset


def afdb_blob_factory(
    az: Any,
) -> Callable[[str], tuple[Any, Callable[[], tuple[int, int]], Callable[[], None]]]:
    def factory(fingerprint: str) -> tuple[Any, Callable[[], tuple[int, int]], Callable[[], None]]:
        import azure_functions_db as afdb  # noqa: PLC0415
        from azure.storage.blob import ContainerClient  # noqa: PLC0415

        client = ContainerClient.from_connection_string(
            az.connection_string, f"afdb{uuid.uuid4().hex[:10]}"
        )
        client.create_container()
        counter = _Counter()
        store = afdb.BlobCheckpointStore(
            container_client=_CountingContainer(client, counter), source_fingerprint=fingerprint
        )
        return store, lambda: (counter.reads, counter.writes), counter.reset

    return factory


# --- round trips ---------------------------------------------------------------------------------


def round_trips(store: CheckpointStore, workdir: Path, ticks: int) -> TimingStore:
    """Time every read and write of ``ticks`` one-batch ticks."""
    table = Table(workdir)
    timing = TimingStore(store)
    source = table.source()
    try:
        trigger = PollTrigger(
            name=f"rt{uuid.uuid4().hex[:8]}", source=source, checkpoint_store=timing, batch_size=10
        )
        for _ in range(ticks):
            table.add(5)
            trigger.tick(noop_handler)
    finally:
        source.close()
    return timing


def ms(values: list[float], q: float | None = None) -> str:
    if not values:
        return "-"
    value = median(values) if q is None else percentile(values, q)
    return f"{value * 1000:.2f}"


@contextlib.contextmanager
def stores(names: list[str], workdir: Path) -> Iterator[list[tuple[str, Callable[[], Any], Any]]]:
    """(label, dbtrigger store factory, azure-functions-db factory or None) per store."""
    made: list[tuple[str, Callable[[], Any], Any]] = []
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == "memory":
                made.append(("memory", InMemoryCheckpointStore, afdb_memory_factory))
            elif name == "file":
                made.append(
                    ("file", lambda: FileCheckpointStore(workdir / uuid.uuid4().hex[:8]), None)
                )
            elif name == "blob":
                if blob_store_class() is None:
                    print("note: dbtrigger.state.stores.blob is not in this checkout; no blob rows")
                    continue
                az = stack.enter_context(azurite())
                made.append(
                    (
                        "blob (Azurite)",
                        lambda az=az: dbtrigger_blob_store(az, f"ops{uuid.uuid4().hex[:8]}"),
                        afdb_blob_factory(az),
                    )
                )
            else:
                raise SystemExit(f"unknown store {name!r} (memory, file, blob)")
        yield made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="memory,file,blob")
    parser.add_argument("--round-trips", type=int, default=50, help="ticks timed per store")
    parser.add_argument("--no-afdb", action="store_true", help="leave azure-functions-db out")
    parser.add_argument("--quick", action="store_true", help="10 timed ticks per store")
    args = parser.parse_args(argv)
    if args.quick:
        args.round_trips = 10
    version = None if args.no_afdb else afdb_version()
    afdb_label = f"azure-functions-db {version}" if version else "azure-functions-db"

    rows: list[list[Any]] = []
    timing_rows: list[list[Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="dbtrigger-ops-") as tmp,
        stores(str_list(args.stores), Path(tmp)) as made,
    ):
        workdir = Path(tmp)
        for label, make, afdb_factory in made:
            print(f"# {label}", flush=True)
            ours = dbtrigger_scenarios(make(), workdir)
            theirs: dict[str, tuple[int, int, int]] = {}
            if version is not None and afdb_factory is not None:
                theirs = {
                    name: (r, w, n) for name, r, w, n in afdb_scenarios(afdb_factory, workdir)
                }
            for (name, reads, writes, delivered), scenario_target in zip(
                ours, [*((s.target_reads, s.target_writes) for s in SCENARIOS), (1, 0)], strict=True
            ):
                target_r, target_w = scenario_target
                ok = reads <= target_r and writes <= target_w
                other = theirs.get(name)
                rows.append(
                    [
                        label,
                        name,
                        delivered,
                        f"{target_r} / {'<= ' if target_w else ''}{target_w}",
                        f"{reads} / {writes}",
                        "yes" if ok else "NO",
                        f"{other[0]} / {other[1]}" if other else "-",
                    ]
                )
            timing = round_trips(make(), workdir, args.round_trips)
            timing_rows.append(
                [
                    label,
                    len(timing.times.reads),
                    ms(timing.times.reads),
                    ms(timing.times.reads, 0.95),
                    len(timing.times.writes),
                    ms(timing.times.writes),
                    ms(timing.times.writes, 0.95),
                ]
            )

    print_table(
        f"Storage operations per tick (reads / writes; batch {BATCH}; afdb = {afdb_label})",
        ["store", "scenario", "rows", "target", "dbtrigger", "met", "afdb"],
        rows,
        left=2,
    )
    print_table(
        f"Store round trips, ms (over {args.round_trips} one-batch ticks)",
        ["store", "reads", "read median", "read p95", "writes", "write median", "write p95"],
        timing_rows,
    )
    return 0 if all(r[5] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
