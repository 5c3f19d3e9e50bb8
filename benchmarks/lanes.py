"""Parallel lanes: an I/O-bound handler (it waits per event) drained at several
``max_concurrency`` values, rows/s side by side with two baselines measured in
the same run: ``max_concurrency=1``, and a sleep-only loop (the handler's
waits one after another, no dbtrigger at all). Each figure is the median of
``--repeat`` rounds; the rounds interleave the contenders, so a burst of load
from elsewhere hits them all alike.

    python -m benchmarks.lanes                    # 5000 PostgreSQL rows, 2 ms/event, 1,4,16
    python -m benchmarks.lanes --quick            # 1000 rows, 1 and 4, one round
    python -m benchmarks.lanes --dbs sqlite --wait-ms 1 --concurrency 1,2,8

The handler sleeps ``--wait-ms`` per event (a stand-in for a call to another
service); with N lanes up to N such waits overlap. The target is a speed-up
of at least 0.8 x N over ``max_concurrency=1``: the lanes, not the poller,
should be the limit. "of ideal" compares with N times the sleep-only rate,
the best any poller could do (it charges dbtrigger's own cost too).
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
    median,
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


def sleep_only(n: int, wait: float) -> int:
    """The baseline: the handler's waits one after another, nothing else."""
    for _ in range(n):
        time.sleep(wait)
    return n


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default=[5000])
    parser.add_argument("--dbs", type=str_list, default=["postgresql"])
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--wait-ms", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median is shown")
    parser.add_argument("--quick", action="store_true", help="1000 rows, 1 and 4, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.concurrency, args.repeat = [1000], [1, 4], 1
    wait = args.wait_ms / 1000
    for kind in args.dbs:
        for n in args.rows:
            ds = dataset(kind, n)
            samples: dict[str, list[float]] = {"sleep": []}
            for level in args.concurrency:
                samples[f"{level}"] = []
            for _ in range(args.repeat):
                rows, seconds = timed(lambda n=n: sleep_only(n, wait))
                samples["sleep"].append(rows / seconds)
                for level in args.concurrency:
                    rows, seconds = timed(
                        lambda ds=ds, level=level: drain(
                            ds, concurrency=level, batch=args.batch_size, wait=wait
                        )
                    )
                    if rows != n:
                        raise SystemExit(f"max_concurrency={level}: drained {rows} of {n} rows")
                    samples[f"{level}"].append(rows / seconds)
            sleep_rate = median(samples["sleep"])
            rates = {level: median(samples[f"{level}"]) for level in args.concurrency}
            base = rates.get(1) or rates[min(rates)]
            table = [["sleep only, 1 at a time", fmt_rate(sleep_rate), "-", "-", "-", "-"]]
            table += [
                [
                    f"max_concurrency={level}",
                    fmt_rate(rate),
                    fmt_ratio(rate, base),
                    fmt_ratio(rate, sleep_rate),
                    f"{0.8 * level:g}",
                    fmt_ratio(rate, sleep_rate * level),
                ]
                for level, rate in rates.items()
            ]
            print_table(
                f"{kind}, {n:,} rows, batch {args.batch_size}, handler waits "
                f"{args.wait_ms:g} ms per event, median of {args.repeat}",
                ["lanes", "rows/s", "vs 1 lane", "vs sleep-only", "target", "of ideal"],
                table,
            )


if __name__ == "__main__":
    main()
