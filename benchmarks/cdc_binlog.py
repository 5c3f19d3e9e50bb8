"""BinlogSource next to cursor polling on the same MariaDB tables: latency, replay rate, memory.

The three measurements of ``benchmarks/cdc_pg.py``, with the same output shape,
each printed beside the polling source (``SqlAlchemySource`` on an
``updated_at`` cursor) measured in the same run:

* **commit -> handler latency** at a steady 200 events/s (one row per
  transaction, written by a thread): the handler's clock minus the row's
  ``updated_at`` (``NOW(6)`` at the insert; the binlog's own event times have
  whole seconds only). Pollers run as ``dbtrigger run`` does: tick, and sleep
  ``interval`` after an idle tick. Target: p99 <= interval + 100 ms.
* **backlog replay**: events/s draining a backlog already in the binlog
  (``--rows`` rows in 1,000-row transactions), batch sizes 100 and 1,000,
  in-memory state store. Target >= 5k events/s.
* **client memory during one large transaction** (``--big`` rows in a single
  ``INSERT``), in a fresh interpreter: peak RSS and its growth. Target <= 80 MB.

A private MariaDB with a ROW binary log is started from the installed server
binaries (``scripts/cdc-servers.sh start mariadb``) and stopped at the end,
unless ``--url`` names one.

    python -m benchmarks.cdc_binlog           # 15 s latency runs, 200k-row replay, 100k-row txn
    python -m benchmarks.cdc_binlog --quick   # a short smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pymysql
from sqlalchemy.engine import make_url

from benchmarks.cdc_pg import run_worker, unique
from benchmarks.common import ROOT, int_list, percentile, print_table, rss_mb
from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cdc import BinlogSource
from dbtrigger.cdc import binlog_setup as setup

SCRIPT = ROOT / "scripts" / "cdc-servers.sh"


@contextmanager
def private_server(port: int) -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="dbtrigger-bench-binlog-")
    bash = shutil.which("bash") or "/bin/bash"
    subprocess.run(  # noqa: S603 - our own script
        [bash, str(SCRIPT), "start", "mariadb", directory, str(port)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield f"mysql+pymysql://root@127.0.0.1:{port}/mysql"
    finally:
        subprocess.run([bash, str(SCRIPT), "stop", "mariadb", directory], check=False)  # noqa: S603
        shutil.rmtree(directory, ignore_errors=True)


def connect(url: str) -> pymysql.connections.Connection[Any]:
    u = make_url(url)
    return pymysql.connect(
        host=u.host,
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        database=u.database,
        autocommit=True,
    )


def fresh_database(url: str) -> str:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    conn = connect(url)
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}`")
    conn.close()
    return url.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    conn = connect(url.rsplit("/", 1)[0] + "/mysql")
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    conn.close()


def execute(url: str, *statements: str) -> None:
    conn = connect(url)
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
    conn.close()


def polling_source(url: str, table: str) -> SqlAlchemySource:
    return SqlAlchemySource(url=url, table=table, cursor_column="updated_at", pk_columns=["id"])


def make_source(kind: str, url: str, table: str) -> Any:
    if kind == "polling":
        return polling_source(url, table)
    return BinlogSource(url, [table], snapshot="never")


# --- latency -------------------------------------------------------------------------------


def writer(url: str, table: str, rate: float, seconds: float, stop: threading.Event) -> int:
    written = 0
    conn = connect(url)
    start = time.monotonic()
    with conn.cursor() as cur:
        while not stop.is_set():
            due = start + written / rate
            now = time.monotonic()
            if now - start >= seconds:
                break
            if due > now:
                time.sleep(due - now)
            cur.execute(f"INSERT INTO {table} (v) VALUES (%s)", (written,))
            written += 1
    conn.close()
    return written


def latency(url: str, kind: str, interval: float, seconds: float, rate: float) -> dict[str, Any]:
    db = fresh_database(url)
    table = "lat"
    execute(
        db,
        f"CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, v INT, "
        "updated_at DATETIME(6) NOT NULL DEFAULT NOW(6), KEY (updated_at, id))",
    )
    source = make_source(kind, db, table)
    trigger = PollTrigger(
        name=unique(f"lat_{kind}"),
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=500,
        max_batches_per_tick=10,
    )
    trigger.tick(lambda events: None)  # set up (the reader's row) before the clock starts
    samples: list[float] = []

    def handle(events: list[RowChange]) -> None:
        now = dt.datetime.now()  # the server's NOW(6) is local time, naive; same machine
        for e in events:
            at = (e.after or {}).get("updated_at") if kind != "polling" else e.cursor
            samples.append((now - at).total_seconds())

    stop = threading.Event()
    done = threading.Event()
    written: list[int] = []

    def write() -> None:
        written.append(writer(db, table, rate, seconds, stop))
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    run_worker(trigger, handle, interval, lambda: done.is_set() and len(samples) >= written[0])
    thread.join()
    source.close()
    drop_database(db)
    return {
        "events": len(samples),
        "p50_ms": percentile(samples, 0.5) * 1000,
        "p99_ms": percentile(samples, 0.99) * 1000,
    }


# --- backlog replay ------------------------------------------------------------------------


def replay(url: str, kind: str, rows: int, batch: int) -> dict[str, Any]:
    db = fresh_database(url)
    table = "backlog"
    execute(
        db,
        f"CREATE TABLE {table} (id BIGINT PRIMARY KEY, v INT NOT NULL, payload TEXT NOT NULL, "
        "updated_at DATETIME(6) NOT NULL, KEY (updated_at, id))",
    )
    source = make_source(kind, db, table)
    trigger = PollTrigger(
        name=unique(f"replay_{kind}"),
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=batch,
        max_batches_per_tick=100,
    )
    trigger.tick(lambda events: None)
    for first in range(0, rows, 1000):
        last = min(rows, first + 1000)
        execute(
            db,
            f"INSERT INTO {table} SELECT seq, seq % 97, CONCAT('payload ', seq), "
            f"TIMESTAMP('2026-01-01') + INTERVAL seq * 1000 MICROSECOND "
            f"FROM seq_{first + 1}_to_{last}",
        )
    seen = 0

    def handle(events: list[RowChange]) -> None:
        nonlocal seen
        for e in events:
            e.pk["id"]  # read what a handler reads
            e.after["v"]  # type: ignore[index]
        seen += len(events)

    started = time.perf_counter()
    while seen < rows:
        trigger.tick(handle)
    elapsed = time.perf_counter() - started
    source.close()
    drop_database(db)
    return {"events_per_s": rows / elapsed, "seconds": elapsed}


# --- the look-ahead without names in the log -------------------------------------------------


def log_end(url: str) -> tuple[str, int]:
    conn = connect(url)
    with conn.cursor() as cur:
        cur.execute("SHOW MASTER STATUS")
        row = cur.fetchone()
    conn.close()
    assert row is not None
    return str(row[0]), int(row[1])


@contextmanager
def names_from_catalog(on: bool) -> Iterator[None]:
    """The source takes the server for one without names in the log (as with
    ``binlog_row_metadata`` MINIMAL, MariaDB's default): it names values from the
    catalog and runs the look-ahead; the log read is the same."""
    facts = setup.ServerFacts
    saved = facts.__dict__["names_from_log"]
    if on:
        facts.names_from_log = property(lambda _: False)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        facts.names_from_log = saved  # type: ignore[method-assign]


def lookahead(url: str, rows: int, flushes: int, batch: int, txn_rows: int) -> list[dict[str, Any]]:
    """Drain one backlog of ``rows`` (``txn_rows``-row transactions, a ``FLUSH TABLES`` every
    ``rows / flushes`` rows: each gives the table a new map id, which the look-ahead
    is asked about) twice: with names from the log, then from the catalog."""
    db = fresh_database(url)
    table = "ahead"
    execute(db, f"CREATE TABLE {table} (id BIGINT PRIMARY KEY, v INT NOT NULL, p TEXT NOT NULL)")
    triggers = {}
    for catalog in (False, True):
        with names_from_catalog(catalog):
            source = BinlogSource(db, [table], snapshot="never")
            triggers[catalog] = PollTrigger(
                name=unique(f"ahead_{int(catalog)}"),
                source=source,
                checkpoint_store=InMemoryCheckpointStore(),
                batch_size=batch,
                max_batches_per_tick=100,
            )
            triggers[catalog].tick(lambda events: None)  # set up before the backlog
    start = log_end(url)
    every = max(txn_rows, rows // max(1, flushes))
    conn = connect(db)
    with conn.cursor() as cur:
        for first in range(0, rows, txn_rows):  # autocommit: a transaction each
            last = min(rows, first + txn_rows)
            cur.execute(
                f"INSERT INTO {table} SELECT seq, seq % 97, REPEAT('x', 200) "
                f"FROM seq_{first + 1}_to_{last}",
            )
            if last // every != first // every and last < rows:
                cur.execute(f"FLUSH TABLES {table}")
    conn.close()
    end = log_end(url)
    size = end[1] - start[1] if end[0] == start[0] else float("nan")
    out = []
    for catalog, trigger in triggers.items():
        seen = 0

        def handle(events: list[RowChange]) -> None:
            nonlocal seen
            seen += len(events)

        with names_from_catalog(catalog):
            started = time.perf_counter()
            while seen < rows:
                trigger.tick(handle)
            elapsed = time.perf_counter() - started
        done = trigger.source
        ahead = getattr(getattr(done, "_assembler", None), "ahead", None)
        scanned = getattr(getattr(ahead, "statements", None), "bytes_read", None)
        done.close()
        out.append(
            {
                "catalog": catalog,
                "events_per_s": rows / elapsed,
                "seconds": elapsed,
                "log_mb": size / 2**20,
                "scanned_mb": None if scanned is None else scanned / 2**20,
            }
        )
    drop_database(db)
    return out


def report_lookahead(args: argparse.Namespace, url: str) -> None:
    table_rows = []
    for rows in args.rows:
        for result in lookahead(url, rows, args.flushes, 1000, args.txn_rows):
            scanned = result["scanned_mb"]
            table_rows.append(
                [
                    "catalog + look-ahead" if result["catalog"] else "names in the log",
                    rows,
                    f"{result['log_mb']:.1f}",
                    args.flushes,
                    f"{result['events_per_s']:,.0f}",
                    f"{result['seconds']:.1f}",
                    "-" if scanned is None else f"{scanned:.1f}",
                ]
            )
    print_table(
        f"backlog drain without names in the log ({args.txn_rows}-row transactions, "
        "batch_size 1000, a FLUSH TABLES every rows/flushes rows: a new table map id each)",
        ["names", "events", "log MB", "flushes", "events/s", "seconds", "looked-ahead MB"],
        table_rows,
        left=1,
    )


# --- memory during one large transaction ------------------------------------------------------


def memory_child(url: str, rows: int, history: bool = True) -> dict[str, Any]:
    db = fresh_database(url)
    execute(db, "CREATE TABLE big (id BIGINT PRIMARY KEY, v INT NOT NULL, payload TEXT)")
    source = BinlogSource(db, ["big"], snapshot="never")
    trigger = PollTrigger(
        name=unique("big"),
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=1000,
        max_batches_per_tick=100,
        history=history,
    )
    trigger.tick(lambda events: None)
    execute(db, f"INSERT INTO big SELECT seq, seq, REPEAT('p', 40) FROM seq_1_to_{rows}")
    before, _ = rss_mb()
    seen = 0

    def handle(events: list[RowChange]) -> None:
        nonlocal seen
        seen += len(events)

    while seen < rows:
        trigger.tick(handle)
    _, peak = rss_mb()
    source.close()
    drop_database(db)
    return {"before": before, "peak": peak}


def memory(url: str, rows: int, history: bool = True) -> dict[str, Any]:
    done = subprocess.run(  # noqa: S603 - this very script, as a child
        [
            sys.executable,
            "-m",
            "benchmarks.cdc_binlog",
            "--child",
            "--url",
            url,
            "--big",
            str(rows),
            *([] if history else ["--no-history"]),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# --- the report -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a MariaDB with a ROW binary log (default: a private one)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each latency run")
    parser.add_argument("--rate", type=float, default=200.0, help="events/s of the latency runs")
    parser.add_argument("--rows", type=int_list, default=[200_000], help="backlog size")
    parser.add_argument("--big", type=int, default=100_000, help="rows of the large transaction")
    parser.add_argument(
        "--intervals",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[1.0, 0.1],
        help="worker intervals of the latency runs (default 1,0.1)",
    )
    parser.add_argument(
        "--lookahead",
        action="store_true",
        help="only the backlog drain without names in the log, with and without the look-ahead",
    )
    parser.add_argument(
        "--flushes", type=int, default=20, help="new table map ids in the --lookahead backlog"
    )
    parser.add_argument(
        "--txn-rows", type=int, default=10, help="rows per transaction of the --lookahead backlog"
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-history", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.getLogger("dbtrigger").setLevel(logging.ERROR)  # the tables are the output
    if args.child:
        print(json.dumps(memory_child(args.url, args.big, not args.no_history)))
        return 0
    if args.quick:
        args.seconds, args.rows, args.big = 3.0, [20_000], 20_000
    if args.url:
        report(args, args.url)
        return 0
    port = int(os.environ.get("DBTRIGGER_BENCH_BINLOG_PORT", "55498"))
    with private_server(port) as url:
        report(args, url)
    return 0


def label(kind: str) -> str:
    return "BinlogSource" if kind != "polling" else "SqlAlchemySource (cursor)"


def report(args: argparse.Namespace, url: str) -> None:
    if args.lookahead:
        report_lookahead(args, url)
        return
    lat_rows = []
    for kind in ("binlog", "polling"):
        for interval in args.intervals:
            result = latency(url, kind, interval, args.seconds, args.rate)
            lat_rows.append(
                [
                    label(kind),
                    f"interval {interval:g} s",
                    result["events"],
                    f"{result['p50_ms']:.0f}",
                    f"{result['p99_ms']:.0f}",
                    f"<= {interval * 1000 + 100:.0f}" if kind != "polling" else "-",
                ]
            )
    print_table(
        f"commit -> handler latency at {args.rate:g} events/s for {args.seconds:g} s",
        ["source", "settings", "events", "p50 ms", "p99 ms", "target p99 ms"],
        lat_rows,
        left=2,
    )
    replay_rows = []
    for rows in args.rows:
        for batch, note in ((100, "default batch_size 100"), (1000, "batch_size 1000 (tuned)")):
            for kind in ("binlog", "polling"):
                result = replay(url, kind, rows, batch)
                replay_rows.append(
                    [
                        label(kind),
                        note,
                        rows,
                        f"{result['events_per_s']:,.0f}",
                        f"{result['seconds']:.1f}",
                    ]
                )
    print_table(
        "backlog replay (in-memory state store, handler reads pk and one column; "
        "target >= 5,000/s)",
        ["source", "settings", "events", "events/s", "seconds"],
        replay_rows,
        left=2,
    )
    memory_rows = []
    for history in (True, False):
        result = memory(url, args.big, history)
        memory_rows.append(
            [
                "BinlogSource",
                "default (history in memory)" if history else "history=False",
                args.big,
                f"{result['before']:.0f}",
                f"{result['peak']:.0f}",
                f"{result['peak'] - result['before']:.0f}",
            ]
        )
    print_table(
        "client memory while one transaction of N rows is delivered (MiB; target <= 80 MB)",
        ["source", "trigger", "rows in the transaction", "RSS set up", "peak RSS", "growth"],
        memory_rows,
    )


if __name__ == "__main__":
    sys.exit(main())
