"""A worker whose handler kills its own process on one row, every time.

Started again and again by ``tests/test_crash_loop.py``, as a supervisor
(systemd, Kubernetes, the Functions host) restarts a worker that died. Each
run ticks the ``items`` poller until nothing is left (exit 0), or until a
tick refuses with a dbtrigger error (exit 3, the error's type and message
printed on stderr). The handler appends every row it handled to ``--log``
(fsynced) and calls ``os._exit(1)`` when it reaches a row of ``--poison``
(one id, or several separated by commas): the crash of a segfault or an OOM
kill, with no exception, no ``finally`` and no lease released. ``--lanes N``
runs it on N parallel lanes (``max_concurrency``); ``--fanout`` makes it the
subscriber ``crashy`` beside ``billing``, which logs each call's rows (with
the call's size) to ``--log`` + ``.billing``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dbtrigger import BatchContext, FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import DbTriggerError
from dbtrigger.quarantine import JsonLinesQuarantineSink, QuarantineRecord


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--poison", required=True)
    parser.add_argument("--owner", required=True)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--sink")
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument(
        "--fanout", action="store_true", help="the handler as subscriber 'crashy' beside 'billing'"
    )
    parser.add_argument(
        "--billing-retries",
        type=int,
        help="billing asks for a retry (ctx.retry) the first two times it is handed this row alone",
    )
    parser.add_argument(
        "--die-in-sink",
        action="store_true",
        help="the dead-letter sink's write kills the process (an OOM on a huge row)",
    )
    args = parser.parse_args(argv)
    poison = {int(i) for i in args.poison.split(",")}

    log = open(args.log, "a", encoding="utf-8")  # noqa: SIM115 - lives until the process ends

    def handler(events: list[RowChange]) -> None:
        for event in events:
            if event.pk["id"] in poison:
                os._exit(1)
            log.write(f"{event.pk['id']}\n")
            log.flush()
            os.fsync(log.fileno())

    def billing(events: list[RowChange], ctx: BatchContext) -> None:
        retried = Path(f"{args.log}.billing-retried")
        lines = []
        for event in events:
            retry = len(events) == 1 and event.pk["id"] == args.billing_retries
            if retry and len(retried.read_text() if retried.exists() else "") < 2:
                with retried.open("a") as mark:
                    mark.write("r")
                ctx.retry(event, "billing: not yet")
                lines.append(f"{event.pk['id']} {len(events)} retry\n")
            else:
                lines.append(f"{event.pk['id']} {len(events)}\n")
        with open(f"{args.log}.billing", "a", encoding="utf-8") as out:
            out.writelines(lines)

    class Sink(JsonLinesQuarantineSink):
        def put(self, records: Sequence[QuarantineRecord]) -> None:
            if args.die_in_sink:
                os._exit(1)
            super().put(records)

    trigger = PollTrigger(
        name="items",
        source=SqlAlchemySource(
            url=args.db_url,
            table="items",
            cursor_column="version",
            pk_columns=["id"],
            visibility="none",  # rows are written before the worker starts
        ),
        checkpoint_store=FileCheckpointStore(args.state),
        batch_size=args.batch_size,
        lease_ttl_seconds=args.ttl,
        owner_id=args.owner,
        max_attempts=args.max_attempts,
        quarantine=Sink(args.sink) if args.sink else None,
        subscribers={"billing": billing, "crashy": handler} if args.fanout else None,
        max_concurrency=args.lanes,
        retry_delay_seconds=0,  # a retry is handed again on the next tick
    )
    call = None if args.fanout else handler

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            result = trigger.tick_result(call)
        except DbTriggerError as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 3
        if result.outcome == "idle":
            return 0
        if result.outcome in ("lease_busy", "lost_race"):
            time.sleep(0.05)  # the dead owner's lease has not expired yet
    return 4


if __name__ == "__main__":
    sys.exit(main())
