"""Parallel lanes: an I/O-bound handler (it waits per event) drained at several
``max_concurrency`` values, rows/s side by side with ``max_concurrency=1``
measured in the same run, and the ideal (N times the sequential rate).

    python -m benchmarks.lanes                    # 5000 PostgreSQL rows, 2 ms/event, 1,4,16
    python -m benchmarks.lanes --quick            # 1000 rows, 1 and 4
    python -m benchmarks.lanes --dbs sqlite --wait-ms 1 --concurrency 1,2,8

The handler sleeps ``--wait-ms`` per event (a stand-in for a call to another
service); with N lanes up to N such waits overlap. The target is a speed-up
of at least 0.8 x N: the lanes, not the poller, should be the limit.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    dataset,
    fmt_rate,
    fmt_ratio,
    int_list,
    print_table,
    str_list,
    timed,
)
from dbtrigger import InMemoryCheckpointStore, PollTrigger


def drain(ds: Any, *, concurrency: int, batch: int, wait: float) -> int:
    def handler(events: Sequence[Any]) -> None:
        for _ in events:
            time.sleep(wait)

    source = ds.source("none")
    try:
        trigger = PollTrigger(
            name="lanes",
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            batch_size=batch,
            max_batches_per_tick=1_000_000,
            max_concurrency=concurrency,
        )
        total = 0
        while total < ds.rows:
            got = trigger.tick(handler)
            if not got:
                break
            total += got
        return total
    finally:
        source.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default=[5000])
    parser.add_argument("--dbs", type=str_list, default=["postgresql"])
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--wait-ms", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="1000 rows, concurrency 1 and 4")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.concurrency = [1000], [1, 4]
    for kind in args.dbs:
        for n in args.rows:
            ds = dataset(kind, n)
            results: dict[int, float] = {}
            for level in args.concurrency:
                rows, seconds = timed(
                    lambda ds=ds, level=level: drain(
                        ds, concurrency=level, batch=args.batch_size, wait=args.wait_ms / 1000
                    )
                )
                if rows != n:
                    raise SystemExit(f"max_concurrency={level}: drained {rows} of {n} rows")
                results[level] = rows / seconds
            base = results.get(1) or results[min(results)]
            table = [
                [
                    f"max_concurrency={level}",
                    fmt_rate(rate),
                    fmt_ratio(rate, base),
                    f"{level}",
                    fmt_ratio(rate, base * level),
                ]
                for level, rate in results.items()
            ]
            print_table(
                f"{kind}, {n:,} rows, batch {args.batch_size}, handler waits "
                f"{args.wait_ms:g} ms per event",
                ["lanes", "rows/s", "speed-up", "ideal", "of ideal"],
                table,
            )


if __name__ == "__main__":
    main()
