"""Peak memory of a catch-up: resident set size before the drain and at its peak.

Each configuration runs in a fresh interpreter (``--child``), so one drain's
garbage cannot hide in another's numbers. The child builds everything a drain
needs (imports, engine, source, trigger), reads ``VmRSS`` from
``/proc/self/status`` (the baseline), drains the table, and reads ``VmHWM``
(the peak resident size of the process). Growth = peak - baseline. The raw
psycopg keyset loop runs the same way, as the floor: it keeps one batch of
tuples alive at a time, which is the least any batched reader can hold.

Bounded memory matters because a catch-up drain is one long tick: anything kept
per row (events, rows, journal entries) would grow with the backlog.

    python -m benchmarks.memory                    # 1M rows, batch 1000 and 5000
    python -m benchmarks.memory --rows 100k        # smaller
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from benchmarks.common import (
    ROOT,
    dataset,
    dbtrigger_drain,
    int_list,
    median,
    print_table,
    raw_keyset_drain,
    reading_handler,
    rss_mb,
    str_list,
)
from dbtrigger import InMemoryCheckpointStore

TARGET_GROWTH_MB = 100
#: The target in the unit /proc reports (kB / 1024): 100 MB = 95.4 MiB.
TARGET_GROWTH_MIB = TARGET_GROWTH_MB * 1e6 / 2**20


def child(kind: str, db: str, rows: int, batch: int) -> dict[str, Any]:
    """Run one drain in this process; report RSS before and the peak after."""
    ds = dataset(db, rows)
    if kind == "dbtrigger":
        store = InMemoryCheckpointStore()
        before, _ = rss_mb()
        # The reading handler: every event's pk and after are built, the most
        # an event holds (a handler that reads nothing leaves them unbuilt).
        delivered = dbtrigger_drain(ds, batch, store, handler=reading_handler)
    else:
        import psycopg  # noqa: F401, PLC0415 - load the driver before the baseline reading

        before, _ = rss_mb()
        delivered = raw_keyset_drain(ds, batch, read=True)
    _, peak = rss_mb()
    return {"before": before, "peak": peak, "rows": delivered}


def run_child(kind: str, db: str, rows: int, batch: int) -> dict[str, Any]:
    out = subprocess.run(  # noqa: S603 - this module, fixed arguments
        [
            sys.executable,
            "-m",
            "benchmarks.memory",
            "--child",
            kind,
            "--dbs",
            db,
            "--rows",
            str(rows),
            "--batch-sizes",
            str(batch),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["rows"] != rows:
        raise SystemExit(f"{kind} delivered {result['rows']} of {rows} rows: not a valid run")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1m")
    parser.add_argument("--batch-sizes", default="1000,5000")
    parser.add_argument("--dbs", default="postgresql", help="postgresql,sqlite")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per config")
    parser.add_argument("--quick", action="store_true", help="100k rows, batch 1000")
    parser.add_argument("--child", choices=("dbtrigger", "raw"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.batch_sizes = "100k", "1000"
    sizes, batches, dbs = int_list(args.rows), int_list(args.batch_sizes), str_list(args.dbs)

    if args.child:
        print(json.dumps(child(args.child, dbs[0], sizes[0], batches[0])))
        return 0

    rows: list[list[Any]] = []
    worst = 0.0
    for db in dbs:
        for n in sizes:
            dataset(db, n)  # build it here, outside the measured children
            for batch in batches:
                print(f"# {db} rows={n:,} batch={batch}", flush=True)
                measured = {
                    kind: [run_child(kind, db, n, batch) for _ in range(args.repeats)]
                    for kind in ("raw", "dbtrigger")
                }
                growth = {
                    kind: median([r["peak"] - r["before"] for r in runs])
                    for kind, runs in measured.items()
                }
                worst = max(worst, growth["dbtrigger"])
                ours = measured["dbtrigger"][0]
                rows.append(
                    [
                        db,
                        f"{n:,}",
                        batch,
                        f"{ours['before']:.1f}",
                        f"{ours['peak']:.1f}",
                        f"{growth['dbtrigger']:.1f}",
                        f"{growth['raw']:.1f}",
                        f"{growth['dbtrigger'] - growth['raw']:.1f}",
                    ]
                )
    print_table(
        f"Catch-up memory, MiB (VmRSS before the drain, VmHWM after; target growth "
        f"< {TARGET_GROWTH_MB} MB = {TARGET_GROWTH_MIB:.1f} MiB)",
        ["db", "rows", "batch", "before", "peak", "growth", "raw growth", "extra vs raw"],
        rows,
        left=1,
    )
    return 0 if worst < TARGET_GROWTH_MIB else 1


if __name__ == "__main__":
    sys.exit(main())
