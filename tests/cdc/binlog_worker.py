"""A worker for the binlog chaos test: PollTrigger over BinlogSource until killed.

Every batch it is handed is written to ``seen`` (a table the source does not
watch) in one statement *before* the handler returns, so a change delivered and
then lost to a SIGKILL before its checkpoint commit shows up twice: that is the
duplicate window the test measures.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import threading

import pymysql

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource
from tests.cdc.worker import run_until_stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--database", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--poller", default="binlog_chaos")
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args(argv)

    # The harness sends SIGUSR1 to a worker that outlives its stop: every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = threading.Event()
    sink = pymysql.connect(
        host="127.0.0.1", port=args.port, user="root", database=args.database, autocommit=True
    )
    source = BinlogSource(args.url, ["items"], snapshot="never", read_ahead=5000)
    trigger = PollTrigger(
        name=args.poller,
        source=source,
        checkpoint_store=FileCheckpointStore(args.state_dir),
        batch_size=args.batch_size,
        max_batches_per_tick=20,
        lease_ttl_seconds=1.0,
    )

    def handle(events: list[RowChange]) -> None:
        rows = []
        for e in events:
            image = e.after if e.after is not None else e.before or {}
            rows.append((e.cursor, e.op, e.pk["id"], image.get("version"), args.incarnation))
        with sink.cursor() as cur:
            cur.executemany(
                "INSERT INTO seen (position, op, item_id, version, incarnation) "
                "VALUES (%s, %s, %s, %s, %s)",
                rows,
            )

    run_until_stopped(trigger, source, handle, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
