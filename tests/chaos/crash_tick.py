"""One tick in a process that is killed mid-batch (duplicate windows W2, W3, W6).

The handler appends ``id:version`` for every event it has fully handled to
``--log`` (fsynced, so the parent sees exactly what happened before the kill)
and, with ``--sink-table``, upserts the row into that table first - the side
effect a real handler would have. With ``--die-after N`` the process SIGKILLs
itself after N side effects (a crash with partial side effects); without it,
it handles the whole batch and then hangs until the parent kills it (a crash
after the handler's work, before the commit).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--schema")
    parser.add_argument("--table", default="items")
    parser.add_argument("--state", required=True)
    parser.add_argument("--poller", default="items")
    parser.add_argument("--owner", default="doomed")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--log", required=True)
    parser.add_argument("--sink-table")
    parser.add_argument("--die-after", type=int)
    args = parser.parse_args(argv)

    source = SqlAlchemySource(
        url=args.db_url,
        table=args.table,
        schema=args.schema,
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",  # rows are written before the tick, in cursor order
    )
    trigger = PollTrigger(
        name=args.poller,
        source=source,
        checkpoint_store=FileCheckpointStore(args.state),
        batch_size=args.batch_size,
        lease_ttl_seconds=args.ttl,
        owner_id=args.owner,
    )
    engine = sa.create_engine(args.db_url)
    sink = (
        sa.Table(args.sink_table, sa.MetaData(), schema=args.schema, autoload_with=engine)
        if args.sink_table
        else None
    )
    handled = 0
    log = open(args.log, "a", encoding="utf-8")  # noqa: SIM115 - lives until the kill

    def handler(events: list[RowChange]) -> None:
        nonlocal handled
        for event in events:
            if sink is not None:
                with engine.begin() as conn:
                    conn.execute(
                        sink.insert(),
                        {"item_id": event.pk["id"], "version": event.cursor, "writer": args.owner},
                    )
            log.write(f"{event.pk['id']}:{event.cursor}\n")
            log.flush()
            os.fsync(log.fileno())
            handled += 1
            if args.die_after is not None and handled >= args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        log.write("handler-work-done\n")
        log.flush()
        os.fsync(log.fileno())
        while True:  # the parent kills us before the commit
            time.sleep(1)

    trigger.tick(handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
