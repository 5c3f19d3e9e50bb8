"""A worker that drains ``items`` tick by tick until it is killed (history chaos).

The parent SIGKILLs it at random moments - inside a handler, between a commit
and its history append, in the middle of an append, with records queued for
the appender thread - and starts it again; the history must end up holding
exactly the committed batches.

``--die-at`` makes the process SIGKILL itself at one exact point instead, so
that each run certainly lands where a wrong order or a missing repair would
show:

* ``write:N``  - on the N-th state document write, before it is made (a commit
  that never lands: recording anything for it would be a phantom);
* ``append:N`` - on the N-th history append, before it is made (a commit that
  landed without its record: a gap unless the journal fills it in);
* ``torn:N``   - half way through the N-th history file write (file store
  only: a torn last line the next append must cut off).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.history import history_for
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


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def dying_on(nth: int, call: Callable[..., Any], *, torn: bool = False) -> Callable[..., Any]:
    """``call``, except that its ``nth`` call kills the process (before it does
    anything; or, ``torn``, after writing half of its data)."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            if torn:  # FileHistory._write(path, data, end): half the line, then die
                path, data, end = args
                call(path, data[: max(1, len(data) // 2)], end)
            die()
        return call(*args, **kwargs)

    return wrapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--schema")
    parser.add_argument("--store-kind", required=True, choices=["file", "sql", "blob"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--container")
    parser.add_argument("--batch-size", type=int, default=7)
    parser.add_argument("--die-at", help="write:N, append:N or torn:N (see the docstring)")
    args = parser.parse_args(argv)
    source = SqlAlchemySource(
        url=args.db_url,
        table="items",
        schema=args.schema,
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",  # rows are all written before the workers start
    )
    store = store_for(args.store_kind, args.store, args.container)
    history = history_for(store)
    assert history is not None
    if args.die_at:
        where, _, nth = args.die_at.partition(":")
        if where == "write":
            store.write = dying_on(int(nth), store.write)  # type: ignore[method-assign]
        elif where == "append":
            history.append = dying_on(int(nth), history.append)  # type: ignore[method-assign]
        elif where == "torn":
            history._write = dying_on(int(nth), history._write, torn=True)  # type: ignore[attr-defined]
        else:
            parser.error(f"--die-at {args.die_at!r}")
    trigger = PollTrigger(
        name="items",
        source=source,
        checkpoint_store=store,
        batch_size=args.batch_size,
        lease_ttl_seconds=1.0,
        history=history,
    )

    def handler(events: list[RowChange]) -> None:
        time.sleep(0.002 * len(events))  # some work, so kills land inside handlers too

    while True:  # tick_result, as `dbtrigger run` ticks: records may still be queued
        if not trigger.tick_result(handler).rows:  # for the appender when it dies
            # Mostly waiting out the killed predecessor's lease (1 s): every idle tick
            # reads the store, 0.02 s made that the bulk of a restart's CPU.
            time.sleep(0.1)


if __name__ == "__main__":
    raise SystemExit(main())
