"""Catch-up throughput: drain an N-row backlog, dbtrigger next to its baselines.

For every (database, rows, batch size, store) it drains the same table with

* ``raw``: the bare driver keyset loop (psycopg / sqlite3, rows as tuples):
  the fastest this read can go from Python, i.e. the floor;
* ``dbtrigger``: ``PollTrigger`` + ``SqlAlchemySource`` with a no-op handler
  (``visibility="none"``: the table is static and the raw loop has no guard);
* ``dbtrigger+guard``: the same with ``visibility="auto"`` (PostgreSQL only),
  which is what an unconfigured source does;
* ``afdb``: azure-functions-db's ``PollTrigger`` and ``SqlAlchemySource``
  through its public API, when the package is installed.

The contenders run interleaved, ``--repeats`` rounds, and the table shows each
one's median rows/s and, for each ratio, the median of its per-round values
(two drains of one round run back to back, so a change of machine load between
rounds cancels out of their ratio). Every drain must deliver exactly N rows, or
the script stops: a fast wrong answer is not a result.

Two table layouts (``--tables``): ``wide`` (five columns, a ``timestamptz``
cursor) and ``narrow`` (``id bigint`` key, ``updated_at bigint`` cursor,
``payload text``), where the driver's own work per row is smallest and
dbtrigger's shows most. Next to rows/s (wall time) it prints the client CPU
per row of each contender, and a table of the targets at default settings
(the guard on: ``dbt+guard``).

    python -m benchmarks.catchup                      # 100k rows, the default set
    python -m benchmarks.catchup --rows 100k,1m       # the full run (adds 1M)
    python -m benchmarks.catchup --tables narrow --dbs postgresql --stores memory --no-afdb
    python -m benchmarks.catchup --quick              # a 20k-row smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.afdb import AfdbMemoryStateStore, afdb_blob_store, afdb_drain, afdb_version
from benchmarks.common import (
    HANDLERS,
    LAYOUTS,
    Dataset,
    azurite,
    blob_store_class,
    dataset,
    dbtrigger_blob_store,
    dbtrigger_drain,
    fmt_rate,
    fmt_ratio,
    int_list,
    median,
    print_table,
    raw_keyset_drain,
    str_list,
    timed,
)
from dbtrigger import InMemoryCheckpointStore

CONTENDERS = ("raw", "dbtrigger", "dbtrigger+guard", "afdb")
#: dbtrigger at default settings (guard on) / the raw loop, per table layout and batch size.
TARGETS = {("wide", 1000): 0.5, ("wide", 100): 0.35, ("narrow", 1000): 0.5, ("narrow", 100): 0.4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100k", help="table sizes, e.g. 100k,1m")
    parser.add_argument("--batch-sizes", default="100,1000,5000")
    parser.add_argument("--dbs", default="postgresql,sqlite", help="postgresql,sqlite")
    parser.add_argument(
        "--tables",
        default="wide,narrow",
        help="table layouts: wide (5 columns, timestamptz cursor), narrow (id bigint, "
        "updated_at bigint, payload text)",
    )
    parser.add_argument("--stores", default="memory,blob", help="memory,blob (blob: Azurite)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument(
        "--blob-max-rows",
        default="100k",
        help="skip blob-store drains of larger tables (1M rows at batch 100 is 10,000 "
        "Azurite round trips per drain and contender)",
    )
    parser.add_argument(
        "--afdb-max-rows",
        default="100k",
        help="skip azure-functions-db drains of larger tables (about 4 minutes per 1M-row "
        "drain at batch 100)",
    )
    parser.add_argument(
        "--handler",
        choices=sorted(HANDLERS),
        default="read",
        help="read: each event's pk and one column (the raw loop reads the same two fields "
        "of its tuples); noop: nothing",
    )
    parser.add_argument("--no-afdb", action="store_true", help="leave azure-functions-db out")
    parser.add_argument("--no-guard", action="store_true", help="leave dbtrigger+guard out")
    parser.add_argument(
        "--gc-threshold",
        type=int,
        default=0,
        help="run with gc.set_threshold(N, 20, 20), the application-level tuning the README "
        "discusses (0: the interpreter's defaults)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the data sets")
    parser.add_argument(
        "--quick", action="store_true", help="20k rows, batch 1000, one round (a smoke run)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.batch_sizes, args.repeats = "20k", "1000", 1
    return args


class Run:
    """One measured configuration: rows/s per contender, one value per round."""

    def __init__(self, db: str, rows: int, batch: int, store: str, table: str = "wide") -> None:
        self.db, self.rows, self.batch, self.store = db, rows, batch, store
        self.table = table
        self.rates: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        #: Rows per second of this process's CPU time: what the drain costs the
        #: client itself, much less disturbed by other load than wall time.
        self.cpu_rates: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        self.notes: list[str] = []

    def rate(self, contender: str) -> float | None:
        values = self.rates[contender]
        return median(values) if values else None

    def cpu_rate(self, contender: str) -> float | None:
        values = self.cpu_rates[contender]
        return median(values) if values else None

    def cpu_us(self, contender: str) -> str:
        """Median client CPU microseconds per row."""
        rate = self.cpu_rate(contender)
        return "-" if rate is None or math.isnan(rate) or rate <= 0 else f"{1e6 / rate:.2f}"

    def wall_us(self, contender: str) -> str:
        """Median wall microseconds per row."""
        rate = self.rate(contender)
        return "-" if rate is None or rate <= 0 else f"{1e6 / rate:.2f}"

    def ratio_value(self, num: str, den: str, *, cpu: bool = False) -> float | None:
        rates = self.cpu_rates if cpu else self.rates
        rounds = zip(rates[num], rates[den], strict=False)
        pairs = [(a, b) for a, b in rounds if b and not math.isnan(a + b)]
        return median([a / b for a, b in pairs]) if pairs else None

    def ratio(self, num: str, den: str, *, cpu: bool = False) -> str:
        """The median over rounds of ``num``'s rows/s / ``den``'s in the same round."""
        rates = self.cpu_rates if cpu else self.rates
        rounds = zip(rates[num], rates[den], strict=False)  # a failed contender has fewer
        pairs = [(a, b) for a, b in rounds if b and not math.isnan(a + b)]
        return f"{median([a / b for a, b in pairs]):.2f}" if pairs else "-"


def measure(run: Run, contender: str, fn: Callable[[], int]) -> None:
    cpu_started = time.process_time()
    rows, seconds = timed(fn)
    cpu = time.process_time() - cpu_started
    if rows != run.rows:
        raise SystemExit(
            f"{contender} delivered {rows} of {run.rows} rows ({run.db} {run.table}, "
            f"batch {run.batch}, {run.store} store): not a valid measurement"
        )
    run.rates[contender].append(rows / seconds)
    run.cpu_rates[contender].append(rows / cpu if cpu > 0 else float("nan"))


def fresh_name() -> str:
    return f"b{uuid.uuid4().hex[:10]}"


def run_config(run: Run, ds: Dataset, args: argparse.Namespace, az: Any, afdb_ok: bool) -> None:
    read = args.handler == "read"
    handler = ds.layout.reader if read else HANDLERS[args.handler]
    for _ in range(args.repeats):
        measure(run, "raw", lambda: raw_keyset_drain(ds, run.batch, read=read))
        if run.store == "memory":
            measure(
                run,
                "dbtrigger",
                lambda: dbtrigger_drain(ds, run.batch, InMemoryCheckpointStore(), handler=handler),
            )
        else:
            measure(
                run,
                "dbtrigger",
                lambda: dbtrigger_drain(
                    ds, run.batch, dbtrigger_blob_store(az, fresh_name()), handler=handler
                ),
            )
        if ds.kind == "postgresql" and run.store == "memory" and not args.no_guard:
            measure(
                run,
                "dbtrigger+guard",
                lambda: dbtrigger_drain(
                    ds, run.batch, InMemoryCheckpointStore(), visibility="auto", handler=handler
                ),
            )
        if afdb_ok:
            try:
                if run.store == "memory":
                    measure(
                        run,
                        "afdb",
                        lambda: afdb_drain(ds, run.batch, AfdbMemoryStateStore(), handler=handler),
                    )
                else:
                    measure(
                        run,
                        "afdb",
                        lambda: afdb_drain(
                            ds, run.batch, afdb_blob_store(az, ds, fresh_name()), handler=handler
                        ),
                    )
            except Exception as exc:  # the comparison package failing is a note, not our failure
                run.notes.append(f"azure-functions-db failed: {type(exc).__name__}: {exc}"[:200])
                afdb_ok = False


@contextlib.contextmanager
def maybe_azurite(wanted: bool) -> Iterator[Any]:
    if not wanted:
        yield None
        return
    with azurite() as az:
        yield az


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, 20, 20)
    sizes = int_list(args.rows)
    batches = int_list(args.batch_sizes)
    dbs = str_list(args.dbs)
    stores = str_list(args.stores)
    tables = str_list(args.tables)
    unknown = [t for t in tables if t not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown table layout {unknown[0]!r} ({', '.join(LAYOUTS)})")
    blob_max = int_list(args.blob_max_rows)[0]
    afdb_max = int_list(args.afdb_max_rows)[0]
    notes: list[str] = []
    if "blob" in stores and blob_store_class() is None:
        notes.append("blob store: dbtrigger.state.stores.blob is not in this checkout; skipped")
        stores = [s for s in stores if s != "blob"]
    version = None if args.no_afdb else afdb_version()
    if not args.no_afdb and version is None:
        notes.append(
            "azure-functions-db is not installed (pip install azure-functions-db==0.8.3); "
            "its column is empty"
        )
    afdb_label = f"azure-functions-db {version}" if version else "azure-functions-db"

    runs: list[Run] = []
    with maybe_azurite("blob" in stores) as az:
        for db in dbs:
            for table in tables:
                for n in sizes:
                    ds = dataset(db, n, rebuild=args.rebuild, layout=LAYOUTS[table])
                    for batch in batches:
                        for store in stores:
                            if store == "blob" and n > blob_max:
                                continue
                            run = Run(db, n, batch, store, table)
                            print(
                                f"# {db} {table} rows={n:,} batch={batch} store={store}",
                                flush=True,
                            )
                            afdb_ok = version is not None and n <= afdb_max
                            run_config(run, ds, args, az, afdb_ok=afdb_ok)
                            runs.append(run)
                            notes.extend(
                                f"{db} {table} {n} {batch} {store}: {m}" for m in run.notes
                            )

    rows = [
        [
            r.db,
            r.table,
            f"{r.rows:,}",
            r.batch,
            r.store,
            fmt_rate(r.rate("raw")),
            fmt_rate(r.rate("dbtrigger")),
            fmt_rate(r.rate("dbtrigger+guard")),
            fmt_rate(r.rate("afdb")),
            r.ratio("dbtrigger", "raw"),
            r.ratio("dbtrigger", "raw", cpu=True),
            r.ratio("dbtrigger+guard", "raw"),
            r.ratio("dbtrigger", "afdb"),
            r.ratio("dbtrigger+guard", "dbtrigger"),
            r.ratio("dbtrigger+guard", "dbtrigger", cpu=True),
        ]
        for r in runs
    ]
    gc_note = f"; gc threshold {args.gc_threshold}" if args.gc_threshold else ""
    print_table(
        f"Catch-up throughput, rows/s (median of {args.repeats}; {args.handler} handler; "
        f"afdb = {afdb_label}{gc_note})",
        [
            "db",
            "table",
            "rows",
            "batch",
            "store",
            "raw keyset",
            "dbtrigger",
            "dbt+guard",
            "afdb",
            "dbt/raw",
            "dbt/raw cpu",
            "guard/raw",
            "dbt/afdb",
            "guard/dbt",
            "guard/dbt cpu",
        ],
        rows,
        left=5,
    )
    print_table(
        "Per row: wall and client CPU microseconds (medians; cpu = this process's CPU time, "
        "which other load on a shared machine disturbs much less)",
        [
            "db",
            "table",
            "rows",
            "batch",
            "store",
            "raw wall",
            "raw cpu",
            "dbt wall",
            "dbt cpu",
            "guard wall",
            "guard cpu",
            "afdb wall",
            "afdb cpu",
        ],
        [
            [
                r.db,
                r.table,
                f"{r.rows:,}",
                r.batch,
                r.store,
                *(f(c) for c in CONTENDERS for f in (r.wall_us, r.cpu_us)),
            ]
            for r in runs
        ],
        left=5,
    )
    targets = []
    for r in runs:
        target = TARGETS.get((r.table, r.batch))
        if target is None or r.store != "memory" or r.db != "postgresql":
            continue
        # Default settings: the guard on (visibility="auto").
        wall = r.ratio_value("dbtrigger+guard", "raw")
        cpu = r.ratio_value("dbtrigger+guard", "raw", cpu=True)
        met = "-" if wall is None else ("yes" if wall >= target else "no")
        targets.append(
            [
                r.db,
                r.table,
                f"{r.rows:,}",
                r.batch,
                "-" if wall is None else f"{wall:.2f}",
                "-" if cpu is None else f"{cpu:.2f}",
                f">= {target}",
                met,
            ]
        )
    if targets:
        print_table(
            "Targets at default settings (guard on, memory store, read handler): "
            "dbt+guard / raw keyset",
            ["db", "table", "rows", "batch", "wall", "cpu", "target", "met (wall)"],
            targets,
            left=2,
        )

    scaling = []
    by_key = {(r.db, r.table, r.rows, r.batch, r.store): r for r in runs}
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        for db in dbs:
            for table in tables:
                for batch in batches:
                    for store in stores:
                        a, b = (
                            by_key.get((db, table, small, batch, store)),
                            by_key.get((db, table, large, batch, store)),
                        )
                        if a is None or b is None:
                            continue
                        scaling.append(
                            [
                                db,
                                table,
                                batch,
                                store,
                                fmt_ratio(b.rate("dbtrigger"), a.rate("dbtrigger")),
                                fmt_ratio(b.cpu_rate("dbtrigger"), a.cpu_rate("dbtrigger")),
                                fmt_ratio(b.rate("raw"), a.rate("raw")),
                                fmt_ratio(b.rate("afdb"), a.rate("afdb")),
                            ]
                        )
        print_table(
            f"Flat cost with depth: rows/s at {large:,} / rows/s at {small:,} (target >= 0.85; "
            "cpu = rows per second of client CPU time)",
            ["db", "table", "batch", "store", "dbtrigger", "dbtrigger cpu", "raw keyset", "afdb"],
            scaling,
            left=4,
        )
    for note in notes:
        print(f"note: {note}")
    print(
        "target: dbtrigger / raw keyset >= 0.5 at batch 1000 and >= 0.35 at batch 100 (wide "
        "table; narrow: >= 0.5 and >= 0.4 with the guard on; memory store, read handler); "
        "the guard (dbt+guard / dbtrigger) >= 0.9 at batch 1000; 'cpu' = "
        "the same ratio of rows per second of client CPU time, which other load on a shared "
        "machine disturbs much less; ratios are medians of per-round ratios"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
