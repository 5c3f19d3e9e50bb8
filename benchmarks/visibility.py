"""Rows lost and visibility delay under concurrent late commits, per guard.

Runs one write workload per database and polls it with several sources side by
side: no protection, the safety window, and (PostgreSQL) both horizons. Every
poller is a real PollTrigger ticking in its own thread like a runner would
(tick, and wait ``--interval`` when a tick is idle). Writers record when each
transaction's commit returned; handlers record when each row first arrived.

    python benchmarks/visibility.py                  # PostgreSQL and MariaDB, 10 s each
    python benchmarks/visibility.py --seconds 20 --skip-mariadb

Printed per source: committed rows, rows lost (committed, never delivered after
a final drain), and the visibility delay commit -> handler (p50/p95/max). Each
database gets a throw-away database of its own, so only this workload's
transactions can hold a horizon back.

Three workload profiles run one after the other: ``short`` (every transaction
commits within 20 ms of writing), ``long`` (5 % of transactions stay open
0.5-2 s after writing; with 8 writers one of them is open most of the time)
and ``8-12s`` (one writer in four holds every transaction 8-12 s, longer than
the 5 s safety window). In all, ``--writers`` connections insert 1-3 rows per
transaction, 10 % roll back, and a straggler transaction writes first and
commits after 1.5 s, so an unguarded poller has every chance to move past it.

Then the guard's cost: a catch-up of ``--cost-rows`` rows at batch 1000 per
database, each guard next to ``visibility="none"`` in the same run (best of
``--cost-repeats``), with the statements each fetch costs.

    python benchmarks/visibility.py --cost-only      # just the cost table
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cursor import BEGINNING
from dbtrigger.sources.visibility import SafetyWindow, install_visibility_trigger

PG_URL = os.environ.get(
    "DBTRIGGER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get(
    "DBTRIGGER_TEST_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)


@dataclass
class Poller:
    label: str
    cursor: str
    source: SqlAlchemySource
    trigger: PollTrigger
    interval: float
    arrived: dict[int, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    max_held_back: float = 0.0

    def handle(self, events: list[RowChange]) -> None:
        now = time.time()
        for event in events:
            self.arrived.setdefault(event.pk["id"], now)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rows = self.trigger.tick(self.handle)
            except Exception as exc:
                self.errors.append(exc)
                return
            info = self.source.last_fetch_info
            if info is not None:
                self.max_held_back = max(self.max_held_back, info.held_back_seconds)
            if rows == 0:
                self.stop.wait(self.interval)


@dataclass
class Writers:
    engine: sa.Engine
    insert_sql: str
    writers: int
    seconds: float
    long_fraction: float
    long_writers: tuple[float, float] | None = None  # every 4th writer holds this long
    seed: int = 1
    committed: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    errors: list[BaseException] = field(default_factory=list)

    def straggler(self, hold: float) -> None:
        with self.engine.connect() as conn:
            trans = conn.begin()
            row_id = conn.execute(sa.text(self.insert_sql), {"w": -1}).scalar_one()
            time.sleep(hold)
            trans.commit()
            with self.lock:
                self.committed[row_id] = time.time()

    def writer(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        deadline = time.monotonic() + self.seconds
        try:
            with self.engine.connect() as conn:
                while time.monotonic() < deadline:
                    trans = conn.begin()
                    ids = [
                        conn.execute(sa.text(self.insert_sql), {"w": index}).scalar_one()
                        for _ in range(rng.randint(1, 3))
                    ]
                    roll = rng.random()
                    long = roll < self.long_fraction
                    if self.long_writers is not None and index % 4 == 0:
                        time.sleep(rng.uniform(*self.long_writers))
                    else:
                        time.sleep(rng.uniform(0.5, 2.0) if long else rng.uniform(0, 0.02))
                    if roll > 0.90:
                        trans.rollback()
                        continue
                    trans.commit()
                    done = time.time()
                    with self.lock:
                        self.committed.update(dict.fromkeys(ids, done))
        except Exception as exc:
            self.errors.append(exc)

    def run(self) -> None:
        threads = [threading.Thread(target=self.straggler, args=(1.5,))]
        time.sleep(0.05)
        threads += [threading.Thread(target=self.writer, args=(i,)) for i in range(self.writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    url: str,
    insert_sql: str,
    sources: list[tuple[str, str, Any]],
    args: argparse.Namespace,
    settle: float,
    profile: Profile,
) -> list[dict[str, Any]]:
    engine = sa.create_engine(url, pool_size=args.writers + 4)
    pollers: list[Poller] = []
    for label, cursor, visibility in sources:
        source = SqlAlchemySource(
            url=url, table="events", cursor_column=cursor, pk_columns=["id"], visibility=visibility
        )
        trigger = PollTrigger(
            name=label.replace(" ", "_").replace("(", "").replace(")", ""),
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            batch_size=100,
            max_batches_per_tick=10,
        )
        pollers.append(Poller(label, cursor, source, trigger, args.interval))
    threads = [threading.Thread(target=p.run, daemon=True) for p in pollers]
    for t in threads:
        t.start()
    writers = Writers(
        engine, insert_sql, args.writers, args.seconds, profile.long_fraction, profile.long_writers
    )
    writers.run()
    time.sleep(settle)  # let every guard release the last commits
    for p in pollers:
        p.stop.set()
    for t in threads:
        t.join()
    results = []
    for p in pollers:
        if p.errors:
            raise p.errors[0]
        p.trigger.drain(p.handle)  # anything still pending is delivered now, or lost
        delays = [
            max(0.0, p.arrived[i] - at) * 1000
            for i, at in writers.committed.items()
            if i in p.arrived
        ]
        results.append(
            {
                "source": p.label,
                "cursor": p.cursor,
                "mode": p.source.visibility_mode,
                "committed": len(writers.committed),
                "lost": sum(1 for i in writers.committed if i not in p.arrived),
                "p50": statistics.median(delays) if delays else float("nan"),
                "p95": percentile(delays, 0.95),
                "max": max(delays) if delays else float("nan"),
                "held": p.max_held_back,
            }
        )
        p.source.close()
    engine.dispose()
    return results


@dataclass(frozen=True)
class Profile:
    name: str
    long_fraction: float
    long_writers: tuple[float, float] | None = None


PROFILES = (
    Profile("short", 0.0),
    Profile("long", 0.05),
    Profile("8-12s", 0.0, (8.0, 12.0)),
)


def postgresql(args: argparse.Namespace, profile: Profile) -> list[dict[str, Any]]:
    admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
    name = f"bench_vis_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(args.pg_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE events (id bigserial PRIMARY KEY, "
                "updated_at timestamptz NOT NULL DEFAULT now(), writer int NOT NULL);"
                "CREATE INDEX ON events (updated_at, id)"
            )
        install_visibility_trigger(engine, "events", index_columns=["id"])
        engine.dispose()
        sources = [
            ("none", "updated_at", "none"),
            ("none (xid)", "dbtrigger_xid", "none"),
            ("safety window 5s", "updated_at", SafetyWindow(5.0)),
            ("transaction horizon", "updated_at", "auto"),
            ("snapshot horizon", "dbtrigger_xid", "auto"),
        ]
        insert = "INSERT INTO events (writer) VALUES (:w) RETURNING id"
        return measure(url, insert, sources, args, settle=6, profile=profile)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def mariadb(args: argparse.Namespace, profile: Profile) -> list[dict[str, Any]]:
    admin = sa.create_engine(args.mariadb_url, isolation_level="AUTOCOMMIT")
    name = f"bench_vis_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}`"))
    url = sa.make_url(args.mariadb_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE events (id BIGINT PRIMARY KEY DEFAULT (UUID_SHORT()), "
                "seq BIGINT NOT NULL AUTO_INCREMENT, "
                "updated_at DATETIME(6) NOT NULL DEFAULT NOW(6), writer INT NOT NULL, "
                "KEY ix_events_updated_at_id (updated_at, id), KEY ix_events_seq_id (seq, id))"
            )
        engine.dispose()
        sources = [
            ("none", "updated_at", "none"),
            ("safety window 5s", "updated_at", SafetyWindow(5.0)),
            ("transaction horizon", "updated_at", "auto"),
            ("transaction horizon", "seq", "auto"),
        ]
        insert = "INSERT INTO events (writer) VALUES (:w) RETURNING id"
        return measure(url, insert, sources, args, settle=6, profile=profile)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="write phase per database")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.1, help="idle wait between ticks")
    parser.add_argument("--pg-url", default=PG_URL)
    parser.add_argument("--mariadb-url", default=MARIADB_URL)
    parser.add_argument("--skip-postgresql", action="store_true")
    parser.add_argument("--skip-mariadb", action="store_true")
    parser.add_argument(
        "--profiles", default=",".join(p.name for p in PROFILES), help="comma-separated"
    )
    parser.add_argument("--cost-rows", type=int, default=100_000)
    parser.add_argument("--cost-repeats", type=int, default=5)
    parser.add_argument("--cost-only", action="store_true", help="skip the workloads")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args(argv)
    if not args.cost_only:
        workloads(args)
    if not args.skip_cost:
        costs(args)
    return 0


def workloads(args: argparse.Namespace) -> None:
    wanted = set(args.profiles.split(","))
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for profile in PROFILES:
        if profile.name not in wanted:
            continue
        if not args.skip_postgresql:
            rows += [("postgresql", profile.name, r) for r in postgresql(args, profile)]
        if not args.skip_mariadb:
            rows += [("mariadb", profile.name, r) for r in mariadb(args, profile)]
    print(
        f"{args.writers} writers, {args.seconds:g}s of writes per database, "
        f"idle poll interval {args.interval:g}s; delay = commit returned -> handler called"
    )
    header = (
        f"{'database':<11} {'profile':<7} {'source':<24} {'cursor':<13} {'mode':<22} "
        f"{'committed':>9} {'lost':>5} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'max held s':>10}"
    )
    print(header)
    print("-" * len(header))
    for database, profile, r in rows:
        print(
            f"{database:<11} {profile:<7} {r['source']:<24} {r['cursor']:<13} {r['mode']:<22} "
            f"{r['committed']:>9} {r['lost']:>5} {r['p50']:>8.0f} {r['p95']:>8.0f} "
            f"{r['max']:>8.0f} {r['held']:>10.1f}"
        )
    print()


# --- the guard's cost: a catch-up at batch 1000, next to visibility="none" -----------

#: database, label, cursor, mode, (rows/s, cpu rows/s, statements/fetch), the same
#: run's visibility="none" (rows/s, cpu rows/s)
CostRow = tuple[str, str, str, str, tuple[float, float, float], tuple[float, float]]


def drain_rate(
    url: str, cursor: str, visibility: Any, rows: int, modes: dict[str, str] | None = None
) -> tuple[float, float, float]:
    """A PollTrigger catch-up of a static table: rows/s (wall, client CPU), statements/fetch."""
    source = SqlAlchemySource(
        url=url, table="events", cursor_column=cursor, pk_columns=["id"], visibility=visibility
    )
    statements = [0]
    fetches = [0]

    def count(*_: Any) -> None:
        statements[0] += 1

    sa.event.listen(source.engine, "before_cursor_execute", count)
    source.fetch(BEGINNING, 1)  # connect, reflect, decide auto: not part of the catch-up
    statements[0] = 0
    trigger = PollTrigger(
        name="cost",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=1000,
        max_batches_per_tick=1_000_000,
    )
    seen = [0]

    def handle(events: list[RowChange]) -> None:
        fetches[0] += 1
        for event in events:  # what a real handler reads: the key and a column
            seen[0] += event.pk["id"] is not None and event.after["writer"] is not None

    started, cpu = time.perf_counter(), time.process_time()
    deadline = time.monotonic() + 60
    while seen[0] < rows and time.monotonic() < deadline:
        if trigger.tick(handle) == 0:
            time.sleep(0.05)  # a guard waits for another session's transaction
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    if modes is not None:
        modes[cursor + repr(visibility)] = source.visibility_mode
    source.close()
    if seen[0] != rows:
        raise SystemExit(f"cost run delivered {seen[0]} of {rows} rows ({url}, {cursor})")
    return rows / elapsed, rows / cpu, statements[0] / max(1, fetches[0] + 1)


def costs(args: argparse.Namespace) -> None:
    results: list[CostRow] = []
    if not args.skip_postgresql:
        results += cost_postgresql(args)
    if not args.skip_mariadb:
        results += cost_mariadb(args)
    print(
        f"guard cost: catch-up of {args.cost_rows} rows, batch 1000, in-memory store, median of "
        f"{args.cost_repeats} interleaved rounds; cpu = rows per second of client CPU time; "
        "statements/fetch counts every statement the source ran"
    )
    header = (
        f"{'database':<11} {'source':<18} {'cursor':<11} {'mode':<20} {'rows/s':>9} "
        f"{'vs none':>8} {'cpu rows/s':>10} {'vs none':>8} {'stmts/fetch':>11}"
    )
    print(header)
    print("-" * len(header))
    for database, label, cursor, mode, (rate, cpu, per_fetch), (base, cpu_base) in results:
        print(
            f"{database:<11} {label:<18} {cursor:<11} {mode:<20} {rate:>9,.0f} "
            f"{rate / base:>8.2f} {cpu:>10,.0f} {cpu / cpu_base:>8.2f} {per_fetch:>11.2f}"
        )


def best_rates(
    url: str, contenders: list[tuple[str, str, Any]], args: argparse.Namespace
) -> list[tuple[str, str, str, tuple[float, float, float]]]:
    """Each contender's median over the rounds, interleaved so load drifts hit all."""
    runs: dict[int, list[tuple[float, float, float]]] = {}
    modes: dict[str, str] = {}
    for _ in range(args.cost_repeats):
        for index, (_label, cursor, visibility) in enumerate(contenders):
            rates = drain_rate(url, cursor, visibility, args.cost_rows, modes)
            runs.setdefault(index, []).append(rates)
    out = []
    for index, (label, cursor, visibility) in enumerate(contenders):
        values = runs[index]
        med = tuple(statistics.median(v[k] for v in values) for k in range(3))
        out.append((label, cursor, modes[cursor + repr(visibility)], med))
    return out  # type: ignore[return-value]


def _with_base(
    database: str, rows: list[tuple[str, str, str, tuple[float, float, float]]]
) -> list[CostRow]:
    base = rows[0][3]
    return [(database, label, c, m, v, (base[0], base[1])) for label, c, m, v in rows]


def cost_postgresql(
    args: argparse.Namespace,
) -> list[CostRow]:
    admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
    name = f"bench_vis_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(args.pg_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE events (id bigserial PRIMARY KEY, "
                "updated_at timestamptz NOT NULL DEFAULT now(), writer int NOT NULL);"
                "CREATE INDEX ON events (updated_at, id)"
            )
            conn.execute(
                sa.text(
                    "INSERT INTO events (updated_at, writer) SELECT now() - interval '1 hour' "
                    "+ i * interval '1 microsecond', i FROM generate_series(1, :n) AS i"
                ),
                {"n": args.cost_rows},
            )
            conn.exec_driver_sql("ANALYZE events")
        engine.dispose()
        contenders = [
            ("none", "updated_at", "none"),
            ("auto", "updated_at", "auto"),
        ]
        return _with_base("postgresql", best_rates(url, contenders, args))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def cost_mariadb(args: argparse.Namespace) -> list[CostRow]:
    admin = sa.create_engine(args.mariadb_url, isolation_level="AUTOCOMMIT")
    name = f"bench_vis_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}`"))
    url = sa.make_url(args.mariadb_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE events (id BIGINT PRIMARY KEY, "
                "seq BIGINT NOT NULL AUTO_INCREMENT, "
                "updated_at DATETIME(6) NOT NULL DEFAULT NOW(6), writer INT NOT NULL, "
                "KEY ix_events_updated_at_id (updated_at, id), KEY ix_events_seq_id (seq, id))"
            )
            conn.execute(
                sa.text(
                    "INSERT INTO events (id, updated_at, writer) SELECT seq, "
                    "NOW(6) - INTERVAL 1 HOUR + INTERVAL seq MICROSECOND, seq "
                    "FROM seq_1_to_{n}".replace("{n}", str(int(args.cost_rows)))
                )
            )
        engine.dispose()
        contenders = [
            ("none", "updated_at", "none"),
            ("auto", "updated_at", "auto"),
            ("auto", "seq", "auto"),
            ("safety window 5s", "updated_at", SafetyWindow(5.0)),
        ]
        return _with_base("mariadb", best_rates(url, contenders, args))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


if __name__ == "__main__":
    sys.exit(main())
