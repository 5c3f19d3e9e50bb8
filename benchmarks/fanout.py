"""Fan-out: the read cost is paid once, however many subscribers.

The same table drained three ways, side by side:

* ``1 handler``: one poller, one handler (the baseline);
* ``3 subscribers``: one poller with ``subscribers=`` (one read, three consumers);
* ``3 pollers``: three independent pollers, one per consumer (three reads).

For each it prints the number of source fetches, the time spent in them
(``fetch_duration_seconds``), the store writes, the wall time and the rows/s
delivered per consumer.

    python -m benchmarks.fanout                   # 5000 PostgreSQL rows, batch 500
    python -m benchmarks.fanout --quick           # 1000 rows
    python -m benchmarks.fanout --dbs sqlite --wait-ms 0.2

Each consumer reads every event's key and one column (``--wait-ms`` adds a
wait per event, an I/O-bound stand-in; subscribers run at the same time, so
with waits the fan-out poller costs about one consumer's time, not three).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import (
    dataset,
    fmt_rate,
    fmt_ratio,
    int_list,
    print_table,
    reading_handler,
    str_list,
)
from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.testing import CountingStore

CONSUMERS = ("billing", "search", "audit")


def consumer(wait: float) -> Callable[[Sequence[Any]], None]:
    def handle(events: Sequence[Any]) -> None:
        reading_handler(events)
        if wait:
            for _ in events:
                time.sleep(wait)

    return handle


def drain_one(
    ds: Any,
    name: str,
    batch: int,
    metrics: InMemoryMetrics,
    store: CountingStore,
    *,
    handler: Callable[[Sequence[Any]], None] | None = None,
    subscribers: dict[str, Callable[[Sequence[Any]], None]] | None = None,
    read_ahead: bool | str = True,
) -> int:
    source = ds.source("none")
    try:
        trigger = PollTrigger(
            name=name,
            source=source,
            checkpoint_store=store,
            batch_size=batch,
            max_batches_per_tick=1_000_000,
            metrics=metrics,
            subscribers=subscribers,
            read_ahead=read_ahead,
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


def run(
    ds: Any, mode: str, *, batch: int, wait: float, read_ahead: bool | str = True
) -> dict[str, float]:
    """Drain ``ds`` in ``mode``; the fetch count, fetch seconds, writes and wall time."""
    metrics = InMemoryMetrics()
    store = CountingStore(InMemoryCheckpointStore())
    started = time.perf_counter()
    if mode == "1 handler":
        rows = [
            drain_one(
                ds, "one", batch, metrics, store, handler=consumer(wait), read_ahead=read_ahead
            )
        ]
    elif mode == "3 subscribers":
        subs = {name: consumer(wait) for name in CONSUMERS}
        rows = [
            drain_one(ds, "fan", batch, metrics, store, subscribers=subs, read_ahead=read_ahead)
        ]
    else:
        rows = [
            drain_one(
                ds, name, batch, metrics, store, handler=consumer(wait), read_ahead=read_ahead
            )
            for name in CONSUMERS
        ]
    seconds = time.perf_counter() - started
    if any(r != ds.rows for r in rows):
        raise SystemExit(f"{mode}: drained {rows} of {ds.rows} rows")
    fetch_times = [
        v
        for (name, _), vs in metrics.observations.items()
        if name == "fetch_duration_seconds"
        for v in vs
    ]
    return {
        "fetches": len(fetch_times),
        "fetch_seconds": sum(fetch_times),
        "writes": store.counts.writes,
        "seconds": seconds,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default=[5000])
    parser.add_argument("--dbs", type=str_list, default=["postgresql"])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--wait-ms", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode; the best is shown")
    parser.add_argument("--quick", action="store_true", help="1000 rows, one run per mode")
    parser.add_argument(
        "--read-ahead",
        choices=("adaptive", "always", "off"),
        default="adaptive",
        help="PollTrigger's read_ahead (adaptive: the default). The store writes are exact "
        "only with 'off' or 'always': adaptive read-ahead decides by timing whether the "
        "read after a tick's last full batch comes early enough for that batch's commit to "
        "release the lease, or the release is a write of its own",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = [1000], 1
    modes = ("1 handler", "3 subscribers", "3 pollers")
    ahead = {"adaptive": True, "always": "always", "off": False}[args.read_ahead]
    for kind in args.dbs:
        for n in args.rows:
            ds = dataset(kind, n)
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeat):
                for mode in modes:  # interleaved, so load drift hits every mode alike
                    got = run(
                        ds, mode, batch=args.batch_size, wait=args.wait_ms / 1000, read_ahead=ahead
                    )
                    if mode not in best or got["seconds"] < best[mode]["seconds"]:
                        best[mode] = got
            base = best["1 handler"]
            table = [
                [
                    mode,
                    f"{r['fetches']:.0f}",
                    f"{r['fetch_seconds'] * 1000:,.0f}",
                    fmt_ratio(r["fetch_seconds"], base["fetch_seconds"]),
                    f"{r['writes']:.0f}",
                    f"{r['seconds']:.2f}",
                    fmt_rate(n / r["seconds"]),
                ]
                for mode, r in best.items()
            ]
            print_table(
                f"{kind}, {n:,} rows, batch {args.batch_size}, each consumer reads every "
                f"event{f' and waits {args.wait_ms:g} ms per event' if args.wait_ms else ''} "
                f"(best of {args.repeat})",
                [
                    "mode",
                    "fetches",
                    "fetch ms",
                    "fetch x",
                    "store writes",
                    "wall s",
                    "rows/s per consumer",
                ],
                table,
            )


if __name__ == "__main__":
    main()
