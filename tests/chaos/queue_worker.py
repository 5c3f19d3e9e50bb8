"""Queue chaos worker: claims from ``jobs`` until SIGTERM, recording what it does.

* every handler call is recorded in ``calls`` (job, claim token, attempt,
  worker, incarnation) and committed *before* the handler returns, so a call
  whose worker is killed right after it still counts;
* some batches fail (an exception: every row is retried) and some are slow
  (longer than the visibility timeout: only the heartbeat keeps the claim);
* with ``--crash-on ID`` (or ``ID,ID,...``) a batch holding such a row kills the worker
  (``os._exit``, as an out-of-memory kill would) right after its calls were
  recorded: a poison row that takes its worker down on every delivery;
* after each tick, what the settlement did to each row (done / retry / dead /
  lost) goes to ``settlements``. A kill between the settlement and this record
  loses the record, not the outcome: the test reads the outcome from ``jobs``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from dbtrigger import ClaimContext, ClaimSource, QueueTrigger, RowChange
from dbtrigger.runtime.stop_signals import stop_on_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--schema")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--vt", type=float, default=2.0)
    parser.add_argument("--heartbeat", type=float, default=0.4)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--fail-probability", type=float, default=0.05)
    parser.add_argument("--slow-probability", type=float, default=0.05)
    parser.add_argument("--max-attempts", type=int, default=50)
    parser.add_argument("--ready-file", help="created once the first claim ran")
    parser.add_argument("--crash-on", help="os._exit when a batch holds one of these rows")
    parser.add_argument("--lanes", type=int, default=1, help="max_concurrency")
    args = parser.parse_args(argv)
    crash_on = {int(i) for i in args.crash_on.split(",")} if args.crash_on else set()
    # What an operator's log would show: each record's level and event name.
    said = logging.StreamHandler()
    said.setFormatter(
        logging.Formatter("%(levelname)s %(event)s %(message)s", defaults={"event": "-"})
    )
    logging.basicConfig(level=logging.WARNING, handlers=[said])

    stop = threading.Event()
    # SIGTERM sets stop from a thread of its own: a handler calling stop.set() on the
    # main thread hangs when it lands inside this loop's stop.wait() (runtime.stop_signals).
    signals = contextlib.ExitStack()
    signals.enter_context(stop_on_signals(stop))
    rng = random.Random(f"{args.worker}/{args.incarnation}")
    log_engine = sa.create_engine(args.db_url, isolation_level="AUTOCOMMIT", pool_size=1)
    meta = sa.MetaData(schema=args.schema)
    calls = sa.Table(
        "calls",
        meta,
        sa.Column("job_id", sa.Integer),
        sa.Column("token", sa.String(36)),
        sa.Column("attempt", sa.Integer),
        sa.Column("worker", sa.String(20)),
        sa.Column("incarnation", sa.Integer),
    )
    settlements = sa.Table(
        "settlements",
        meta,
        sa.Column("job_id", sa.Integer),
        sa.Column("token", sa.String(36)),
        sa.Column("outcome", sa.String(8)),
        sa.Column("worker", sa.String(20)),
    )
    source = ClaimSource(url=args.db_url, table="jobs", schema=args.schema, pk_columns=["id"])
    queue = QueueTrigger(
        name="chaos",
        source=source,
        batch_size=args.batch_size,
        visibility_timeout_seconds=args.vt,
        heartbeat_interval_seconds=args.heartbeat,
        max_attempts=args.max_attempts,
        retry_delay_seconds=0.05,
        retry_delay_max_seconds=0.2,
        owner_id=f"{args.worker}.{args.incarnation}",
        max_concurrency=args.lanes,
    )

    def handle(events: list[RowChange], ctx: ClaimContext) -> None:
        with log_engine.connect() as conn:
            conn.execute(
                calls.insert(),
                [
                    {
                        "job_id": e.pk["id"],
                        "token": ctx.claim_token,
                        "attempt": ctx.attempts(e),
                        "worker": args.worker,
                        "incarnation": args.incarnation,
                    }
                    for e in events
                ],
            )
        if crash_on and any(e.pk["id"] in crash_on for e in events):
            os._exit(3)
        roll = rng.random()
        if roll < args.slow_probability:
            time.sleep(args.vt * 1.5)
        elif roll < args.slow_probability + args.fail_probability:
            raise RuntimeError("chaos: handler failed")
        else:
            time.sleep(0.2)

    # An idle tick is a claim query; 0.1 s takes an expired claim (VT 1-1.5 s in the
    # tests) over soon enough, where 0.02 s spun a core's tenth per waiting worker.
    idle = 0.1
    while not stop.is_set():
        try:
            result = queue.tick_result(handle)
        except Exception as exc:  # the loop must survive a hiccup
            print(f"tick failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            stop.wait(0.1)
            continue
        if args.ready_file:
            Path(args.ready_file).touch()
            args.ready_file = None
        if result.settled:
            with log_engine.connect() as conn:
                conn.execute(
                    settlements.insert(),
                    [
                        {
                            "job_id": key[0],
                            "token": result.token,
                            "outcome": outcome,
                            "worker": args.worker,
                        }
                        for key, outcome in result.settled
                    ],
                )
        if not result.claimed:
            stop.wait(idle)
    source.close()
    log_engine.dispose()
    signals.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
