"""MariaDB transaction horizon with many guarded pollers on one server.

InnoDB refreshes ``information_schema.INNODB_TRX`` only when nobody has read it
for 100 ms, server-wide, and the guard uses an observation only once it has
proof that the cache was filled after its own process-list read. Several guards
polling one server read it often enough between them to keep it stale for all.
This script measures what that costs: ``N`` guarded pollers (default settings,
``visibility="auto"``, one thread and one connection each, the way ``N``
workers would) and one writer committing a row every ``--gap`` seconds; for
each row and poller, the delay from the commit returning to the handler.

    python -m benchmarks.guard_contention                      # 1, 4, 16, 32 pollers
    python -m benchmarks.guard_contention --pollers 16 --rows 20 --interval 1

Printed per poller count: rows written, (poller, row) pairs delivered within
``--timeout`` of the last commit, delay p50/p95/max, the guard's fresh
observations per poller per second, its failed observations (no proof of a
fresh cache: it kept its old bound) per poller per second, its reads that
found the cache not refilled (``-`` on a version that does not count them),
client CPU seconds and the 1-minute load average after the run. A throw-away
database of its own on the server (``DBTRIGGER_BENCH_MARIADB_URL``, default
the test server on 127.0.0.1:3306). ``--db postgresql`` runs the same on
PostgreSQL's transaction horizon (a database of its own, ``DBTRIGGER_BENCH_PG_URL``),
which reads no cache; only the MariaDB guard counts failed observations.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource

MARIADB_URL = os.environ.get(
    "DBTRIGGER_BENCH_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)
PG_URL = os.environ.get(
    "DBTRIGGER_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
TABLES = {
    "mariadb": (
        "CREATE TABLE events (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), "
        "KEY ix_events_updated_at_id (updated_at, id))"
    ),
    "postgresql": (
        "CREATE TABLE events (id bigserial PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT clock_timestamp()); "
        "CREATE INDEX ix_events_updated_at_id ON events (updated_at, id)"
    ),
}


@dataclass
class Poller:
    source: SqlAlchemySource
    trigger: PollTrigger
    interval: float
    arrived: dict[int, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)

    def handle(self, events: list[RowChange]) -> None:
        now = time.time()
        for event in events:
            self.arrived.setdefault(int(event.pk["id"]), now)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rows = self.trigger.tick(self.handle)
            except Exception as exc:
                self.errors.append(exc)
                return
            if rows == 0:
                self.stop.wait(self.interval)

    failed: int = 0  # observations without a fresh cache (versions without the counter)

    def guard_state(self) -> Any:
        active = self.source._guarding.active  # the benchmark reads the guard's counters
        return None if active is None else getattr(active, "_state", None)

    def failed_observations(self) -> int:
        state = self.guard_state()
        return int(getattr(state, "stale_observations", self.failed))

    def count_failures(self) -> None:
        """On a version whose guard has no counter (``_observe`` returns None for
        a stale cache), count by wrapping it."""
        active = self.source._guarding.active
        observe = getattr(active, "_observe", None)
        if observe is None or hasattr(self.guard_state(), "stale_observations"):
            return

        def counted(*args: Any) -> Any:
            result = observe(*args)
            self.failed += result is None
            return result

        active._observe = counted  # type: ignore[union-attr]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def wait(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def measure(url: str, pollers_count: int, args: argparse.Namespace) -> dict[str, Any]:
    table = "events"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for ddl in TABLES[args.db].split("; "):
            conn.exec_driver_sql(ddl)
    pollers = []
    for index in range(pollers_count):
        source = SqlAlchemySource(
            url=url, table=table, cursor_column=args.cursor, pk_columns=["id"]
        )
        trigger = PollTrigger(
            name=f"p{index}", source=source, checkpoint_store=InMemoryCheckpointStore()
        )
        pollers.append(Poller(source, trigger, args.interval))
    threads = [threading.Thread(target=p.run, daemon=True) for p in pollers]
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    # Every guard active (its first fetch made) before the first row is written.
    wait(lambda: all(p.source._guarding.active is not None for p in pollers), args.timeout)
    for p in pollers:
        p.count_failures()
    started = time.monotonic()
    fresh0 = [getattr(p.guard_state(), "observations", 0) for p in pollers]
    failed0 = [p.failed_observations() for p in pollers]
    committed: dict[int, float] = {}
    with engine.connect() as conn:
        for _ in range(args.rows):
            row_id = conn.execute(
                sa.text(f"INSERT INTO {table} (updated_at) VALUES (DEFAULT) RETURNING id")
            ).scalar_one()
            conn.commit()
            committed[int(row_id)] = time.time()
            time.sleep(args.gap)
    everyone = wait(lambda: all(set(committed) <= set(p.arrived) for p in pollers), args.timeout)
    elapsed = time.monotonic() - started
    for p in pollers:
        p.stop.set()
    for t in threads:
        t.join(timeout=30)
    cpu = time.process_time() - cpu0
    errors = [e for p in pollers for e in p.errors]
    if errors:
        raise errors[0]
    delays = [p.arrived[i] - at for p in pollers for i, at in committed.items() if i in p.arrived]
    states = [p.guard_state() for p in pollers]
    fresh = [getattr(s, "observations", 0) - f0 for s, f0 in zip(states, fresh0, strict=True)]
    stale = [getattr(s, "stale_reads", None) for s in states]
    failed = [p.failed_observations() - f0 for p, f0 in zip(pollers, failed0, strict=True)]
    for p in pollers:
        p.source.close()
    engine.dispose()
    return {
        "pollers": pollers_count,
        "rows": len(committed),
        "pairs": len(committed) * pollers_count,
        "delivered": len(delays),
        "all": everyone,
        "p50": percentile(delays, 0.5),
        "p95": percentile(delays, 0.95),
        "max": max(delays, default=float("nan")),
        "fresh_per_s": f"{sum(fresh) / len(fresh) / elapsed:.2f}" if args.db == "mariadb" else "-",
        "failed": f"{sum(failed) / len(failed) / elapsed:.2f}" if args.db == "mariadb" else "-",
        "stale": "-" if None in stale else sum(stale) // len(stale),
        "cpu": cpu,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pollers", default="1,4,16,32", help="poller counts, comma-separated")
    parser.add_argument("--rows", type=int, default=10, help="rows written per poller count")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between two commits")
    parser.add_argument("--interval", type=float, default=0.1, help="idle wait between ticks")
    parser.add_argument("--cursor", default="updated_at", choices=["updated_at", "id"])
    parser.add_argument("--timeout", type=float, default=60.0, help="bound after the last commit")
    parser.add_argument("--db", default="mariadb", choices=sorted(TABLES))
    parser.add_argument("--quick", action="store_true", help="2 and 4 pollers, 3 rows")
    args = parser.parse_args()
    if args.quick:
        args.pollers, args.rows, args.timeout = "2,4", 3, 30.0
    admin = sa.create_engine(
        MARIADB_URL if args.db == "mariadb" else PG_URL, isolation_level="AUTOCOMMIT"
    )
    print(
        f"guarded pollers on one {args.db} server: visibility auto, cursor {args.cursor}, "
        f"idle interval {args.interval}s, a commit every {args.gap}s; "
        "delay = commit returned -> handler called"
    )
    header = (
        f"{'pollers':>7} {'rows':>4} {'delivered':>11} {'p50 s':>7} {'p95 s':>7} {'max s':>7} "
        f"{'fresh/s/poller':>14} {'failed/s/poller':>15} {'stale reads/poller':>18} "
        f"{'cpu s':>6} {'load1':>5}"
    )
    print(header)
    print("-" * len(header))
    for count in (int(n) for n in args.pollers.split(",")):
        name = f"dbtrigger_gc_{uuid.uuid4().hex[:10]}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        url = admin.url.set(database=name).render_as_string(hide_password=False)
        try:
            r = measure(url, count, args)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        delivered = f"{r['delivered']}/{r['pairs']}"
        print(
            f"{r['pollers']:>7} {r['rows']:>4} {delivered:>11} {r['p50']:>7.2f} {r['p95']:>7.2f} "
            f"{r['max']:>7.2f} {r['fresh_per_s']:>14} {r['failed']:>15} "
            f"{r['stale']!s:>18} {r['cpu']:>6.1f} "
            f"{r['load']:>5.2f}",
            flush=True,
        )
    admin.dispose()


if __name__ == "__main__":
    main()
