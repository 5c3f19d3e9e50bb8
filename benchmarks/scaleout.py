"""Partitioned scale-out: worker processes started together on a backlog, at default settings.

Three measurements, each on a PostgreSQL table and a shared state store (a
directory, or Blob storage on a private Azurite with ``--stores file,blob``):

1. **Cold start at defaults.** ``--rows`` rows are in the table before any
   worker starts; W processes of ``dbtrigger run benchmarks.scaleout_app:trigger``
   (every dbtrigger setting at its default: partitions, balance interval,
   member TTL, join window, batch size, idle interval) are started together,
   and the time from their start until every row was delivered is taken. The
   handler waits ``--handler-ms`` per event (an I/O-bound stand-in). Each
   worker count runs ``--repeat`` times (3), interleaved with the others so that
   the machine's drifting load touches all of them alike. Printed: the median
   seconds and their range, rows/s, the speed-up over one worker (of the
   medians), the target 0.8 x W, the seconds until every member had written
   its first heartbeat (the processes' own start-up: interpreter, imports,
   first connection) and until the members held their fair shares, the
   events delivered twice, and the CPU seconds the worker processes used
   together (what a loaded machine has to find for them).
2. **Convergence at defaults.** With three members running, the seconds until
   ownership is fair again after a fourth joins (from its process start), after
   one leaves cleanly (SIGTERM), and after one is killed (SIGKILL: the member
   TTL has to pass first).
3. **Tuned and warm** (``--tuned``), the figures of earlier releases: members
   of ``benchmarks.partition_worker`` with a 0.5 s balance interval and a 2 s
   member TTL are left to settle on an empty table before the rows go in.

Also printed: one member's storage operations per round of idle partition
ticks and per balance cycle (counted in-process).

The workers run dbtrigger from a private copy of its package, with its
bytecode compiled first (``--bytecode compiled``, the default), as a ``pip
install`` compiles it: a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` (this
project's sandbox sets it) compiles every dbtrigger module from source again
in every process, about 0.2-0.3 s of CPU each, which three processes started
together on two cores pay at once. ``--bytecode source`` measures that
condition, ``both`` interleaves the two (a table each). ``--against DIR`` adds
the same cold starts with another checkout's ``src/dbtrigger`` (an A/B in one
run; ``git worktree add /tmp/old <commit>``).

    python -m benchmarks.scaleout                          # 9,000 rows, 2 ms/event, 1,2,3 workers
    python -m benchmarks.scaleout --stores file,blob --tuned
    python -m benchmarks.scaleout --workers 1,2 --rows 2000 --skip-convergence
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

import dbtrigger
from benchmarks.common import PG_URL, ROOT, SCHEMA, fmt_rate, int_list, print_table
from dbtrigger import SqlAlchemySource
from dbtrigger.partitions import PartitionedPoller, layout
from dbtrigger.partitions.member import DEFAULT_PARTITIONS, membership_key
from dbtrigger.state.stores.factory import open_store
from dbtrigger.state.stores.file import FileCheckpointStore
from dbtrigger.testing import CountingStore


def make_table(engine: sa.Engine, table: str, rows: int = 0) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{SCHEMA}".{table}')
        conn.exec_driver_sql(
            f'CREATE TABLE "{SCHEMA}".{table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)'
        )
        conn.exec_driver_sql(f'CREATE INDEX ON "{SCHEMA}".{table} (seq, id)')
        if rows:
            insert_rows(conn, table, 1, rows)


def insert_rows(conn: sa.Connection, table: str, first: int, last: int) -> None:
    conn.exec_driver_sql(
        f'INSERT INTO "{SCHEMA}".{table} SELECT g, g FROM generate_series({first}, {last}) g'
    )


def drop_table(engine: sa.Engine, table: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{SCHEMA}".{table}')


def fair(count: int, members: int) -> list[int]:
    base, extra = divmod(count, members)
    return sorted([base + 1] * extra + [base] * (members - extra))


@dataclass(frozen=True)
class Variant:
    """What the workers run: a copy of a dbtrigger package, compiled or not."""

    label: str
    path: Path  # a directory holding the package ``dbtrigger``: first on PYTHONPATH
    compiled: bool

    def env(self) -> dict[str, str]:
        return {
            "PYTHONPATH": os.pathsep.join(
                [str(self.path), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            # Compiled: the copy's bytecode is there and is read. Source: nothing is
            # written, so every process compiles every dbtrigger module again.
            **({} if self.compiled else {"PYTHONDONTWRITEBYTECODE": "1"}),
        }


def make_variants(args: argparse.Namespace, where: Path) -> list[Variant]:
    """Private copies of the package (``__pycache__`` left out), compiled when asked."""
    trees = {"": Path(dbtrigger.__file__).parent}
    for other in args.against:
        trees[f"{Path(other).name} "] = Path(other) / "src" / "dbtrigger"
    modes = ["compiled", "source"] if args.bytecode == "both" else [args.bytecode]
    variants = []
    for n, (name, tree) in enumerate(trees.items()):
        for mode in modes:
            path = where / f"v{n}-{mode}"
            shutil.copytree(tree, path / "dbtrigger", ignore=shutil.ignore_patterns("__pycache__"))
            if mode == "compiled":
                compileall.compile_dir(path, quiet=1)
            variants.append(Variant(f"{name}{mode}", path, mode == "compiled"))
    return variants


class Group:
    """Worker processes of one partitioned poller, their output and their membership."""

    def __init__(self, workdir: Path, store: str, app: str, variant: Variant) -> None:
        self.workdir = workdir
        self.store_spec = store
        self.app = app
        self.variant = variant
        self.store = open_store(store, app=app)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start_run(self, name: str, table: str, handler_ms: float, partitions: int | None) -> None:
        """``dbtrigger run`` on the benchmark app, every setting at its default."""
        env = {
            **os.environ,
            "DBT_SCALEOUT_URL": PG_URL,
            "DBT_SCALEOUT_SCHEMA": SCHEMA,
            "DBT_SCALEOUT_TABLE": table,
            "DBT_SCALEOUT_STORE": self.store_spec,
            "DBT_SCALEOUT_APP": self.app,
            "DBT_SCALEOUT_HANDLER_MS": str(handler_ms),
            "DBT_SCALEOUT_OUT": str(self.workdir),
            **self.variant.env(),
        }
        if partitions is not None:
            env["DBT_SCALEOUT_PARTITIONS"] = str(partitions)
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "dbtrigger.cli", "run", "benchmarks.scaleout_app:trigger"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def start_worker(self, name: str, table: str, args: argparse.Namespace) -> None:
        """``benchmarks.partition_worker`` with the tuned interval and TTL."""
        self.procs[name] = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [
                sys.executable,
                "-m",
                "benchmarks.partition_worker",
                PG_URL,
                SCHEMA,
                self.store_spec,
                name,
                str(self.workdir / f"{name}.out"),
                "--interval",
                "0.5",
                "--ttl",
                "2",
                "--partitions",
                str(args.tuned_partitions),
                "--handler-ms",
                str(args.handler_ms),
                "--table",
                table,
                "--app",
                self.app,
            ],
            cwd=ROOT,
            env={**os.environ, **self.variant.env()},
        )

    def membership(self) -> layout.Membership | None:
        stored = self.store.read(membership_key("orders"))
        return layout.loads(stored.data) if stored is not None else None

    def shares(self) -> list[int]:
        doc = self.membership()
        return sorted(len(m.owns) for m in doc.members.values()) if doc else []

    def deliveries(self) -> Counter[int]:
        counts: Counter[int] = Counter()
        for path in self.workdir.glob("*.out"):
            for line in path.read_text().splitlines():
                key, _, seq = line.partition(",")
                if seq:
                    counts[int(key)] += 1
        return counts

    def workers_with_work(self) -> int:
        return sum(1 for p in self.workdir.glob("*.out") if p.stat().st_size)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


def wait(check: Callable[[], bool], timeout: float = 300, poll: float = 0.05) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(poll)
    raise SystemExit(f"timed out after {timeout}s")


@contextlib.contextmanager
def stores(names: list[str]) -> Iterator[dict[str, str]]:
    """Store locations by name; ``blob`` starts a private Azurite for the run."""
    specs: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        if "blob" in names:
            from benchmarks.common import azurite  # noqa: PLC0415

            running = stack.enter_context(azurite())
            from azure.storage.blob import BlobServiceClient  # noqa: PLC0415

            BlobServiceClient.from_connection_string(running.connection_string).create_container(
                "db-state"
            )
            specs["blob"] = running.connection_string
        if "file" in names:
            specs["file"] = "file"
        yield specs


def store_location(spec: str, workdir: Path) -> str:
    if spec == "file":
        (workdir / "state").mkdir()
        return str(workdir / "state")
    return spec


@dataclass(frozen=True)
class ColdRun:
    """One cold start: seconds from the processes' start until every row was
    delivered, until every member had written its first heartbeat (the processes'
    own start-up, which the group cannot shorten) and until the fair shares."""

    took: float
    up_at: float
    fair_at: float
    with_work: int
    twice: int
    cpu: float  # CPU seconds the worker processes used, user + system


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cold_start(
    engine: sa.Engine, spec: str, workers: int, args: argparse.Namespace, variant: Variant
) -> ColdRun:
    table = f"scaleout_{uuid.uuid4().hex[:8]}"
    make_table(engine, table, args.rows)
    partitions = args.partitions or DEFAULT_PARTITIONS
    with tempfile.TemporaryDirectory() as tmp:
        group = Group(
            Path(tmp), store_location(spec, Path(tmp)), f"bench{uuid.uuid4().hex[:8]}", variant
        )
        cpu = children_cpu()
        started = time.monotonic()
        fair_at: float | None = None
        up_at: float | None = None
        try:
            for i in range(workers):
                group.start_run(f"w{i + 1}", table, args.handler_ms, args.partitions)
            target = fair(partitions, workers)

            def done() -> bool:
                nonlocal fair_at, up_at
                doc = group.membership()
                if doc is not None and up_at is None and len(doc.members) >= workers:
                    up_at = time.monotonic() - started
                shares = sorted(len(m.owns) for m in doc.members.values()) if doc else []
                if fair_at is None and shares == target:
                    fair_at = time.monotonic() - started
                return len(group.deliveries()) >= args.rows

            wait(done, timeout=600, poll=0.1)
            took = time.monotonic() - started
            counts = group.deliveries()
            with_work = group.workers_with_work()
        finally:
            group.stop_all()
        cpu = children_cpu() - cpu  # the workers were waited for: their CPU is counted
    drop_table(engine, table)
    return ColdRun(
        took,
        math.nan if up_at is None else up_at,
        math.nan if fair_at is None else fair_at,
        with_work,
        sum(n - 1 for n in counts.values()),
        cpu,
    )


def cold_table(runs: dict[int, list[ColdRun]], rows: int) -> list[list[str]]:
    """One line per worker count: medians over the repetitions, speed-up of the medians."""
    out = []
    one = statistics.median(r.took for r in runs[1]) if 1 in runs else None
    for workers, done in runs.items():
        took = statistics.median(r.took for r in done)
        fastest, slowest = min(r.took for r in done), max(r.took for r in done)
        out.append(
            [
                str(workers),
                f"{took:.1f}",
                f"{fastest:.1f}-{slowest:.1f}",
                fmt_rate(rows / took),
                f"{one / took:.2f}" if one else "-",
                f"{0.8 * workers:.1f}",
                f"{statistics.median(r.up_at for r in done):.1f}",
                f"{statistics.median(r.fair_at for r in done):.1f}",
                f"{min(r.with_work for r in done)}/{workers}",
                str(max(r.twice for r in done)),
                f"{statistics.median(r.cpu for r in done):.1f}",
            ]
        )
    return out


def cold_start_table(
    runs: dict[tuple[str, int], list[ColdRun]],
    label: str,
    store: str,
    partitions: int,
    args: argparse.Namespace,
) -> None:
    print_table(
        f"Cold start at defaults ({store} store, dbtrigger {label}): {args.rows:,} rows "
        f"waiting, {partitions} partitions, handler {args.handler_ms:g} ms/event, "
        f"timed from process start, median of {args.repeat}",
        [
            "workers",
            "s",
            "range",
            "rows/s",
            "speed-up",
            "target",
            "s all up",
            "s to fair share",
            "with work",
            "twice",
            "worker CPU s",
        ],
        cold_table({w: done for (v, w), done in runs.items() if v == label}, args.rows),
    )


def convergence(
    engine: sa.Engine, spec: str, args: argparse.Namespace, variant: Variant
) -> dict[str, float]:
    """Seconds until ownership is fair again after a join, a clean leave and a SIGKILL."""
    table = f"scaleout_{uuid.uuid4().hex[:8]}"
    make_table(engine, table, 0)
    partitions = args.partitions or DEFAULT_PARTITIONS
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        group = Group(
            Path(tmp), store_location(spec, Path(tmp)), f"bench{uuid.uuid4().hex[:8]}", variant
        )
        try:
            for name in ("w1", "w2", "w3"):
                group.start_run(name, table, args.handler_ms, args.partitions)
            wait(lambda: group.shares() == fair(partitions, 3), timeout=120)
            started = time.monotonic()
            group.start_run("w4", table, args.handler_ms, args.partitions)
            wait(lambda: group.shares() == fair(partitions, 4), timeout=120)
            out["join (from process start)"] = time.monotonic() - started
            started = time.monotonic()
            group.stop("w4")  # SIGTERM: its partitions are given back on exit
            wait(lambda: group.shares() == fair(partitions, 3), timeout=120)
            out["clean leave (SIGTERM)"] = time.monotonic() - started
            started = time.monotonic()
            group.stop("w3", signal.SIGKILL)
            wait(lambda: group.shares() == fair(partitions, 2), timeout=120)
            out["kill (SIGKILL)"] = time.monotonic() - started
        finally:
            group.stop_all()
    drop_table(engine, table)
    return out


def tuned(
    engine: sa.Engine, spec: str, workers: int, args: argparse.Namespace, variant: Variant
) -> float:
    """rows/s of W tuned members that settled on an empty table before the rows went in."""
    table = f"scaleout_{uuid.uuid4().hex[:8]}"
    make_table(engine, table, 0)
    with tempfile.TemporaryDirectory() as tmp:
        group = Group(
            Path(tmp), store_location(spec, Path(tmp)), f"tuned{uuid.uuid4().hex[:8]}", variant
        )
        try:
            for i in range(workers):
                group.start_worker(f"w{i + 1}", table, args)
            wait(lambda: group.shares() == fair(args.tuned_partitions, workers), timeout=120)
            with engine.begin() as conn:
                insert_rows(conn, table, 1, args.rows)
            took = wait(lambda: len(group.deliveries()) >= args.rows, timeout=600, poll=0.1)
        finally:
            group.stop_all()
    drop_table(engine, table)
    return args.rows / took


def idle_ops(engine: sa.Engine, partitions: int) -> tuple[float, float, float, float]:
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
            partitions=partitions,
            join_window_seconds=0,
            background=False,
        )
        member.tick(lambda events: None)  # first ticks create nothing: idle
        while not member.balance().settled:  # type: ignore[union-attr]
            pass
        before = store.counts
        member.tick_result(lambda events: None)
        after = store.counts
        tick_reads, tick_writes = after.reads - before.reads, after.writes - before.writes
        before = store.counts
        member.balance()
        after = store.counts
        member.source.close()
    drop_table(engine, table)
    return tick_reads, tick_writes, after.reads - before.reads, after.writes - before.writes


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int_list, default=[1, 2, 3])
    parser.add_argument("--rows", type=int, default=9000)
    parser.add_argument("--handler-ms", type=float, default=2.0)
    parser.add_argument(
        "--partitions", type=int, default=None, help="default: dbtrigger's default count"
    )
    parser.add_argument("--stores", default="file", help="file,blob (blob: a private Azurite)")
    parser.add_argument("--tuned", action="store_true", help="also the tuned, warm figures")
    parser.add_argument("--tuned-partitions", type=int, default=6)
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument(
        "--repeat", type=int, default=3, help="cold starts per worker count (median)"
    )
    parser.add_argument(
        "--bytecode",
        choices=["compiled", "source", "both"],
        default="compiled",
        help="dbtrigger's bytecode compiled before the workers start, as pip install does "
        "(default), or compiled from source by every worker (PYTHONDONTWRITEBYTECODE=1 on a "
        "checkout), or both interleaved",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="DIR",
        help="also cold-start another checkout's src/dbtrigger, interleaved (an A/B)",
    )
    args = parser.parse_args(argv)
    engine = sa.create_engine(PG_URL)
    partitions = args.partitions or DEFAULT_PARTITIONS
    print(f"load average before: {load_average()}")
    with stores(args.stores.split(",")) as specs, tempfile.TemporaryDirectory() as copies:
        variants = make_variants(args, Path(copies))
        for name, spec in specs.items():
            runs: dict[tuple[str, int], list[ColdRun]] = {
                (v.label, w): [] for v in variants for w in args.workers
            }
            for _ in range(args.repeat):  # interleaved: the machine's load drifts over a run
                for workers in args.workers:
                    for variant in variants:
                        runs[variant.label, workers].append(
                            cold_start(engine, spec, workers, args, variant)
                        )
            for variant in variants:
                cold_start_table(runs, variant.label, name, partitions, args)
            if not args.skip_convergence:
                times = convergence(engine, spec, args, variants[0])
                print_table(
                    f"Convergence at defaults ({name} store), 3 members, {partitions} partitions: "
                    "seconds until every partition is owned by a fair share again",
                    ["event", "seconds"],
                    [[event, f"{seconds:.1f}"] for event, seconds in times.items()],
                )
            if args.tuned:
                rows = []
                one = None
                for workers in args.workers:
                    rate = tuned(engine, spec, workers, args, variants[0])
                    one = rate if one is None and workers == 1 else one
                    rows.append(
                        [
                            str(workers),
                            fmt_rate(rate),
                            f"{rate / one:.2f}" if one else "-",
                            f"{0.8 * workers:.1f}",
                        ]
                    )
                print_table(
                    f"Tuned and warm ({name} store): balance every 0.5 s, member TTL 2 s, "
                    f"{args.tuned_partitions} partitions, members settled before "
                    f"{args.rows:,} rows go in",
                    ["workers", "rows/s", "speed-up", "target"],
                    rows,
                )
    reads, writes, beat_reads, beat_writes = idle_ops(engine, partitions)
    print_table(
        "Storage operations of one member",
        ["what", "reads", "writes"],
        [
            [f"one round of idle ticks ({partitions} partitions)", f"{reads:g}", f"{writes:g}"],
            ["one balance cycle", f"{beat_reads:g}", f"{beat_writes:g}"],
        ],
    )
    print(f"load average after: {load_average()}")
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
