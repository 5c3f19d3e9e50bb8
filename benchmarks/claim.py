"""Claim-mode queue throughput on PostgreSQL, side by side with a raw loop and PgQueuer.

A table of ``--rows`` ready rows (default 100k) is drained by 1 and by 4
worker processes with a no-op handler, batch 100, by:

* ``dbtrigger`` - :class:`~dbtrigger.QueueTrigger` over a columns-mode
  :class:`~dbtrigger.ClaimSource` (claim with ``FOR UPDATE SKIP LOCKED``,
  heartbeat thread, fenced completion, events built per row);
* ``raw`` - the floor: a psycopg loop over the same table and index, one
  ``WITH pick AS (... FOR UPDATE SKIP LOCKED) UPDATE ... RETURNING id``
  claim and one ``UPDATE ... SET status = 'done' WHERE id = ANY(...)``, each
  committed, nothing else;
* ``pgqueuer`` - PgQueuer's ``QueueManager`` in drain mode (asyncpg), its
  own tables, the same number of jobs and the same batch size (optional: the
  ``bench`` extra installs it; skipped with a note when it is missing).

Each (system, workers) pair runs ``--repeats`` times on a freshly loaded
queue; the table prints the median completions/s and dbtrigger's ratio to the
raw loop measured in the same run. Targets from the issue: >= 10k
completions/s with 4 workers, and >= 0.5 x the raw loop.

    python benchmarks/claim.py                      # 100k rows, 1 and 4 workers, 3 repeats
    python benchmarks/claim.py --rows 5000 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import PG_URL, SCHEMA, noop_handler
from dbtrigger import ClaimSource, QueueTrigger
from dbtrigger.queue import ddl

TABLE = "claim_jobs"
PGQ_DATABASE = "dbtrigger_bench_pgq"
BATCH = 100


def admin_engine() -> sa.Engine:
    return sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")


def load_queue(rows: int) -> None:
    """A fresh queue table with ``rows`` ready rows and the claim index (VACUUM ANALYZEd)."""
    engine = admin_engine()
    with engine.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {SCHEMA}.{TABLE}")
        conn.exec_driver_sql(
            f"CREATE TABLE {SCHEMA}.{TABLE} (id bigint PRIMARY KEY, payload text NOT NULL)"
        )
        table = sa.Table(TABLE, sa.MetaData(), schema=SCHEMA, autoload_with=conn)
        ddl.apply(conn, ddl.install_columns(conn, table))
        conn.exec_driver_sql(
            f"INSERT INTO {SCHEMA}.{TABLE} (id, payload) "
            "SELECT g, 'job ' || g FROM generate_series(1, %(n)s) g",
            {"n": rows},
        )
        conn.exec_driver_sql(f"VACUUM ANALYZE {SCHEMA}.{TABLE}")
    engine.dispose()


def count_done() -> int:
    engine = admin_engine()
    with engine.connect() as conn:
        n = conn.exec_driver_sql(
            f"SELECT count(*) FROM {SCHEMA}.{TABLE} WHERE dbt_status = 'done'"
        ).scalar_one()
    engine.dispose()
    return int(n)


# --- workers (each runs in its own process) --------------------------------------------


def dbtrigger_worker(start: Any, results: Any) -> None:
    source = ClaimSource(url=PG_URL, table=TABLE, schema=SCHEMA, pk_columns=["id"])
    queue = QueueTrigger(name="bench", source=source, batch_size=BATCH)
    source.target  # noqa: B018 - reflect the table before the clock starts
    start.wait()
    done = 0
    while True:
        result = queue.tick_result(noop_handler)
        done += result.rows
        if result.claimed == 0:
            break
    results.put((done, time.perf_counter()))
    source.close()


def raw_worker(start: Any, results: Any) -> None:
    import psycopg  # noqa: PLC0415

    dsn = sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
    claim = (
        f"WITH pick AS (SELECT id FROM {SCHEMA}.{TABLE} "
        "WHERE dbt_status IN ('ready', 'claimed') AND dbt_visible_at <= now() "
        "ORDER BY dbt_visible_at LIMIT %(n)s FOR UPDATE SKIP LOCKED) "
        f"UPDATE {SCHEMA}.{TABLE} j SET dbt_status = 'claimed', dbt_claim_token = %(t)s, "
        "dbt_attempts = j.dbt_attempts + 1, dbt_visible_at = now() + interval '60 seconds' "
        "FROM pick WHERE j.id = pick.id RETURNING j.id"
    )
    done_sql = (
        f"UPDATE {SCHEMA}.{TABLE} SET dbt_status = 'done', dbt_done_at = now(), "
        "dbt_visible_at = 'infinity' WHERE id = ANY(%(ids)s) AND dbt_claim_token = %(t)s"
    )
    with psycopg.connect(dsn) as conn:
        start.wait()
        done = 0
        while True:
            token = uuid.uuid4().hex
            with conn.transaction():
                ids = [r[0] for r in conn.execute(claim, {"n": BATCH, "t": token})]
            if not ids:
                break
            with conn.transaction():
                done += conn.execute(done_sql, {"ids": ids, "t": token}).rowcount
    results.put((done, time.perf_counter()))


def pgq_dsn() -> str:
    return (
        sa.make_url(PG_URL)
        .set(drivername="postgresql", database=PGQ_DATABASE)
        .render_as_string(False)
    )


def pgqueuer_worker(start: Any, results: Any) -> None:
    import asyncpg  # noqa: PLC0415
    from pgqueuer import AsyncpgDriver, Queries, QueueManager  # noqa: PLC0415
    from pgqueuer.domain.types import QueueExecutionMode  # noqa: PLC0415

    done = 0

    async def main() -> None:
        nonlocal done
        conn = await asyncpg.connect(pgq_dsn())
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint("bench")
        async def process(job: Any) -> None:
            nonlocal done
            done += 1

        start.wait()
        await qm.run(batch_size=BATCH, mode=QueueExecutionMode.drain)
        await conn.close()

    asyncio.run(main())
    results.put((done, time.perf_counter()))


def load_pgqueuer(rows: int) -> None:
    import asyncpg  # noqa: PLC0415
    from pgqueuer import AsyncpgDriver, Queries  # noqa: PLC0415

    engine = admin_engine()
    with engine.connect() as conn:
        exists = conn.exec_driver_sql(
            "SELECT 1 FROM pg_database WHERE datname = %(d)s", {"d": PGQ_DATABASE}
        ).first()
        if not exists:
            conn.exec_driver_sql(f"CREATE DATABASE {PGQ_DATABASE}")
    engine.dispose()

    async def main() -> None:
        conn = await asyncpg.connect(pgq_dsn())
        queries = Queries(AsyncpgDriver(conn))
        if not await queries.schema_is_installed():
            await queries.install()
        await queries.clear_queue()
        await queries.clear_queue_log()
        for first in range(0, rows, 10_000):
            n = min(10_000, rows - first)
            await queries.enqueue(["bench"] * n, [None] * n, [0] * n)
        await conn.execute("VACUUM ANALYZE")
        await conn.close()

    asyncio.run(main())


# --- the runs ------------------------------------------------------------------------


def drain(worker: Callable[[Any, Any], None], workers: int) -> tuple[int, float]:
    """Start ``workers`` processes, release them together; (rows done, seconds)."""
    ctx = mp.get_context("fork")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(start, results)) for _ in range(workers)]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # let every worker connect
    began = time.perf_counter()
    start.set()
    outs = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return sum(n for n, _ in outs), max(t for _, t in outs) - began


def have_pgqueuer() -> bool:
    try:
        import asyncpg  # noqa: F401, PLC0415
        import pgqueuer  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workers", default="1,4", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="dbtrigger,raw,pgqueuer")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    if "pgqueuer" in systems and not have_pgqueuer():
        print("pgqueuer/asyncpg not installed (pip install -e '.[bench]'): skipping it")
        systems.remove("pgqueuer")
    counts = [int(w) for w in args.workers.split(",")]
    runners = {"dbtrigger": dbtrigger_worker, "raw": raw_worker, "pgqueuer": pgqueuer_worker}
    medians: dict[tuple[str, int], float] = {}
    print(
        f"PostgreSQL, {args.rows} ready rows, batch {BATCH}, no-op handler, "
        f"{args.repeats} run(s) each; completions/s"
    )
    for workers in counts:
        for system in systems:
            rates = []
            for _ in range(args.repeats):
                if system == "pgqueuer":
                    load_pgqueuer(args.rows)
                else:
                    load_queue(args.rows)
                done, seconds = drain(runners[system], workers)
                if done != args.rows:
                    raise SystemExit(f"{system}: {done} of {args.rows} rows completed")
                if system != "pgqueuer" and count_done() != args.rows:
                    raise SystemExit(f"{system}: the table does not show every row done")
                rates.append(done / seconds)
            medians[(system, workers)] = statistics.median(rates)
            runs = ", ".join(f"{r:,.0f}" for r in rates)
            print(
                f"  {system:<10} workers={workers}  median {medians[(system, workers)]:>9,.0f}"
                f"   (runs: {runs})",
                flush=True,
            )
    print()
    print(f"{'workers':>8} " + " ".join(f"{s:>11}" for s in systems) + "   dbtrigger/raw")
    for workers in counts:
        cells = " ".join(f"{medians[(s, workers)]:>11,.0f}" for s in systems)
        ratio = ""
        if "dbtrigger" in systems and "raw" in systems:
            ratio = f"{medians[('dbtrigger', workers)] / medians[('raw', workers)]:>14.2f}"
        print(f"{workers:>8} {cells} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
