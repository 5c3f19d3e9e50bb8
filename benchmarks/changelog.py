"""What the change log costs the writers: writes/s into a table with and without it.

Two identical tables ``orders_plain`` and ``orders_logged`` (the second with the
change log installed) take the same workload, alternated round by round so both
see the same machine (which table goes first alternates too): single-row
INSERTs, each in its own transaction (the usual OLTP shape), then single-row
UPDATEs, then DELETEs. The table prints the
median writes/s of each and the ratio; the logged table also shows how many log
rows were written (one per change).

    python -m benchmarks.changelog                      # PostgreSQL and SQLite, 2000 rows
    python -m benchmarks.changelog --dialects postgresql,mariadb,sqlite --rows 5000 --rounds 5

URLs: ``DBTRIGGER_BENCH_PG_URL`` (default the test server), ``DBTRIGGER_BENCH_MARIADB_URL``
(default ``mysql+pymysql://root@127.0.0.1:3306/test``); SQLite uses a temp file.
The tables go to ``DBTRIGGER_BENCH_SCHEMA`` on PostgreSQL and are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from benchmarks.common import PG_URL, SCHEMA, fmt_rate, fmt_ratio, median, print_table, str_list
from dbtrigger.changelog import install, log_table_name, uninstall

MARIADB_URL = os.environ.get(
    "DBTRIGGER_BENCH_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)


def engine_for(dialect: str, workdir: Path) -> tuple[sa.Engine, str | None]:
    if dialect == "postgresql":
        engine = sa.create_engine(PG_URL)
        with engine.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        return engine, SCHEMA
    if dialect == "mariadb":
        return sa.create_engine(MARIADB_URL), None
    return sa.create_engine(f"sqlite:///{workdir / 'changelog-bench.sqlite'}"), None


def qualified(schema: str | None, name: str) -> str:
    return f"{schema}.{name}" if schema else name


def create_tables(engine: sa.Engine, schema: str | None) -> None:
    for name in ("orders_plain", "orders_logged"):
        uninstall_quietly(engine, name, schema)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {qualified(schema, name)}")
            conn.exec_driver_sql(
                f"CREATE TABLE {qualified(schema, name)} (id INTEGER PRIMARY KEY, "
                "status VARCHAR(20) NOT NULL, amount NUMERIC(12,2), note VARCHAR(200))"
            )
    install(engine, "orders_logged", schema=schema)


def uninstall_quietly(engine: sa.Engine, table: str, schema: str | None) -> None:
    if sa.inspect(engine).has_table(table, schema=schema):
        uninstall(engine, table, schema=schema, drop_log=True)


def workload(engine: sa.Engine, table: str, rows: int, base: int) -> dict[str, float]:
    """Writes/s for one-row-per-transaction inserts, updates and deletes."""
    rates: dict[str, float] = {}
    steps: list[tuple[str, str, Callable[[int], dict[str, object]]]] = [
        (
            "insert",
            f"INSERT INTO {table} (id, status, amount, note) VALUES (:id, 'new', :a, 'x')",
            lambda i: {"id": base + i, "a": i % 1000},
        ),
        (
            "update",
            f"UPDATE {table} SET status = 'paid', amount = :a WHERE id = :id",
            lambda i: {"id": base + i, "a": (i % 1000) + 1},
        ),
        ("delete", f"DELETE FROM {table} WHERE id = :id", lambda i: {"id": base + i}),
    ]
    with engine.connect() as conn:
        for op, sql, params in steps:
            stmt = sa.text(sql)
            started = time.perf_counter()
            for i in range(rows):
                conn.execute(stmt, params(i))
                conn.commit()
            rates[op] = rows / (time.perf_counter() - started)
    return rates


def run(dialect: str, rows: int, rounds: int, workdir: Path) -> list[list[str]]:
    engine, schema = engine_for(dialect, workdir)
    try:
        create_tables(engine, schema)
        plain: dict[str, list[float]] = {"insert": [], "update": [], "delete": []}
        logged: dict[str, list[float]] = {"insert": [], "update": [], "delete": []}
        tables = {
            "plain": (qualified(schema, "orders_plain"), plain),
            "logged": (qualified(schema, "orders_logged"), logged),
        }
        for index in range(rounds):
            # Alternate which table goes first, so neither always runs on a warmer cache.
            order = ("plain", "logged") if index % 2 == 0 else ("logged", "plain")
            for which in order:
                table, rates = tables[which]
                for op, rate in workload(engine, table, rows, index * rows).items():
                    rates[op].append(rate)
        with engine.connect() as conn:
            log_rows = conn.exec_driver_sql(
                f"SELECT count(*) FROM {qualified(schema, log_table_name('orders_logged'))}"
            ).scalar_one()
        out = []
        for op in ("insert", "update", "delete"):
            a, b = median(plain[op]), median(logged[op])
            out.append([dialect, op, fmt_rate(a), fmt_rate(b), fmt_ratio(b, a)])
        out.append([dialect, "log rows", "", f"{log_rows:,}", f"({3 * rows * rounds:,} changes)"])
        uninstall_quietly(engine, "orders_logged", schema)
        with engine.begin() as conn:
            for name in ("orders_plain", "orders_logged"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {qualified(schema, name)}")
        return out
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dialects", type=str_list, default=["postgresql", "sqlite"])
    parser.add_argument("--rows", type=int, default=2000, help="rows per operation per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for dialect in args.dialects:
            rows.extend(run(dialect, args.rows, args.rounds, Path(workdir)))
    print_table(
        f"Change log write overhead: one-row transactions, median of {args.rounds} rounds",
        ["dialect", "operation", "plain writes/s", "with change log", "ratio"],
        rows,
        left=2,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
