"""A worker that drains ``items`` tick by tick until it is killed (history chaos).

The parent SIGKILLs it at random moments - inside a handler, between a commit
and its history append, in the middle of an append - and starts it again; the
history must end up holding exactly the committed batches.
"""

from __future__ import annotations

import argparse
import time

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore


def store_for(kind: str, where: str, container: str | None) -> CheckpointStore:
    if kind == "file":
        return FileCheckpointStore(where)
    if kind == "sql":
        from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415

        url, _, schema = where.partition("#")
        return SqlCheckpointStore(url=url, schema=schema or None)
    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

    return BlobCheckpointStore.from_connection_string(
        where, app_name="chaos", container=container or ""
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--schema")
    parser.add_argument("--store-kind", required=True, choices=["file", "sql", "blob"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--container")
    parser.add_argument("--batch-size", type=int, default=7)
    args = parser.parse_args(argv)
    source = SqlAlchemySource(
        url=args.db_url,
        table="items",
        schema=args.schema,
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",  # rows are all written before the workers start
    )
    trigger = PollTrigger(
        name="items",
        source=source,
        checkpoint_store=store_for(args.store_kind, args.store, args.container),
        batch_size=args.batch_size,
        lease_ttl_seconds=1.0,
    )

    def handler(events: list[RowChange]) -> None:
        time.sleep(0.002 * len(events))  # some work, so kills land inside handlers too

    while True:
        if not trigger.tick(handler):
            time.sleep(0.02)


if __name__ == "__main__":
    raise SystemExit(main())
