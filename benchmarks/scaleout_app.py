"""The app the scale-out benchmark and tests start with ``dbtrigger run``, as an operator would.

    DBT_SCALEOUT_URL=... DBT_SCALEOUT_STORE=... DBT_SCALEOUT_OUT=dir \\
        dbtrigger run benchmarks.scaleout_app:trigger

Every setting dbtrigger has a default for is left at it (balance interval,
member TTL, join window, batch size, batches per tick, lease TTL, the
worker's idle interval), except what the environment names:

* ``DBT_SCALEOUT_URL``, ``DBT_SCALEOUT_SCHEMA``, ``DBT_SCALEOUT_TABLE``: the
  PostgreSQL table (``id`` key, ``seq`` cursor);
* ``DBT_SCALEOUT_STORE`` (a store location, as ``--store`` takes) and
  ``DBT_SCALEOUT_APP`` (its app prefix);
* ``DBT_SCALEOUT_PARTITIONS``: the partition count (default: dbtrigger's);
* ``DBT_SCALEOUT_BALANCE_SECONDS``: the balance interval (default: dbtrigger's,
  3 s); the member TTL stays its default multiple of it (10/3), so tests that
  wait for a TTL to pass can provoke the same takeover in half the time;
* ``DBT_SCALEOUT_HANDLER_MS``: what the handler waits per event (an I/O-bound
  stand-in);
* ``DBT_SCALEOUT_OUT``: a directory; each process appends ``id,seq`` per
  delivered event to ``<pid>.out`` there (flushed per batch, so a SIGKILL
  loses at most a partial last line).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dbtrigger import SqlAlchemySource
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.partitions.member import DEFAULT_PARTITIONS
from dbtrigger.state.stores.factory import open_store

_env = os.environ
_delay = float(_env.get("DBT_SCALEOUT_HANDLER_MS", "2")) / 1000
_out_dir = Path(_env.get("DBT_SCALEOUT_OUT", "."))
_out: Any = None

trigger = PartitionedPoller(
    name="orders",
    source=SqlAlchemySource(
        url=_env.get("DBT_SCALEOUT_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
        table=_env.get("DBT_SCALEOUT_TABLE", "orders"),
        schema=_env.get("DBT_SCALEOUT_SCHEMA") or None,
        cursor_column="seq",
        pk_columns=["id"],
    ),
    checkpoint_store=open_store(
        _env.get("DBT_SCALEOUT_STORE", "./state"), app=_env.get("DBT_SCALEOUT_APP") or None
    ),
    partitions=int(_env.get("DBT_SCALEOUT_PARTITIONS", str(DEFAULT_PARTITIONS))),
    balance_interval_seconds=float(_env["DBT_SCALEOUT_BALANCE_SECONDS"])
    if _env.get("DBT_SCALEOUT_BALANCE_SECONDS")
    else None,
)


@trigger.handler
def handle(events: list[Any]) -> None:
    global _out  # noqa: PLW0603 - one file per process, opened on first use
    if _delay:
        time.sleep(_delay * len(events))
    if _out is None:
        _out = open(_out_dir / f"{os.getpid()}.out", "a", encoding="ascii")  # noqa: SIM115
    _out.write("".join(f"{e.pk['id']},{e.cursor}\n" for e in events))
    _out.flush()
