"""A worker for the log-capture chaos test: PollTrigger over PgLogicalSource until killed.

Every batch it is handed is written to ``seen`` (a table that is not
published) in one COPY *before* the handler returns, so a change delivered and
then lost to a SIGKILL before its checkpoint commit shows up twice: that is
the duplicate window the test measures.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import PgLogicalSource
from dbtrigger.runtime.stop_signals import stop_on_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--conninfo", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--poller", default="cdc_chaos")
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--mode", default="poll")
    parser.add_argument("--read-ahead", type=int, default=50_000)
    args = parser.parse_args(argv)

    # The harness sends SIGUSR1 to a worker that outlives its stop: every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = threading.Event()
    sink = psycopg.connect(args.conninfo, autocommit=True)
    source = PgLogicalSource(
        args.url, ["items"], snapshot="never", mode=args.mode, read_ahead=args.read_ahead
    )
    trigger = PollTrigger(
        name=args.poller,
        source=source,
        checkpoint_store=FileCheckpointStore(args.state_dir),
        batch_size=args.batch_size,
        max_batches_per_tick=20,
        lease_ttl_seconds=1.0,
    )

    def handle(events: list[RowChange]) -> None:
        with sink.cursor().copy(
            "COPY seen (position, op, item_id, version, incarnation) FROM STDIN"
        ) as copy:
            for e in events:
                image = e.after if e.after is not None else e.before or {}
                copy.write_row((e.cursor, e.op, e.pk["id"], image.get("version"), args.incarnation))

    run_until_stopped(trigger, source, handle, stop)
    return 0


def run_until_stopped(
    trigger: PollTrigger, source: Any, handle: Callable[[list[RowChange]], None], stop: Any
) -> None:
    """Tick until SIGTERM/SIGINT, then close the trigger (its history flushed, bounded)
    and the source. (Both CDC workers.)

    Not stop.set() in a handler of one's own: a signal landing inside stop.wait(),
    which holds the event's lock, waited for that lock forever (under load, now and
    then: a worker that ignored SIGTERM). See dbtrigger.runtime.stop_signals.
    """
    with stop_on_signals(stop):
        while not stop.is_set():
            try:
                trigger.tick(handle)
            except Exception as exc:
                print(f"tick failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                stop.wait(0.2)
                continue
            result = trigger.last_result
            if result is None or not result.more:
                stop.wait(0.05)
        trigger.close()
        source.close()


if __name__ == "__main__":
    sys.exit(main())
