"""Where a catch-up's time goes, per row: each stage of a batch timed on its own.

The profile behind ``benchmarks/README.md`` ("Reading the numbers"), made
reproducible. On the PostgreSQL data set it times, as medians of ``--repeats``
runs at one batch size:

* ``raw keyset fetch``: the bare psycopg query, rows as tuples (the floor);
* ``SqlAlchemySource.fetch``: the same rows through SQLAlchemy, as driver
  tuples, plus the per-fetch costs (pool checkout, statement, transaction);
* ``per-fetch fixed cost``: ``fetch`` of one row, i.e. what every batch pays
  whatever its size, shown per row of a full batch;
* ``to_events``: the batch checks and one lazy ``RowChange`` per row;
* ``reading pk + one column``: what the benchmark handler does with each
  event, including building its ``pk`` and ``after`` on first read;
* ``event ids, when read``: canonical JSON of key + cursor and SHA-256 (the
  runtime reads them only to skip rows an earlier delivery settled);
* ``commit``: serialising the state document (20-entry journal) and writing it
  to the in-memory store, once per batch;
* ``drain setup``: a new source's engine, table reflection and first
  connection, and the first tick's NULL-cursor probe, once per drain;
* ``whole drain``: ``PollTrigger`` draining the table, for comparison with the sum.

    python -m benchmarks.stages                  # batch 1000 on the 100k-row table
    python -m benchmarks.stages --batch 100
    python -m benchmarks.stages --table narrow   # id bigint, updated_at bigint, payload text
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    LAYOUTS,
    dataset,
    dbtrigger_drain,
    int_list,
    noop_handler,
    pg_conninfo,
    print_table,
)
from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.cursor import Position
from dbtrigger.event_identity import EventIds
from dbtrigger.state import document as docmod

#: CPU time per row of the latest :func:`per_row_us` (this process's CPU: what
#: the stage costs the client, much less disturbed than wall time by other load).
_last_cpu: list[float] = [math.nan]


def per_row_us(fn: Callable[[], Any], rows: int, repeats: int) -> float:
    """Median wall time per row of ``fn`` (CPU time per row in ``_last_cpu``)."""
    samples, cpu = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        fn()
        samples.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    _last_cpu[0] = statistics.median(cpu) / rows * 1e6
    return statistics.median(samples) / rows * 1e6


def stage(name: str, fn: Callable[[], Any], rows: int, repeats: int) -> tuple[str, float, float]:
    """``(name, wall us/row, cpu us/row)``."""
    wall = per_row_us(fn, rows, repeats)
    return name, wall, _last_cpu[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100k", help="the data set to read from")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    parser.add_argument("--table", choices=sorted(LAYOUTS), default="wide", help="table layout")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 5
    n, batch = int_list(args.rows)[0], args.batch
    ds = dataset("postgresql", n, layout=LAYOUTS[args.table])
    reading_handler = ds.layout.reader

    import psycopg  # noqa: PLC0415

    source = ds.source()
    guarded = ds.source("auto")
    try:
        middle = n // 2
        with psycopg.connect(pg_conninfo(), autocommit=True) as conn:
            table = f"{ds.schema}.{ds.table}"
            anchor = conn.execute(
                f"SELECT id, updated_at FROM {table} ORDER BY updated_at, id LIMIT 1 OFFSET %s",
                (middle,),
            ).fetchone()
            assert anchor is not None
            query = (
                f"SELECT {', '.join(ds.layout.columns)} FROM {table}"
                " WHERE (updated_at, id) > (%s, %s) ORDER BY updated_at, id LIMIT %s"
            )
            position = Position(cursor=anchor[1], pk={"id": anchor[0]})
            rows = source.fetch(position, batch)
            if len(rows) != batch:
                raise SystemExit(f"the data set has fewer than {middle + batch} rows")
            guarded.fetch(position, batch)  # the guard decides and probes once
            stages: list[tuple[str, float, float]] = [
                stage(
                    "raw keyset fetch (psycopg, tuples)",
                    lambda: conn.execute(query, (anchor[1], anchor[0], batch)).fetchall(),
                    batch,
                    args.repeats,
                ),
                stage(
                    "SqlAlchemySource.fetch (driver tuples)",
                    lambda: source.fetch(position, batch),
                    batch,
                    args.repeats,
                ),
                stage(
                    "  of which per-fetch fixed cost",
                    lambda: source.fetch(position, 1),
                    batch,
                    args.repeats,
                ),
                stage(
                    "  the same fetch, visibility guard on (cached bound)",
                    lambda: guarded.fetch(position, batch),
                    batch,
                    args.repeats,
                ),
                stage(
                    "to_events",
                    lambda: source.to_events(rows, poller="bench", batch_id="b"),
                    batch,
                    args.repeats,
                ),
            ]
        # A fresh batch of events per repeat, so every read is a first read.
        batches = [
            source.to_events(rows, poller="bench", batch_id="b") for _ in range(args.repeats)
        ]
        stages.append(
            stage(
                "reading pk + one column, per event (first read)",
                lambda: reading_handler(batches.pop()),
                batch,
                args.repeats,
            )
        )
        ids = EventIds("bench", ["id"])
        keys = [({"id": r["id"]}, r["updated_at"]) for r in rows]
        stages.append(
            stage(
                "event ids, when read",
                lambda: [ids(k, c) for k, c in keys],
                batch,
                args.repeats,
            )
        )
        store = InMemoryCheckpointStore()
        trigger = PollTrigger(
            name="stages",
            source=source,
            checkpoint_store=store,
            batch_size=100,
            max_batches_per_tick=25,
        )
        trigger.tick(noop_handler)  # a document with a full journal
        stored = store.read("stages")
        assert stored is not None
        doc = docmod.loads(stored.data)

        def commit() -> None:
            current = store.read("stages")
            assert current is not None
            store.write("stages", docmod.dumps(doc), if_match=current.etag)

        stages.append(stage("commit (per batch, spread over its rows)", commit, batch, 50))

        def setup() -> None:
            fresh = ds.source()
            try:
                fresh.fetch(position, 1)  # engine, reflection, first connection
                fresh.null_cursor_keys()  # the first tick's NULL-cursor probe
            finally:
                fresh.close()

        stages.append(stage(f"drain setup, once per drain (spread over {n:,} rows)", setup, n, 5))
        counted = ("SqlAlchemySource.fetch", "to_events", "reading", "commit", "drain setup")
        total = sum(v for name, v, _ in stages if name.startswith(counted))
        total_cpu = sum(c for name, _, c in stages if name.startswith(counted))
        drain = stage(
            "whole drain (PollTrigger, memory store, reading handler)",
            lambda: dbtrigger_drain(ds, batch, InMemoryCheckpointStore(), handler=reading_handler),
            n,
            max(1, args.repeats // 10),
        )
    finally:
        source.close()
        guarded.close()
    stages.append(("sum of fetch + to_events + reading + commit + setup", total, total_cpu))
    stages.append(drain)
    raw, raw_cpu = stages[0][1], stages[0][2]
    table_rows = [
        [name, f"{wall:.2f}", f"{wall / raw:.1f}", f"{cpu:.2f}", f"{cpu / raw_cpu:.1f}"]
        for name, wall, cpu in stages
    ]
    print_table(
        f"Per-row cost of each stage at batch {batch} ({args.table} table), us/row "
        f"(median of {args.repeats}); x raw = multiple of the raw fetch; "
        "cpu = this process's CPU time",
        ["stage", "us/row", "x raw", "cpu us/row", "cpu x raw"],
        table_rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
