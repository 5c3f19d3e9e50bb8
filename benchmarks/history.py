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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default=[20_000])
    parser.add_argument("--batch-sizes", type=int_list, default=[100, 1000])
    parser.add_argument("--stores", type=str_list, default=["memory", "file", "sqlite"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5k rows, 2 repeats")
    args = parser.parse_args(argv)
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
