"""One fetch of a batch at increasing depth: keyset costs O(batch), OFFSET O(depth).

On the N-row table (default 1M), for each depth d it times fetching the batch
that follows row d in ``(updated_at, id)`` order three ways:

* ``dbtrigger``: ``SqlAlchemySource.fetch(Position(...), batch)``;
* ``raw keyset``: the same ``WHERE (updated_at, id) > (%s, %s)`` query with bare psycopg;
* ``OFFSET``: ``ORDER BY updated_at, id OFFSET d LIMIT batch`` with bare psycopg,
  the usual paging query, shown as the contrast.

Timings are medians of ``--repeats`` fetches. On PostgreSQL the table also
shows the buffers the plan touched (``EXPLAIN (ANALYZE, BUFFERS)``), which does
not depend on how busy the machine is: flat for keyset, growing with d for OFFSET.

    python -m benchmarks.fetch_depth                          # 1M rows, depths 1k/100k/900k
    python -m benchmarks.fetch_depth --rows 100k --depths 1k,50k,90k
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa

from benchmarks.common import (
    Dataset,
    dataset,
    fmt_ratio,
    int_list,
    median,
    pg_conninfo,
    print_table,
    str_list,
)
from dbtrigger.cursor import Position

SELECT = "SELECT id, updated_at, customer, amount, status FROM {t}"


def timed_ms(fn: Callable[[], list[Any]], repeats: int, batch: int) -> float:
    """Median milliseconds of ``fn`` (which must return ``batch`` rows)."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        got = fn()
        samples.append(time.perf_counter() - started)
        if len(got) != batch:
            raise SystemExit(f"a fetch returned {len(got)} rows, expected {batch}")
    return median(samples) * 1000


@contextlib.contextmanager
def raw_runner(ds: Dataset) -> Iterator[tuple[Callable[[str, tuple[Any, ...]], list[Any]], str]]:
    """(run(sql, params), placeholder) over a bare driver connection."""
    if ds.kind == "postgresql":
        import psycopg  # noqa: PLC0415

        with psycopg.connect(pg_conninfo(), autocommit=True) as conn:
            yield (lambda q, p: conn.execute(q, p).fetchall()), "%s"
        return
    lite = sqlite3.connect(sa.make_url(ds.url).database or "")
    try:
        yield (lambda q, p: lite.execute(q, p).fetchall()), "?"
    finally:
        lite.close()


def buffers(
    run: Callable[[str, tuple[Any, ...]], list[Any]], sql: str, params: tuple[Any, ...]
) -> str:
    """Shared buffers (hit + read) of the plan's top node, from EXPLAIN ANALYZE."""
    plan = "\n".join(str(r[0]) for r in run("EXPLAIN (ANALYZE, BUFFERS) " + sql, params))
    match = re.search(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?", plan)
    if not match:
        return "-"
    return str(int(match.group(1) or 0) + int(match.group(2) or 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1m")
    parser.add_argument("--depths", default="1k,100k,900k")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--dbs", default="postgresql,sqlite")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="100k rows, depths 1k,50k,90k")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.depths, args.repeats = "100k", "1k,50k,90k", 5
    n = int_list(args.rows)[0]
    depths = int_list(args.depths)
    if max(depths) + args.batch > n:
        raise SystemExit(f"the deepest fetch needs {max(depths) + args.batch} rows; table has {n}")

    table_rows: list[list[Any]] = []
    for db in str_list(args.dbs):
        ds = dataset(db, n)
        target = f"{ds.schema}.{ds.table}" if ds.schema else ds.table
        source = ds.source()
        with raw_runner(ds) as (run, ph):
            keyset_sql = (
                SELECT.format(t=target)
                + f" WHERE (updated_at, id) > ({ph}, {ph}) ORDER BY updated_at, id LIMIT {ph}"
            )
            offset_sql = (
                SELECT.format(t=target) + f" ORDER BY updated_at, id LIMIT {ph} OFFSET {ph}"
            )
            first: dict[str, float] = {}
            try:
                for depth in depths:
                    print(f"# {db} depth={depth:,}", flush=True)
                    # The position of row `depth` in cursor order (setup, not timed).
                    anchor = run(
                        SELECT.format(t=target) + f" ORDER BY updated_at, id LIMIT 1 OFFSET {ph}",
                        (depth - 1,),
                    )[0]
                    position = Position(cursor=anchor[1], pk={"id": anchor[0]})
                    source.fetch(position, args.batch)  # warm: shape, pool, plan cache
                    timings = {
                        "dbtrigger": timed_ms(
                            lambda p=position, s=source: list(s.fetch(p, args.batch)),
                            args.repeats,
                            args.batch,
                        ),
                        "raw": timed_ms(
                            lambda a=anchor, q=keyset_sql: run(q, (a[1], a[0], args.batch)),
                            args.repeats,
                            args.batch,
                        ),
                        "offset": timed_ms(
                            lambda d=depth, q=offset_sql: run(q, (args.batch, d)),
                            args.repeats,
                            args.batch,
                        ),
                    }
                    if not first:
                        first = dict(timings)
                    pages = ("-", "-")
                    if db == "postgresql":
                        pages = (
                            buffers(run, keyset_sql, (anchor[1], anchor[0], args.batch)),
                            buffers(run, offset_sql, (args.batch, depth)),
                        )
                    table_rows.append(
                        [
                            db,
                            f"{depth:,}",
                            f"{timings['dbtrigger']:.2f}",
                            f"{timings['raw']:.2f}",
                            f"{timings['offset']:.2f}",
                            fmt_ratio(timings["dbtrigger"], first["dbtrigger"]),
                            fmt_ratio(timings["offset"], first["offset"]),
                            pages[0],
                            pages[1],
                        ]
                    )
            finally:
                source.close()
    print_table(
        f"One fetch of {args.batch} rows at depth d of a {n:,}-row table, ms "
        f"(median of {args.repeats}); x-first = time / time at the shallowest depth",
        [
            "db",
            "depth",
            "dbtrigger",
            "raw keyset",
            "OFFSET",
            "dbt x-first",
            "OFFSET x-first",
            "keyset bufs",
            "OFFSET bufs",
        ],
        table_rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
