"""Claims stay O(batch) with scheduled and prioritised rows (PostgreSQL).

A queue holds ``--due`` rows that are due now and, for each ``--scheduled``
count S, S rows scheduled for later (``run_after``). Two layouts:

* ``plain``: no ``dbt_priority``; the S scheduled rows are ordinary ``ready``
  rows whose ``dbt_visible_at`` is a day away;
* ``priority``: ``queue install --priority``; the due rows are spread over
  ``--levels`` priorities and the S scheduled rows sit at a priority *above*
  all of them - the worst case for a claim that orders by priority first.

For each (layout, S) it reports the median time of ``--repeats`` real claims
of ``--batch`` rows (``ClaimSource.claim``, committed) and the shared buffers
one claim *reads* to find its rows: its picks (``SELECT ... FOR UPDATE SKIP
LOCKED``) and, with priorities, its probes for the next priority, each run
under ``EXPLAIN (ANALYZE, BUFFERS)`` in a transaction that is rolled back.
Buffers do not depend on how busy the machine is (they are taken with index-only
scans off: see ``STABLE_PLAN``): they stay flat as S grows.
(The claim's write - the batch's rows and their index entries - is O(batch)
times the B-tree's depth, the same for any queue, and is left out.) The
contrast, ``one ORDER BY``, is the single statement a queue would otherwise
use, ``... WHERE due ORDER BY dbt_priority DESC, dbt_visible_at LIMIT batch
FOR UPDATE SKIP LOCKED``: it walks every scheduled row of the top
priority before it reaches a due one, so its buffers grow with S.

    python -m benchmarks.claim_mix                                 # 20k due, S = 0 / 200k
    python -m benchmarks.claim_mix --due 2000 --scheduled 0,20k --repeats 5
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import PG_URL, SCHEMA, int_list, median, print_table
from dbtrigger import ClaimSource
from dbtrigger.queue import ddl

TABLE = "claim_mix"


def load(kind: str, due: int, scheduled: int, levels: int) -> None:
    """A fresh queue table: ``due`` rows due now, ``scheduled`` rows a day away."""
    engine = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {SCHEMA}.{TABLE}")
        conn.exec_driver_sql(
            f"CREATE TABLE {SCHEMA}.{TABLE} (id bigint PRIMARY KEY, payload text NOT NULL)"
            " WITH (autovacuum_enabled = false)"  # see STABLE_PLAN: no visibility map
        )
        table = sa.Table(TABLE, sa.MetaData(), schema=SCHEMA, autoload_with=conn)
        ddl.apply(conn, ddl.install_columns(conn, table, priority=kind == "priority"))
        priority = ", dbt_priority" if kind == "priority" else ""
        due_priority = f", mod(g, {levels})" if kind == "priority" else ""
        conn.exec_driver_sql(
            f"INSERT INTO {SCHEMA}.{TABLE} (id, payload, dbt_visible_at{priority}) "
            f"SELECT g, 'job ' || g, now() - interval '1 hour' + g * interval '1 microsecond'"
            f"{due_priority} FROM generate_series(1, %(n)s::bigint) g",
            {"n": due},
        )
        if scheduled:
            top = f", {levels}" if kind == "priority" else ""
            conn.exec_driver_sql(
                f"INSERT INTO {SCHEMA}.{TABLE} (id, payload, dbt_visible_at{priority}) "
                f"SELECT g, 'later ' || g, now() + interval '1 day' + g * interval '1 microsecond'"
                f"{top} FROM generate_series(%(a)s::bigint, %(b)s::bigint) g",
                {"a": due + 1, "b": due + scheduled},
            )
        conn.exec_driver_sql(f"ANALYZE {SCHEMA}.{TABLE}")  # no VACUUM: see STABLE_PLAN
    engine.dispose()


#: The buffer counts must not depend on the visibility map, which a VACUUM sets only
#: when no older snapshot is open in the database (on a shared server: at random).
#: With the map set, the planner may take an index-only scan (53 buffers or 103, run
#: to run), and even a plain index scan's row locks read the map's page once more per
#: row they lock (53 or 103 again, the smoke test failing under load whenever the two
#: loads it compares saw different snapshots). So the table is loaded with autovacuum
#: off and only ANALYZEd, its map never set, and index-only scans are off besides: the
#: same claim reads the same pages every time, and grows with the rows scheduled later
#: exactly when it would on a vacuumed table.
STABLE_PLAN = "SET LOCAL enable_indexonlyscan = off"


def _buffers(plan: str) -> int:
    match = re.search(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?", plan)
    return sum(int(g or 0) for g in match.groups()) if match else 0


def claim_buffers(source: ClaimSource, batch: int) -> int:
    """Shared buffers one claim reads to find its rows: its SELECTs (rolled back)."""
    total = [0]
    target = source.target

    def explain(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters)
            total[0] += _buffers("\n".join(str(r[0]) for r in cursor.fetchall()))

    with source.engine.connect() as raw:
        conn = raw.execution_options(isolation_level="READ COMMITTED")
        sa.event.listen(conn, "before_cursor_execute", explain)
        transaction = conn.begin()
        conn.exec_driver_sql(STABLE_PLAN)
        try:
            if target.priority:
                target.claim_by_priority(
                    conn, limit=batch, token=uuid.uuid4().hex, worker="bench", visibility=60
                )
            else:  # the pick and the update as two statements: the pick is measured
                target.claim_choosing(
                    conn, limit=batch, token=uuid.uuid4().hex, worker="bench", visibility=60
                )
        finally:
            transaction.rollback()
    return total[0]


def one_order_by_buffers(batch: int, kind: str) -> int:
    """The single ORDER BY priority, visible_at statement (rolled back)."""
    order = "dbt_priority DESC, dbt_visible_at" if kind == "priority" else "dbt_visible_at"
    sql = (
        f"EXPLAIN (ANALYZE, BUFFERS) SELECT id FROM {SCHEMA}.{TABLE} "
        "WHERE dbt_status IN ('ready', 'claimed') AND dbt_visible_at <= now() "
        f"ORDER BY {order} LIMIT {int(batch)} FOR UPDATE SKIP LOCKED"
    )
    engine = sa.create_engine(PG_URL)
    with engine.connect() as conn:
        conn.exec_driver_sql(STABLE_PLAN)
        plan = "\n".join(str(r[0]) for r in conn.exec_driver_sql(sql))
        conn.rollback()
    engine.dispose()
    return _buffers(plan)


def measure(kind: str, due: int, scheduled: int, args: argparse.Namespace) -> list[Any]:
    load(kind, due, scheduled, args.levels)
    source = ClaimSource(url=PG_URL, table=TABLE, schema=SCHEMA, pk_columns=["id"])
    try:
        source.target  # noqa: B018 - reflect before the clock starts
        buffers = claim_buffers(source, args.batch)
        naive = one_order_by_buffers(args.batch, kind)
        samples = []
        for n in range(args.repeats):
            started = time.perf_counter()
            got = source.claim(limit=args.batch, token=f"b{n}", worker="bench", visibility=600)
            samples.append(time.perf_counter() - started)
            if len(got) != args.batch:
                raise SystemExit(f"a claim took {len(got)} rows, expected {args.batch}")
    finally:
        source.close()
    return [kind, f"{scheduled:,}", f"{median(samples) * 1000:.2f}", buffers, naive]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--due", type=int_list, default=[20_000], help="rows due now")
    parser.add_argument(
        "--scheduled", type=int_list, default=[0, 200_000], help="rows scheduled for later"
    )
    parser.add_argument("--levels", type=int, default=3, help="priorities of the due rows")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20, help="claims timed per shape")
    parser.add_argument("--layouts", default="plain,priority")
    args = parser.parse_args(argv)
    (due,) = args.due
    if due < args.batch * (args.repeats + 1):
        raise SystemExit("--due must hold (--repeats + 1) batches")
    rows = [
        measure(kind, due, scheduled, args)
        for kind in args.layouts.split(",")
        for scheduled in args.scheduled
    ]
    print_table(
        f"One claim of {args.batch} rows, {due:,} rows due "
        f"({args.levels} priorities in the priority layout)",
        ["layout", "scheduled later", "claim ms", "claim read buffers", "one ORDER BY buffers"],
        rows,
    )


if __name__ == "__main__":
    main()
