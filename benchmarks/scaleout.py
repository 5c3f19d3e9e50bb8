"""Partitioned scale-out: aggregate rows/s with 1..W worker processes, idle cost, convergence.

A handler-bound workload (the handler sleeps ``--handler-ms`` per event, an
I/O-bound stand-in) on a PostgreSQL table, ``--partitions`` partitions, a file
state store. For each worker count W the members are started on an empty
table and left to reach their fair share; then ``--rows`` rows are inserted at
once and the time until every row was delivered is taken. The table prints
rows/s, the speed-up over one worker and the target 0.8 x W.

Also printed: the storage operations one member spends per round of idle
partition ticks and per balance cycle (counted in-process), and the time a
new member takes from its first heartbeat to its fair share, and the group
after a member leaves cleanly.

    python -m benchmarks.scaleout                       # 1,2,3 workers, 3000 rows, 2 ms/event
    python -m benchmarks.scaleout --workers 1,2,4 --rows 6000 --partitions 8
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from benchmarks.common import PG_URL, ROOT, SCHEMA, fmt_rate, int_list, print_table
from dbtrigger import SqlAlchemySource
from dbtrigger.partitions import PartitionedPoller, layout
from dbtrigger.partitions.member import membership_key
from dbtrigger.state.stores.file import FileCheckpointStore
from dbtrigger.testing import CountingStore


def make_table(engine: sa.Engine, table: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{SCHEMA}".{table}')
        conn.exec_driver_sql(
            f'CREATE TABLE "{SCHEMA}".{table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)'
        )
        conn.exec_driver_sql(f'CREATE INDEX ON "{SCHEMA}".{table} (seq, id)')


class Group:
    def __init__(self, workdir: Path, table: str, args: argparse.Namespace) -> None:
        self.workdir = workdir
        self.table = table
        self.args = args
        self.state = workdir / "state"
        self.state.mkdir()
        self.store = FileCheckpointStore(self.state)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, member: str) -> None:
        self.procs.append(
            subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [
                    sys.executable,
                    "-m",
                    "benchmarks.partition_worker",
                    PG_URL,
                    SCHEMA,
                    str(self.state),
                    member,
                    str(self.workdir / f"{member}.out"),
                    "--interval",
                    str(self.args.interval),
                    "--ttl",
                    str(4 * self.args.interval),
                    "--partitions",
                    str(self.args.partitions),
                    "--handler-ms",
                    str(self.args.handler_ms),
                    "--table",
                    self.table,
                    "--batch-size",
                    str(self.args.batch_size),
                ],
                cwd=ROOT,
            )
        )

    def shares(self) -> list[int]:
        stored = self.store.read(membership_key("orders"))
        if stored is None:
            return []
        return sorted(len(m.owns) for m in layout.loads(stored.data).members.values())

    def delivered(self) -> int:
        return sum(len(p.read_text().splitlines()) for p in self.workdir.glob("*.out"))

    def wait(self, check: object, timeout: float = 120) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if check():  # type: ignore[operator]
                return time.monotonic() - started
            time.sleep(0.05)
        raise SystemExit(f"timed out after {timeout}s")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(30)


def fair(count: int, members: int) -> list[int]:
    base, extra = divmod(count, members)
    return sorted([base + 1] * extra + [base] * (members - extra))


def run_workers(
    engine: sa.Engine, workers: int, args: argparse.Namespace
) -> tuple[float, float, float | None]:
    """(rows/s, seconds to the fair share after the members joined, seconds for the
    others to take over after one member leaves cleanly: None with one worker)."""
    table = f"scaleout_{uuid.uuid4().hex[:8]}"
    make_table(engine, table)
    with tempfile.TemporaryDirectory() as tmp:
        group = Group(Path(tmp), table, args)
        try:
            for i in range(workers):
                group.start(f"w{i + 1}")
            group.wait(lambda: len(group.shares()) == workers)
            converge = group.wait(lambda: group.shares() == fair(args.partitions, workers))
            with engine.begin() as conn:
                target = f'"{SCHEMA}".{table}'
                conn.exec_driver_sql(
                    f"INSERT INTO {target} SELECT g, g FROM generate_series(1, {args.rows}) g"
                )
            took = group.wait(lambda: group.delivered() >= args.rows, timeout=600)
            left = None
            if workers > 1:
                last = group.procs.pop()
                last.terminate()  # SIGTERM: the member gives its partitions back on exit
                last.wait(30)
                left = group.wait(lambda: group.shares() == fair(args.partitions, workers - 1))
        finally:
            group.stop()
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP TABLE "{SCHEMA}".{table}')
    return args.rows / took, converge, left


def idle_ops(engine: sa.Engine, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """Store reads/writes of one member: per round of idle ticks, per balance cycle."""
    table = f"scaleout_{uuid.uuid4().hex[:8]}"
    make_table(engine, table)
    with tempfile.TemporaryDirectory() as tmp:
        store = CountingStore(FileCheckpointStore(Path(tmp)))
        member = PartitionedPoller(
            name="orders",
            source=SqlAlchemySource(
                url=PG_URL, table=table, schema=SCHEMA, cursor_column="seq", pk_columns=["id"]
            ),
            checkpoint_store=store,
            partitions=args.partitions,
            background=False,
        )
        member.balance()
        member.tick(lambda events: None)  # first ticks create nothing: idle
        before = store.counts
        member.tick_result(lambda events: None)
        after = store.counts
        tick_reads, tick_writes = after.reads - before.reads, after.writes - before.writes
        before = store.counts
        member.balance()
        after = store.counts
        member.source.close()
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP TABLE "{SCHEMA}".{table}')
    return tick_reads, tick_writes, after.reads - before.reads, after.writes - before.writes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int_list, default=[1, 2, 3])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--handler-ms", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--interval", type=float, default=1.0, help="balance interval, seconds")
    args = parser.parse_args(argv)
    engine = sa.create_engine(PG_URL)
    rows = []
    one: float | None = None
    for workers in args.workers:
        rate, converge, left = run_workers(engine, workers, args)
        one = rate if one is None and workers == 1 else one
        speedup = rate / one if one else math.nan
        rows.append(
            [
                str(workers),
                fmt_rate(rate),
                f"{speedup:.2f}" if one else "-",
                f"{0.8 * workers:.1f}",
                f"{converge:.1f}",
                "-" if left is None else f"{left:.1f}",
            ]
        )
    print_table(
        f"Partitioned drain of {args.rows:,} rows, {args.partitions} partitions, "
        f"handler {args.handler_ms:g} ms/event, balance every {args.interval:g} s",
        ["workers", "rows/s", "speed-up", "target", "s to fair share", "s after a leave"],
        rows,
    )
    reads, writes, beat_reads, beat_writes = idle_ops(engine, args)
    print_table(
        "Storage operations of one member",
        ["what", "reads", "writes"],
        [
            [
                f"one round of idle ticks ({args.partitions} partitions)",
                f"{reads:g}",
                f"{writes:g}",
            ],
            ["one balance cycle", f"{beat_reads:g}", f"{beat_writes:g}"],
        ],
    )
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
