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

Two workload profiles run one after the other: ``short`` (every transaction
commits within 20 ms of writing) and ``long`` (5 % of transactions stay open
0.5-2 s after writing; with 8 writers one of them is open most of the time).
In both, ``--writers`` connections insert 1-3 rows per transaction, 10 % roll
back, and a straggler transaction writes first and commits after 1.5 s, so an
unguarded poller has every chance to move past it.
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
    long_fraction: float,
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
    writers = Writers(engine, insert_sql, args.writers, args.seconds, long_fraction)
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


PROFILES = (("short", 0.0), ("long", 0.05))


def postgresql(args: argparse.Namespace, long_fraction: float) -> list[dict[str, Any]]:
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
        return measure(url, insert, sources, args, settle=6, long_fraction=long_fraction)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def mariadb(args: argparse.Namespace, long_fraction: float) -> list[dict[str, Any]]:
    admin = sa.create_engine(args.mariadb_url, isolation_level="AUTOCOMMIT")
    name = f"bench_vis_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}`"))
    url = sa.make_url(args.mariadb_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE events (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
                "updated_at DATETIME(6) NOT NULL DEFAULT NOW(6), writer INT NOT NULL, "
                "KEY ix_events_updated_at_id (updated_at, id))"
            )
        engine.dispose()
        sources = [
            ("none", "updated_at", "none"),
            ("safety window 5s (auto)", "updated_at", "auto"),
        ]
        insert = "INSERT INTO events (writer) VALUES (:w) RETURNING id"
        return measure(url, insert, sources, args, settle=6, long_fraction=long_fraction)
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
    args = parser.parse_args(argv)
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for profile, long_fraction in PROFILES:
        if not args.skip_postgresql:
            rows += [("postgresql", profile, r) for r in postgresql(args, long_fraction)]
        if not args.skip_mariadb:
            rows += [("mariadb", profile, r) for r in mariadb(args, long_fraction)]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
