"""A partition member in its own process, for the scale-out tests and benchmark.

    python -m benchmarks.partition_worker URL SCHEMA STORE MEMBER OUT [--interval S] [--ttl S]
        [--partitions P] [--handler-ms MS]

Appends one ``id,seq`` line per delivered event to OUT (flushed per batch, so
a SIGKILL loses at most a partial last line) and runs until killed or SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from dbtrigger import SqlAlchemySource
from dbtrigger.errors import RetryableError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.state.stores.factory import open_store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    for name in ("url", "schema", "store", "member", "out"):
        parser.add_argument(name)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--handler-ms", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--app", default="scaleout", help="the store's app prefix")
    parser.add_argument("--table", default="orders")
    args = parser.parse_args(argv)
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    source = SqlAlchemySource(
        url=args.url,
        table=args.table,
        schema=args.schema or None,
        cursor_column="seq",
        pk_columns=["id"],
    )
    member = PartitionedPoller(
        name="orders",
        source=source,
        checkpoint_store=open_store(args.store, app=args.app),
        partitions=args.partitions,
        balance_interval_seconds=args.interval,
        member_ttl_seconds=args.ttl,
        min_hold_cycles=1,
        member_id=args.member,
        batch_size=args.batch_size,
        max_batches_per_tick=4,
        lease_ttl_seconds=30,
    )
    delay = args.handler_ms / 1000
    with open(args.out, "a", encoding="ascii") as out:

        def handle(events: list[Any]) -> None:
            if delay:
                time.sleep(delay * len(events))  # an I/O-bound handler: delay per event
            out.write("".join(f"{e.pk['id']},{e.cursor}\n" for e in events))
            out.flush()

        while not stop:
            try:
                if member.tick(handle) == 0:
                    time.sleep(0.05)
            except RetryableError as exc:  # the next round retries, as `dbtrigger run` does
                print(f"{args.member}: {exc}", file=sys.stderr)
                time.sleep(0.2)
        member.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
