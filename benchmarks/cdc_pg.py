"""PgLogicalSource next to cursor polling on the same tables: latency, replay rate, memory.

Four measurements, the first two printed beside the polling source (``SqlAlchemySource``
on an ``updated_at`` cursor, visibility guard ``auto``) measured in the same run:

* **commit -> handler latency** at a steady 200 events/s (one row per
  transaction, written by a thread): the handler's clock minus the commit time
  (the commit timestamp in the log for PgLogicalSource; the row's
  ``clock_timestamp()`` cursor for polling). Pollers run as ``dbtrigger run``
  does: tick, and sleep ``interval`` after an idle tick. Targets: stream p99 <=
  100 ms, poll p99 <= interval + 100 ms.
* **backlog replay**: events/s draining a backlog already in the slot (``--rows``
  rows in 1,000-row transactions), at the default batch size (100) and tuned
  (1,000), in-memory state store. Target >= 15k events/s.
* **client memory during one large transaction** (``--big`` rows in a single
  ``INSERT``), in a fresh interpreter per mode: peak RSS (``VmHWM``) and its
  growth over the process's size once set up. Target <= 80 MB.
* **one large transaction at the defaults** (``--txn`` rows in a single
  ``INSERT``, batch_size 100, read_ahead 50,000), in a fresh interpreter per
  mode: rows/s, client CPU, peak RSS, and how many times the server decoded
  the transaction (``pg_stat_replication_slots.total_bytes`` over the bytes of
  one decode, made by hand first). A transaction larger than ``read_ahead``
  used to be decoded once per read in poll mode (quadratic in its size).

A private PostgreSQL with ``wal_level=logical`` is started from the installed
server binaries (``scripts/cdc-servers.sh``) and stopped at the end, unless
``--url`` names one.

    python -m benchmarks.cdc_pg           # 15 s latency runs, 200k-row replay, 100k-row transaction
    python -m benchmarks.cdc_pg --only txn --txn 1000000   # one 1M-row transaction only
    python -m benchmarks.cdc_pg --quick   # a short smoke run
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from benchmarks.common import ROOT, int_list, percentile, print_table, rss_mb
from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cdc import PgLogicalSource

SCRIPT = ROOT / "scripts" / "cdc-servers.sh"


@contextmanager
def private_server(port: int) -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="dbtrigger-bench-cdc-")
    bash = shutil.which("bash") or "/bin/bash"
    subprocess.run(  # noqa: S603 - our own script
        [bash, str(SCRIPT), "start", "postgres", directory, str(port)], check=True
    )
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([bash, str(SCRIPT), "stop", "postgres", directory], check=False)  # noqa: S603
        shutil.rmtree(directory, ignore_errors=True)


def conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def fresh_database(url: str) -> str:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    """Drop a benchmark's database and the slots in it (slots are named cluster-wide)."""
    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(conninfo(admin), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE database = %s AND NOT active",
            (name,),
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def unique(name: str) -> str:
    return f"{name}_{uuid.uuid4().hex[:6]}"


def polling_source(url: str, table: str) -> SqlAlchemySource:
    return SqlAlchemySource(url=url, table=table, cursor_column="updated_at", pk_columns=["id"])


# --- latency -------------------------------------------------------------------------------


def writer(url: str, table: str, rate: float, seconds: float, stop: threading.Event) -> int:
    """One row per transaction at ``rate`` per second."""
    written = 0
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        start = time.monotonic()
        while not stop.is_set():
            due = start + written / rate
            now = time.monotonic()
            if now - start >= seconds:
                break
            if due > now:
                time.sleep(due - now)
            conn.execute(f"INSERT INTO {table} (v) VALUES (%s)", (written,))
            written += 1
    return written


def run_worker(
    trigger: PollTrigger,
    handler: Callable[[list[RowChange]], None],
    interval: float,
    until: Callable[[], bool],
) -> None:
    while not until():
        trigger.tick(handler)
        result = trigger.last_result
        if result is None or not result.more:
            time.sleep(interval)


def latency(url: str, kind: str, interval: float, seconds: float, rate: float) -> dict[str, Any]:
    db = fresh_database(url)
    table = "lat"
    with psycopg.connect(conninfo(db), autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, v int, "
            "updated_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.execute(f"CREATE INDEX ON {table} (updated_at, id)")
    if kind == "polling":
        source: Any = polling_source(db, table)
    else:
        source = PgLogicalSource(db, [table], snapshot="never", mode=kind)
    trigger = PollTrigger(
        name=unique(f"lat_{kind}"),
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=500,
        max_batches_per_tick=10,
    )
    trigger.tick(lambda events: None)  # set up (slot, publication) before the clock starts
    samples: list[float] = []

    def handle(events: list[RowChange]) -> None:
        now = time.time()
        for e in events:
            at = e.metadata.get("commit_time") if kind != "polling" else e.cursor
            samples.append(now - at.timestamp())

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
    with psycopg.connect(conninfo(db), autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigint PRIMARY KEY, v int NOT NULL, payload text NOT NULL, "
            "updated_at timestamptz NOT NULL)"
        )
        conn.execute(f"CREATE INDEX ON {table} (updated_at, id)")
    source: Any = (
        polling_source(db, table)
        if kind == "polling"
        else PgLogicalSource(db, [table], snapshot="never", mode=kind)
    )
    trigger = PollTrigger(
        name=unique(f"replay_{kind}"),
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=batch,
        max_batches_per_tick=100,
    )
    trigger.tick(lambda events: None)
    with psycopg.connect(conninfo(db), autocommit=True) as conn:
        for first in range(0, rows, 1000):
            conn.execute(
                f"INSERT INTO {table} SELECT g, g %% 97, 'payload ' || g, "
                "'2026-01-01'::timestamptz + g * interval '1 ms' "
                "FROM generate_series(%s::bigint, %s::bigint) g",
                (first + 1, min(rows, first + 1000)),
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


# --- memory during one large transaction ------------------------------------------------------


def memory_child(url: str, mode: str, rows: int, history: bool = True) -> dict[str, Any]:
    db = fresh_database(url)
    with psycopg.connect(conninfo(db), autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id bigint PRIMARY KEY, v int NOT NULL, payload text)")
    source = PgLogicalSource(db, ["big"], snapshot="never", mode=mode)
    trigger = PollTrigger(
        name=unique("big"),
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=1000,
        max_batches_per_tick=100,
        history=history,
    )
    try:  # a failed run must not leave its slot behind: slots are cluster-wide
        trigger.tick(lambda events: None)
        with psycopg.connect(conninfo(db), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO big SELECT g, g, repeat('p', 40) FROM generate_series(1, %s) g",
                (rows,),
            )
        before, _ = rss_mb()
        seen = 0

        def handle(events: list[RowChange]) -> None:
            nonlocal seen
            seen += len(events)

        while seen < rows:
            trigger.tick(handle)
        _, peak = rss_mb()
    finally:
        source.close()
        drop_database(db)
    return {"before": before, "peak": peak}


def decoded_bytes(conn: psycopg.Connection[Any], slot: str) -> tuple[int, int]:
    """What the server decoded for ``slot`` so far, and spilled to disk doing so
    (``pg_stat_replication_slots``)."""
    row = conn.execute(
        "SELECT total_bytes, spill_bytes FROM pg_stat_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    return (int(row[0] or 0), int(row[1] or 0)) if row is not None else (0, 0)


def big_transaction_child(url: str, mode: str, rows: int) -> dict[str, Any]:
    """One ``rows``-row transaction delivered at the defaults (batch_size 100,
    read_ahead 50,000): rows/s, how many times the server decoded it, peak RSS."""
    db = fresh_database(url)
    with psycopg.connect(conninfo(db), autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id bigint PRIMARY KEY, v int NOT NULL, payload text)")
    name = unique("bigtx")
    source = PgLogicalSource(db, ["big"], snapshot="never", mode=mode)
    trigger = PollTrigger(name=name, source=source, checkpoint_store=InMemoryCheckpointStore())
    try:
        trigger.tick(lambda events: None)
        source.close()  # a stream lets go of the slot: the decode by hand below needs it
        with psycopg.connect(conninfo(db), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO big SELECT g, g, repeat('p', 40) FROM generate_series(1, %s) g",
                (rows,),
            )
            start = decoded_bytes(conn, source.slot)
            deadline = time.monotonic() + 30
            while True:  # a closed stream's server process lets the slot go soon after
                try:
                    conn.execute(  # one decode by hand: what a decode of the transaction costs
                        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, "
                        "NULL, 'proto_version', '1', 'publication_names', %s)",
                        (source.slot, source.publication),
                    )
                    break
                except psycopg.errors.ObjectInUse:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            one = decoded_bytes(conn, source.slot)
        seen = 0

        def handle(events: list[RowChange]) -> None:
            nonlocal seen
            seen += len(events)

        cpu, started = time.process_time(), time.perf_counter()
        while seen < rows:
            trigger.tick(handle)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        with psycopg.connect(conninfo(db), autocommit=True) as conn:
            total, spilled = decoded_bytes(conn, source.slot)
        decodes = (total - one[0]) / max(1, one[0] - start[0])
        spilled_mb = (spilled - one[1]) / 2**20
        _, peak = rss_mb()
    finally:
        source.close()
        drop_database(db)
    return {"rows_per_s": rows / elapsed, "seconds": elapsed, "client_cpu": cpu,
            "decodes": decodes, "spilled_mb": spilled_mb, "peak": peak}  # fmt: skip


def child(url: str, what: str, *extra: str) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter (its peak RSS is its own)."""
    done = subprocess.run(  # noqa: S603 - this very script, as a child
        [sys.executable, "-m", "benchmarks.cdc_pg", "--child", what, "--url", url, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:  # say why: CalledProcessError alone hid the child's traceback
        raise RuntimeError(f"the {what} run failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def memory(url: str, mode: str, rows: int, history: bool = True) -> dict[str, Any]:
    return child(url, mode, "--big", str(rows), *([] if history else ["--no-history"]))


def big_transaction(url: str, mode: str, rows: int) -> dict[str, Any]:
    return child(url, f"txn-{mode}", "--txn", str(rows))


# --- the report -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", help="a PostgreSQL with wal_level=logical (default: a private one)"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each latency run")
    parser.add_argument("--rate", type=float, default=200.0, help="events/s of the latency runs")
    parser.add_argument("--rows", type=int_list, default=[200_000], help="backlog size")
    parser.add_argument("--big", type=int, default=100_000, help="rows of the large transaction")
    parser.add_argument(
        "--txn", type=int, default=200_000, help="rows of the transaction delivered at defaults"
    )
    parser.add_argument(
        "--intervals",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[1.0, 0.1],
        help="worker intervals of the poll-mode latency runs (default 1,0.1)",
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--only",
        choices=("latency", "replay", "memory", "txn"),
        help="run one of the measurements (default: all)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--no-history", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.getLogger("dbtrigger").setLevel(logging.ERROR)  # the tables are the output
    if args.child and args.child.startswith("txn-"):
        print(json.dumps(big_transaction_child(args.url, args.child[4:], args.txn)))
        return 0
    if args.child:
        print(json.dumps(memory_child(args.url, args.child, args.big, not args.no_history)))
        return 0
    if args.quick:
        args.seconds, args.rows, args.big, args.txn = 3.0, [20_000], 20_000, 20_000
    if args.url:
        report(args, args.url)
        return 0
    port = int(os.environ.get("DBTRIGGER_BENCH_CDC_PORT", "55499"))
    with private_server(port) as url:
        report(args, url)
    return 0


def report(args: argparse.Namespace, url: str) -> None:
    parts = {
        "latency": report_latency,
        "replay": report_replay,
        "memory": report_memory,
        "txn": report_transaction,
    }
    for name, part in parts.items():
        if args.only in (None, name):
            part(args, url)


TXN_COLUMNS = ["source", "rows", "rows/s", "seconds", "client CPU s", "decodes"]
TXN_COLUMNS += ["server spilled MB", "peak RSS MiB"]


def report_transaction(args: argparse.Namespace, url: str) -> None:
    rows = []
    for mode in ("poll", "stream"):
        result = big_transaction(url, mode, args.txn)
        rows.append(
            [
                f"PgLogicalSource {mode}",
                args.txn,
                f"{result['rows_per_s']:,.0f}",
                f"{result['seconds']:.1f}",
                f"{result['client_cpu']:.1f}",
                f"{result['decodes']:.1f}",
                f"{result['spilled_mb']:,.0f}",
                f"{result['peak']:.0f}",
            ]
        )
    print_table(
        "one transaction of N rows delivered at the defaults (batch_size 100, read_ahead "
        "50,000; decodes: how many times the server decoded it, from pg_stat_replication_slots)",
        TXN_COLUMNS,
        rows,
    )


def report_latency(args: argparse.Namespace, url: str) -> None:
    lat_rows = []
    configs = [("stream", 0.0, "defaults (stream_wait_seconds 1.0), worker interval 0")]
    for kind in ("poll", "polling"):
        for interval in args.intervals:
            configs.append((kind, interval, f"interval {interval:g} s"))
    for kind, interval, note in configs:
        result = latency(url, kind, interval, args.seconds, args.rate)
        target = "<= 100" if kind == "stream" else f"<= {interval * 1000 + 100:.0f}"
        lat_rows.append(
            [
                "PgLogicalSource " + kind if kind != "polling" else "SqlAlchemySource (cursor)",
                note,
                result["events"],
                f"{result['p50_ms']:.0f}",
                f"{result['p99_ms']:.0f}",
                target if kind != "polling" else "-",
            ]
        )
    print_table(
        f"commit -> handler latency at {args.rate:g} events/s for {args.seconds:g} s",
        ["source", "settings", "events", "p50 ms", "p99 ms", "target p99 ms"],
        lat_rows,
        left=2,
    )


def report_replay(args: argparse.Namespace, url: str) -> None:
    replay_rows = []
    for rows in args.rows:
        for batch, note in ((100, "default batch_size 100"), (1000, "batch_size 1000 (tuned)")):
            for kind in ("poll", "stream", "polling"):
                result = replay(url, kind, rows, batch)
                replay_rows.append(
                    [
                        "PgLogicalSource " + kind if kind != "polling" else "SqlAlchemySource",
                        note,
                        rows,
                        f"{result['events_per_s']:,.0f}",
                        f"{result['seconds']:.1f}",
                    ]
                )
    print_table(
        "backlog replay (in-memory state store, handler reads pk and one column; "
        "target >= 15,000/s)",
        ["source", "settings", "events", "events/s", "seconds"],
        replay_rows,
        left=2,
    )


def report_memory(args: argparse.Namespace, url: str) -> None:
    memory_rows = []
    for mode, history in (("poll", True), ("stream", True), ("poll", False), ("stream", False)):
        result = memory(url, mode, args.big, history)
        memory_rows.append(
            [
                f"PgLogicalSource {mode}",
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
