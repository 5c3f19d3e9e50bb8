"""A worker of the ``items`` poller for ``tests/test_fast_takeover.py``.

Run as a supervisor would run it: it ticks until nothing is left (exit 0), or
until a tick refuses with a dbtrigger error (exit 3). Its handler appends every
row it handled to ``--log`` (fsynced). With ``--hang-on ID`` the handler, on
the batch holding that row, creates ``--ready`` and blocks: the test then kills
the process with SIGKILL, mid-batch, its lease held and unexpired. With
``--once`` it ticks once and prints the tick's outcome (exit 0).

The lease TTL is the default (120 s) unless ``--ttl`` says otherwise, so a
worker started after a kill finishes within the test's bound only if it takes
the dead holder's lease over without waiting for it to expire. It prints how
long after its start the first row was handed to it (``first_delivery_s=``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import DbTriggerError
from dbtrigger.state.stores.base import CheckpointStore

STARTED = time.monotonic()


def _store(args: argparse.Namespace) -> CheckpointStore:
    if args.store_kind == "file":
        return FileCheckpointStore(args.store)
    if args.store_kind == "sql":
        from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415

        return SqlCheckpointStore(url=args.store, schema=args.schema)
    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

    return BlobCheckpointStore.from_connection_string(
        args.store, app_name="app", container=args.container
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--store-kind", choices=("file", "sql", "blob"), default="file")
    parser.add_argument("--store", required=True)
    parser.add_argument("--schema")
    parser.add_argument("--container")
    parser.add_argument("--log", required=True)
    parser.add_argument("--owner", required=True)
    parser.add_argument("--ttl", type=float, default=120.0)
    parser.add_argument("--hang-on", type=int)
    parser.add_argument("--ready")
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--deadline", type=float, default=60.0, help="give up (exit 4) after it")
    args = parser.parse_args(argv)

    log = open(args.log, "a", encoding="utf-8")  # noqa: SIM115 - lives until the process ends
    first: list[float] = []

    def handler(events: list[RowChange]) -> None:
        if not first:
            first.append(time.monotonic() - STARTED)
            print(f"first_delivery_s={first[0]:.3f}", flush=True)
        if args.hang_on is not None and any(e.pk["id"] == args.hang_on for e in events):
            Path(args.ready).touch()
            threading.Event().wait()  # until SIGKILL
        log.writelines(f"{event.pk['id']}\n" for event in events)
        log.flush()
        os.fsync(log.fileno())

    trigger = PollTrigger(
        name="items",
        source=SqlAlchemySource(
            url=args.db_url,
            table="items",
            cursor_column="version",
            pk_columns=["id"],
            visibility="none",  # rows are written before the worker starts
        ),
        checkpoint_store=_store(args),
        batch_size=5,
        lease_ttl_seconds=args.ttl,
        owner_id=args.owner,
        max_attempts=5,
    )
    deadline = time.monotonic() + args.deadline
    while time.monotonic() < deadline:
        try:
            result = trigger.tick_result(handler)
        except DbTriggerError as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 3
        if args.once:
            print(f"outcome={result.outcome}", flush=True)
            return 0
        if result.outcome == "idle":
            return 0
        if result.outcome in ("lease_busy", "lost_race"):
            time.sleep(0.05)  # a lease held by someone else: it ends at its TTL
    return 4


if __name__ == "__main__":
    sys.exit(main())
