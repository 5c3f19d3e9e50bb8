"""Commit -> handler latency of a worker at default settings, with and without wake-up hints.

A writer process commits one row per transaction at a steady rate (``--rates``,
default 200/s and 2,000/s) for ``--seconds`` (from one session on PostgreSQL,
taking turns on eight on MariaDB: ``--writer-connections``); a worker in this process runs
what ``dbtrigger run`` runs (a :class:`~dbtrigger.runtime.runner.Runner` over
a ``PollTrigger`` with default options: batch size, batches per tick, lease,
the visibility guard, an in-memory store) at the default interval
(``--interval``, 5 s as ``dbtrigger run``). For every row it records the
handler's clock minus the writer's clock right after that row's commit
returned, and prints p50/p95/p99/max per configuration, next to the targets:

* ``none`` (polling alone): p50 <= interval / 2 + 50 ms;
* ``notify`` (PostgreSQL ``LISTEN/NOTIFY``, ``dbtrigger wake install``): p50 <=
  50 ms and p99 <= 250 ms at 200 rows/s;
* ``notify-lost`` (the worker listens, nothing notifies: the hint lost): never
  worse than polling alone (the same p50 target);
* ``adaptive`` (any database): shorter idle waits after activity.

Sources (``--sources``): ``polling`` (``SqlAlchemySource`` on the table's
``updated_at``, set by the database: ``clock_timestamp()`` / ``NOW(6)``) and
``changelog`` (``ChangeLogSource`` over the trigger-maintained log). The
log-based sources (``PgLogicalSource``, ``BinlogSource``) need private servers
and have their own latency runs in ``cdc_pg.py`` and ``cdc_binlog.py``.

Each database gets a database of its own for the run (dropped at the end), so
the PostgreSQL transaction-horizon guard waits only for this run's writers;
MariaDB's horizon is server-wide, so other sessions' open writers on a shared
server show up in its tail. ``ticks/s`` is what the latency costs: how often
the worker polled. ``sleeps``: idle waits of the whole interval per run while
the writer ran. Polling alone sleeps the interval after any tick that finds
nothing (a pause in the writer's commits longer than a tick is enough), and
its ticks then drain the interval's backlog, 100 rows a tick, and catch up: a
steady writer's rows wait from 0 to the interval, whatever the ticks per
second (p50 about interval / 2).

    python -m benchmarks.latency                       # both databases, every hint, 20 s runs
    python -m benchmarks.latency --dbs postgresql --hints none,notify --rates 200
    python -m benchmarks.latency --quick               # a short smoke run
    python -m benchmarks.latency --model --seconds 15  # the simulated worker, no databases
    python -m benchmarks.latency --dbs postgresql --sources changelog --hints none --rates 2000 \
        --repeats 5                                    # one case, five runs pooled

The phase: a worker that is not woken sleeps the interval after a tick that
found nothing, so a row's wait depends on where in that cycle it was
committed. A run of a few cycles whose writer always started at the same
point of the cycle would weigh some parts of it more than others (p50 moved
by +-150 ms between 15 s runs). So each run starts its writer at a random
point of the worker's idle cycle (``--phase random``, the default; ``fixed``
starts it right after the worker's first tick, as earlier runs did), and
``--repeats`` runs of a configuration are pooled: their rows together give
the percentiles, and a note gives each run's p50.

Run ``k`` of every hint of a (database, source, rate) gets the same phase,
so the hints are compared over the same start (they once drew one phase
each, and a hint's row could be worse than polling alone by its draw alone).
That start is the same for every hint: before it has delivered anything, a
worker sleeps the interval whatever the hint (the adaptive hint shortens the
waits after activity only), and the writer's first rows wait out the rest of
that sleep. ``asleep``: how long the writer committed into it, mean s a run,
which is what sets p95 and above in a 10 s run (and, at 200 rows/s, a third
of the rows). ``awake p50``/``p99``: the rows committed after it ended, what
the worker does once it runs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks.common import PG_URL, ROOT, fmt_rate, percentile, print_table, str_list
from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource
from dbtrigger.changelog import install as install_changelog
from dbtrigger.runtime.pacing import ShortensWait, shortened
from dbtrigger.runtime.runner import Runner
from dbtrigger.sources.visibility import MariaDbHorizon
from dbtrigger.wakeup import AdaptivePolling, NotifyHint, WakeHint
from dbtrigger.wakeup import install as install_wake

MARIADB_URL = os.environ.get(
    "DBTRIGGER_BENCH_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)
HINTS = ("none", "notify", "notify-lost", "adaptive")
#: The writer's sessions on MariaDB (see :func:`benchmarks.latency_writer.writer_main`).
MARIADB_WRITERS = 8
#: Hints that need PostgreSQL notifications.
PG_ONLY = ("notify", "notify-lost")


# --- databases and tables ------------------------------------------------------------------


@dataclass
class Database:
    kind: str  # postgresql / mariadb
    admin_url: str
    url: str
    name: str


def writer_sessions(kind: str, args: argparse.Namespace) -> int:
    """How many sessions the writer commits from on ``kind``."""
    if args.writer_connections is not None:
        return int(args.writer_connections)
    return 1 if kind == "postgresql" else MARIADB_WRITERS


def create_database(kind: str) -> Database:
    admin_url = PG_URL if kind == "postgresql" else MARIADB_URL
    name = f"dbtrigger_lat_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            q = f'"{name}"' if kind == "postgresql" else f"`{name}`"
            conn.exec_driver_sql(f"CREATE DATABASE {q}")
    finally:
        admin.dispose()
    url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    return Database(kind, admin_url, url, name)


def drop_database(db: Database) -> None:
    admin = sa.create_engine(db.admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if db.kind == "postgresql":
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db.name}" WITH (FORCE)')
            else:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{db.name}`")
    finally:
        admin.dispose()


def create_table(db: Database, table: str) -> None:
    engine = sa.create_engine(db.url)
    try:
        with engine.begin() as conn:
            if db.kind == "postgresql":
                conn.exec_driver_sql(
                    f"CREATE TABLE {table} (id bigserial PRIMARY KEY, "
                    "updated_at timestamptz NOT NULL DEFAULT clock_timestamp(), payload text)"
                )
            else:
                conn.exec_driver_sql(
                    f"CREATE TABLE {table} (id bigint AUTO_INCREMENT PRIMARY KEY, "
                    "updated_at datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) "
                    "ON UPDATE CURRENT_TIMESTAMP(6), payload text)"
                )
            conn.exec_driver_sql(f"CREATE INDEX {table}_cursor ON {table} (updated_at, id)")
    finally:
        engine.dispose()


# --- one measured run ----------------------------------------------------------------------


@dataclass
class Result:
    db: str
    source: str
    hint: str
    rate: float
    written: int = 0
    achieved: float = 0.0
    seen: int = 0
    ticks: int = 0
    #: Idle sleeps of the whole interval while the writer ran (a tick found
    #: nothing and nothing held back).
    sleeps: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    note: str = ""
    #: The p50 of each pooled run, ms.
    run_p50s: list[float] = field(default_factory=list)
    #: How late the writer committed each row against its schedule, s.
    late: list[float] = field(default_factory=list)
    #: Each run's time from the first commit to the end of the worker's sleep
    #: that began before it (0: the worker was awake), s.
    asleep: list[float] = field(default_factory=list)
    #: The latencies of the rows committed after that sleep ended (the worker
    #: awake), s: what the worker does once it runs, without the start's sleep.
    awake: list[float] = field(default_factory=list)

    def pool(self, other: Result) -> None:
        """Add another run of the same configuration."""
        self.written += other.written
        self.achieved = (self.achieved * len(self.run_p50s) + other.achieved) / (
            len(self.run_p50s) + 1
        )
        self.seen += other.seen
        self.ticks += other.ticks
        self.sleeps += other.sleeps
        self.seconds += other.seconds
        self.latencies += other.latencies
        self.note = "; ".join(n for n in (self.note, other.note) if n)
        self.run_p50s += other.run_p50s
        self.late += other.late
        self.asleep += other.asleep
        self.awake += other.awake


class CountingRunner(Runner):
    """A Runner that counts its idle waits of the whole interval: what a row
    committed right after an empty tick waits for (polling alone), whatever the
    worker's ticks per second. A wait the hint shortened is not one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: When each idle wait of the whole interval began (wall clock).
        self.full_sleeps: list[float] = []
        #: (start, end) of every idle wait (wall clock).
        self.sleeps: list[tuple[float, float]] = []
        #: Set when the first idle wait begins (the writer's phase counts from it).
        self.first_sleep = threading.Event()
        self.first_sleep_at = 0.0

    def _idle(self, seconds: float) -> None:
        started = time.time()
        waits = seconds
        if isinstance(self.wake, ShortensWait) and not self._failures:
            waits = shortened(self.wake, seconds, self._idle_ticks)
        if waits >= self.interval:
            self.full_sleeps.append(started)
        if not self.first_sleep.is_set():
            self.first_sleep_at = started
            self.first_sleep.set()
        super()._idle(seconds)
        self.sleeps.append((started, time.time()))


def make_hint(hint: str, interval: float) -> WakeHint | None:
    del interval
    if hint in PG_ONLY:
        return NotifyHint()
    if hint == "adaptive":
        return AdaptivePolling()
    return None


def phase(args: argparse.Namespace, db: str, source: str, rate: float, run: int) -> float:
    """Where run ``run`` of (``db``, ``source``, ``rate``) starts its writer in the
    worker's idle cycle, s: the same for every hint (a paired comparison)."""
    draw = random.Random(f"{args.seed}:{db}:{source}:{rate:g}:{run}")  # not a secret
    return draw.uniform(0, args.interval)


def measure(
    db: Database, source_kind: str, hint: str, rate: float, args: argparse.Namespace, run: int = 0
) -> Result:
    table = f"lat_{uuid.uuid4().hex[:8]}"
    create_table(db, table)
    engine = sa.create_engine(db.url)
    try:
        if source_kind == "changelog":
            install_changelog(engine, table)
        if hint == "notify":  # notify-lost: the worker listens, nothing notifies
            install_wake(engine, table)
    finally:
        engine.dispose()
    if source_kind == "changelog":
        source: Any = ChangeLogSource(url=db.url, table=table)
    else:
        guard: dict[str, Any] = {}
        if db.kind == "mariadb" and args.precision is not None:
            guard["visibility"] = MariaDbHorizon(precision=args.precision)
        source = SqlAlchemySource(
            url=db.url, table=table, cursor_column="updated_at", pk_columns=["id"], **guard
        )
    trigger = PollTrigger(name=table, source=source, checkpoint_store=InMemoryCheckpointStore())
    received: dict[int, float] = {}

    def handle(events: Sequence[Any]) -> None:
        now = time.time()
        for event in events:
            received[int(event.after["payload"])] = now

    wake = make_hint(hint, args.interval)
    runner = CountingRunner(
        trigger, handle, interval_seconds=args.interval, progress=None, wake=wake
    )
    worker = threading.Thread(target=runner.run, kwargs={"install_signals": False}, daemon=True)
    result = Result(db.kind, source_kind, hint, rate)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "commits.json")
        worker.start()
        try:
            # Set up before the clock starts: the first tick (reflection, the guard's
            # decision) done, and the listener listening.
            deadline = time.monotonic() + 60
            while runner.stats.ticks < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            if isinstance(wake, NotifyHint) and wake.listener is not None:
                wake.listener.listening.wait(60)
            start_at = 0.0
            if args.phase == "random":  # a random point of the worker's first idle wait
                runner.first_sleep.wait(60)
                began = runner.first_sleep_at or time.time()
                start_at = began + phase(args, db.kind, source_kind, rate, run)
            ticks_before = runner.stats.ticks
            started = time.monotonic()
            subprocess.run(  # noqa: S603 - this script, run again as the writer
                [
                    sys.executable,
                    "-m",
                    "benchmarks.latency_writer",
                    json.dumps(
                        [
                            db.url,
                            table,
                            rate,
                            args.seconds,
                            out,
                            writer_sessions(db.kind, args),
                            start_at,
                        ]
                    ),
                ],
                cwd=ROOT,
                check=True,
            )
            written = json.loads(Path(out).read_text())
            commits: list[float] = written["commits"]
            # Every row arrives within about one interval after the last commit.
            deadline = time.monotonic() + args.interval + 60
            while len(received) < len(commits) and time.monotonic() < deadline:
                time.sleep(0.01)
            result.seconds = time.monotonic() - started
            result.ticks = runner.stats.ticks - ticks_before
        finally:
            runner.stop()
            worker.join(60)
            source.close()
    result.written = len(commits)
    result.achieved = len(commits) / written["seconds"] if written["seconds"] else 0.0
    result.seen = sum(1 for i in range(len(commits)) if i in received)
    result.latencies = [received[i] - at for i, at in enumerate(commits) if i in received]
    result.late = written.get("late", [])
    if commits:  # the sleeps that began while the writer was committing
        first, last = min(commits), max(commits)
        result.sleeps = sum(1 for at in runner.full_sleeps if first <= at <= last)
        into = [end - first for at, end in runner.sleeps if at < first]
        result.asleep = [max(0.0, *into)]
        woke = first + result.asleep[0]
        result.awake = [
            received[i] - at for i, at in enumerate(commits) if i in received and at >= woke
        ]
    if result.seen < result.written:
        result.note = f"{result.written - result.seen} rows not delivered in time"
    result.run_p50s = [percentile(result.latencies, 0.5) * 1000]
    return result


# --- the model: what the drain does to p50 ---------------------------------------------


def model_latencies(
    rate: float, fixed: float, per_row: float, *, interval: float, seconds: float, seed: int
) -> list[tuple[float, float]]:
    """(latency, commit time) of every row of a simulated worker: Poisson commits at
    ``rate``; a tick reads up to 100 rows committed before it starts and hands them over
    ``fixed + per_row * rows`` seconds later; it ticks again at once after any rows,
    else sleeps ``interval`` (as ``dbtrigger run`` without a hint)."""
    rng = random.Random(seed)
    commits: list[float] = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        commits.append(t)
    out: list[tuple[float, float]] = []
    t, i, n = 0.0, 0, len(commits)
    while i < n:
        j = i
        while j < n and j - i < 100 and commits[j] <= t:
            j += 1
        end = t + fixed + per_row * (j - i)
        if j == i:
            t = end + interval
            continue
        out.extend((end - c, c) for c in commits[i:j])
        i, t = j, end
    return out


def model(args: argparse.Namespace) -> None:
    """p50 of a long simulated run, and its spread over runs of ``--seconds``, by the
    cost of a batch of 100: the drain moves the short runs' p50, not the long run's."""
    rows = []
    for rate in [float(r) for r in str_list(args.rates)]:
        for full_ms in (1.0, 2.0, 3.0, 4.5):
            fixed = 0.0008 if full_ms > 0.8 else full_ms / 2000
            per_row = (full_ms / 1000 - fixed) / 100
            runs = model_latencies(
                rate, fixed, per_row, interval=args.interval, seconds=900.0, seed=1
            )
            at = [commit for _, commit in runs]  # in commit order
            rng = random.Random(7)
            short = []
            for _ in range(60):
                start = rng.uniform(20.0, 900.0 - args.seconds)
                lo, hi = bisect.bisect_left(at, start), bisect.bisect_left(at, start + args.seconds)
                short.append(percentile([lat for lat, _ in runs[lo:hi]], 0.5) * 1000)
            rows.append(
                [
                    fmt_rate(rate),
                    f"{full_ms:g}",
                    f"{percentile([lat for lat, _ in runs], 0.5) * 1000:,.0f}",
                    f"{min(short):,.0f}-{max(short):,.0f}",
                    f"{statistics.pstdev(short):,.0f}",
                ]
            )
    print_table(
        f"Model: p50 of commit -> handler latency, ms, interval {args.interval:g} s "
        f"(900 s run; 60 runs of {args.seconds:g} s at random starts)",
        ["rate", "ms a batch of 100", "p50 900 s", f"p50 {args.seconds:g} s runs", "sd"],
        rows,
        left=2,
    )


# --- report --------------------------------------------------------------------------------


def targets(result: Result, interval: float) -> tuple[str, str]:
    """(the target, met?) of one configuration; '-' where none is set."""
    p50 = percentile(result.latencies, 0.5)
    p99 = percentile(result.latencies, 0.99)
    if result.hint in ("none", "notify-lost"):
        bound = interval / 2 + 0.05
        return f"p50 <= {bound * 1000:,.0f}", "yes" if p50 <= bound else "no"
    if result.hint == "notify" and result.rate <= 200:
        return "p50 <= 50, p99 <= 250", "yes" if p50 <= 0.05 and p99 <= 0.25 else "no"
    return "-", "-"


def report(results: list[Result], args: argparse.Namespace) -> None:
    rows = []
    for r in results:
        target, met = targets(r, args.interval)
        ms = [percentile(r.latencies, q) * 1000 for q in (0.5, 0.95, 0.99, 1.0)]
        rows.append(
            [
                r.db,
                r.source,
                r.hint,
                fmt_rate(r.rate),
                fmt_rate(r.achieved),
                f"{r.seen:,}",
                *(f"{v:,.0f}" for v in ms),
                f"{r.ticks / r.seconds:,.1f}" if r.seconds else "-",
                f"{r.sleeps / len(r.run_p50s):,.1f}",
                f"{statistics.fmean(r.asleep):,.1f}" if r.asleep else "-",
                *(f"{percentile(r.awake, q) * 1000:,.0f}" if r.awake else "-" for q in (0.5, 0.99)),
                target,
                met,
            ]
        )
    load = os.getloadavg()
    print_table(
        "Commit -> handler latency, ms (worker at default settings"
        + ("" if args.precision is None else f", MariaDbHorizon(precision={args.precision})")
        + f", interval "
        f"{args.interval:g} s; {args.seconds:g} s per run, {args.repeats} run(s) pooled, "
        f"writer started at a {args.phase} phase, seed {args.seed}; load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end)",
        [
            "db",
            "source",
            "hint",
            "rate",
            "achieved",
            "rows",
            "p50",
            "p95",
            "p99",
            "max",
            "ticks/s",
            "sleeps",
            "asleep",
            "awake p50",
            "awake p99",
            "target ms",
            "met",
        ],
        rows,
        left=3,
    )
    for r in results:
        if r.note:
            print(f"note: {r.db} {r.source} {r.hint} {r.rate:g}/s: {r.note}")
        if r.late and percentile(r.late, 0.99) > 0.05:
            print(
                f"writer behind schedule: {r.db} {r.source} {r.hint} {r.rate:g}/s: "
                f"p50 {percentile(r.late, 0.5) * 1000:,.0f} ms, p99 "
                f"{percentile(r.late, 0.99) * 1000:,.0f} ms, "
                f"{sum(1 for v in r.late if v > 0.05) / len(r.late):.0%} of rows over 50 ms late"
            )
        if len(r.run_p50s) > 1:
            each = ", ".join(f"{v:,.0f}" for v in r.run_p50s)
            print(f"p50 of each run: {r.db} {r.source} {r.hint} {r.rate:g}/s: {each}")
    print(
        "hint: none = polling alone; notify = LISTEN/NOTIFY (dbtrigger wake install); "
        "notify-lost = listening, nothing notifies; adaptive = shorter idle waits after "
        "activity. achieved = rows/s the writer kept up. sleeps = idle waits of the whole "
        "interval per run while the writer committed (a tick found nothing): rows committed "
        "during one wait up to the interval, which is what sets polling's p50, however many "
        "ticks drain the backlog after it (ticks/s). asleep = s the writer committed into the "
        "worker's sleep from before its first commit (mean a run; every hint of a row has the "
        "same phases); awake p50/p99 = the rows committed after that sleep ended."
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dbs", default="postgresql,mariadb", help="postgresql,mariadb")
    parser.add_argument("--sources", default="polling,changelog", help="polling,changelog")
    parser.add_argument("--hints", default=",".join(HINTS), help=",".join(HINTS))
    parser.add_argument("--rates", help="rows/s the writer commits (default 200,2000)")
    parser.add_argument("--seconds", type=float, help="length of each run (default 20)")
    parser.add_argument(
        "--interval",
        type=float,
        help="the worker's idle interval (default 5, as dbtrigger run)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 s runs at 200/s, interval 0.5 s, unless given (a smoke run)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each configuration, pooled into one row (default 1)",
    )
    parser.add_argument(
        "--phase",
        choices=("random", "fixed"),
        default="random",
        help="where in the worker's idle cycle the writer starts (default random)",
    )
    parser.add_argument("--seed", type=int, help="seed of the random phases")
    parser.add_argument(
        "--model",
        action="store_true",
        help="no databases: simulate the worker and print how a batch's cost moves p50",
    )
    parser.add_argument(
        "--writer-connections",
        type=int,
        help="sessions the writer commits from, taking turns (default: 1 on PostgreSQL, "
        f"{MARIADB_WRITERS} on MariaDB, whose one session syncs the log at every commit)",
    )
    parser.add_argument(
        "--precision",
        type=int,
        choices=range(7),
        help="MariaDB polling source: MariaDbHorizon(precision=N) instead of auto (precision "
        "0, which withholds a busy table's rows of the current second: every writer of "
        "the table uses NOW(6) here, so 6 is safe)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.rates = args.rates or ("200" if quick else "200,2000")
    args.seconds = args.seconds or (3.0 if quick else 20.0)
    args.interval = args.interval if args.interval is not None else (0.5 if quick else 5.0)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.writer_connections is not None and args.writer_connections < 1:
        parser.error("--writer-connections must be at least 1")
    if args.seed is None:
        args.seed = random.randrange(10**6)  # printed: a run can be repeated
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        model(args)
        return 0
    rates = [float(r) for r in str_list(args.rates)]
    hints = str_list(args.hints)
    unknown = [h for h in hints if h not in HINTS]
    if unknown:
        raise SystemExit(f"unknown hint {unknown[0]!r} ({', '.join(HINTS)})")
    results: list[Result] = []
    for kind in str_list(args.dbs):
        db = create_database(kind)
        try:
            for source_kind in str_list(args.sources):
                for hint in hints:
                    if hint in PG_ONLY and kind != "postgresql":
                        continue
                    for rate in rates:
                        pooled: Result | None = None
                        for run in range(args.repeats):
                            print(
                                f"# {kind} {source_kind} hint={hint} rate={rate:g}/s "
                                f"run {run + 1}/{args.repeats}",
                                flush=True,
                            )
                            one = measure(db, source_kind, hint, rate, args, run)
                            if pooled is None:
                                pooled = one
                            else:
                                pooled.pool(one)
                        assert pooled is not None  # repeats >= 1
                        results.append(pooled)
        finally:
            drop_database(db)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
