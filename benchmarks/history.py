"""What the durable history costs a drain: the same drain with ``history=False``
(the baseline), with the history appended on the committing thread (``inline``,
how it was written before the appender thread) and with the history as it is
by default (the appender thread), interleaved.

Every commit appends one record (its digests and one ``[id, key, crc]`` line per
event) to the history beside the state: a dict in memory, a JSON-lines file
next to the state file, a row of a SQLite table next to the state table, an
append blob next to the state blob (Azurite). The source is in memory, so the
figures are the history's own cost, not the database's: the extra time per
batch and per event over the baseline, and how many records one batch appends
(below 1 when the appender writes several commits in one append: records per
append). The drain's time includes the flush at its end.

    python -m benchmarks.history                       # memory, file, sqlite; 20k rows
    python -m benchmarks.history --stores file,blob --rows 50k --batch-sizes 100,1000
    python -m benchmarks.history --quick

``--narrow`` measures the history's CPU where it is largest next to the rest: a
drain of the narrow PostgreSQL table (``benchmarks.common``, 100k rows: the
reading handler, ``visibility="auto"``, the in-memory store and its history),
``history=False`` and the default interleaved in one process, client CPU
(``time.process_time``, every thread) and wall per row, and the CPU the history
adds: the median of the pairs' differences.

    python -m benchmarks.history --narrow --batch-sizes 100,1000 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.common import azurite, int_list, median, print_table, str_list
from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.testing import MemorySource

StoreFactory = Callable[[], CheckpointStore]


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "seq": i, "status": "new", "amount": i * 1.25} for i in range(1, n + 1)]


def drain(factory: StoreFactory, data: list[dict[str, Any]], batch: int, history: str) -> Any:
    """Seconds to drain ``data`` (``history``: off, inline or on) and the history
    records appended, and the appends that carried them."""
    metrics = InMemoryMetrics()
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(data, cursor_column="seq", pk_columns=["id"]),
        checkpoint_store=factory(),
        batch_size=batch,
        max_batches_per_tick=1_000_000,
        metrics=metrics,
        history=None if history != "off" else False,
    )
    if history == "inline":
        trigger._driver.writer.history.background = False  # the old way
    appends = [0]
    store: Any = trigger.history
    if store is not None:  # count the store writes (one per append round)
        append = store.append

        def counted(*args: Any, **kwargs: Any) -> None:
            appends[0] += 1
            append(*args, **kwargs)

        store.append = counted
    start = time.perf_counter()
    delivered = trigger.drain(lambda events: None)
    elapsed = time.perf_counter() - start
    assert delivered == len(data), (delivered, len(data))
    trigger.close()
    return elapsed, metrics.total("history_appends_total"), appends[0]


@contextlib.contextmanager
def factories(names: list[str]) -> Iterator[dict[str, StoreFactory]]:
    with contextlib.ExitStack() as stack:
        out: dict[str, StoreFactory] = {}
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-history-"))
        for name in names:
            if name == "memory":
                out[name] = InMemoryCheckpointStore
            elif name == "file":
                out[name] = lambda: FileCheckpointStore(
                    os.path.join(tmp, f"file-{uuid.uuid4().hex[:8]}")
                )
            elif name == "sqlite":
                from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415

                out[name] = lambda: SqlCheckpointStore(
                    url=f"sqlite:///{tmp}/state-{uuid.uuid4().hex[:8]}.db"
                )
            elif name == "blob":
                from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

                az = stack.enter_context(azurite())
                out[name] = lambda az=az: BlobCheckpointStore.from_connection_string(
                    az.connection_string,
                    app_name=f"b{uuid.uuid4().hex[:8]}",
                    container="bench-history",
                    create_container=True,
                )
            else:
                raise SystemExit(f"unknown store {name!r} (memory, file, sqlite, blob)")
        yield out


def narrow(batch_sizes: list[int], repeats: int, rows: int) -> None:
    """The ``--narrow`` table: see the module docstring."""
    import functools  # noqa: PLC0415

    from benchmarks import common  # noqa: PLC0415

    ds = common.dataset("postgresql", rows, layout=common.LAYOUTS["narrow"])
    made = PollTrigger

    def run(batch: int, history: bool) -> tuple[float, float]:
        setattr(common, "PollTrigger", functools.partial(made, history=None if history else False))  # noqa: B010
        cpu, wall = time.process_time(), time.perf_counter()
        delivered = common.dbtrigger_drain(
            ds, batch, InMemoryCheckpointStore(), handler=ds.layout.reader, visibility="auto"
        )
        assert delivered == ds.rows, (delivered, ds.rows)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return cpu * 1e6 / ds.rows, wall * 1e6 / ds.rows

    table = []
    try:
        for batch in batch_sizes:
            run(batch, True)  # warm-up
            off: list[tuple[float, float]] = []
            on: list[tuple[float, float]] = []
            for _ in range(repeats):  # interleaved: off on off on ...
                off.append(run(batch, False))
                on.append(run(batch, True))
            added = [a[0] - b[0] for a, b in zip(on, off, strict=True)]
            table.append(
                [
                    batch,
                    f"{median([c for c, _ in off]):.2f}",
                    f"{median([c for c, _ in on]):.2f}",
                    f"{median(added):.2f} ({min(added):.2f} - {max(added):.2f})",
                    f"{median([w for _, w in off]):.2f}",
                    f"{median([w for _, w in on]):.2f}",
                ]
            )
    finally:
        setattr(common, "PollTrigger", made)  # noqa: B010
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    print_table(
        f"durable history on the narrow PostgreSQL table ({ds.rows:,} rows, memory store), "
        f"us per row, medians of {repeats} interleaved pairs",
        [
            "batch",
            "CPU off",
            "CPU on",
            "history CPU (pairs' range)",
            "wall off",
            "wall on",
        ],
        table,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default=[20_000])
    parser.add_argument("--batch-sizes", type=int_list, default=[100, 1000])
    parser.add_argument("--stores", type=str_list, default=["memory", "file", "sqlite"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5k rows, 2 repeats")
    parser.add_argument(
        "--narrow",
        action="store_true",
        help="the history's CPU on a drain of the narrow PostgreSQL table (100k rows)",
    )
    args = parser.parse_args(argv)
    if args.narrow:
        narrow(args.batch_sizes, args.repeats, 100_000 if args.rows == [20_000] else args.rows[0])
        return 0
    if args.quick:
        args.rows, args.repeats = [5_000], 2
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    table = []
    with factories(args.stores) as made:
        for n in args.rows:
            data = rows(n)
            for batch in args.batch_sizes:
                for name, factory in made.items():
                    times: dict[str, list[float]] = {"off": [], "inline": [], "on": []}
                    appended = writes = 0.0
                    for _ in range(args.repeats):  # interleaved: A B C A B C ...
                        for mode, seconds in times.items():
                            took, records, stores = drain(factory, data, batch, history=mode)
                            seconds.append(took)
                            if mode == "on":
                                appended, writes = records, stores
                    batches = -(-n // batch)
                    base = median(times["off"])
                    inline, on = median(times["inline"]), median(times["on"])
                    table.append(
                        [
                            name,
                            n,
                            batch,
                            f"{base * 1000 / batches:.2f}",
                            f"{(inline - base) * 1000 / batches:.2f}",
                            f"{(on - base) * 1000 / batches:.2f}",
                            f"{(on - base) * 1e6 / n:.1f}",
                            f"{inline / base:.2f}x",
                            f"{on / base:.2f}x",
                            f"{appended / batches:.2f}",
                            f"{appended / writes:.1f}" if writes else "-",
                        ]
                    )
    print_table(
        "durable history: a drain with history=False (baseline), appended inline (the "
        "old way) and by the appender thread (the default), medians",
        [
            "store",
            "rows",
            "batch",
            "ms/batch off",
            "extra ms/batch inline",
            "extra ms/batch on",
            "extra us/event on",
            "inline/off",
            "on/off",
            "records/batch",
            "records/append",
        ],
        table,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
