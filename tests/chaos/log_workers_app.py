"""The app `dbtrigger run tests.chaos.log_workers_app:trigger` runs in
tests/test_log_sources_workers.py: a PollTrigger at default settings over a change
log or a log-based source, as docs/changes.md and docs/cdc.md show it.

The handler appends one JSON line per event to ``DBT_LOGW_OUT`` (one ``write`` per
line, O_APPEND, unbuffered: a kill -9 loses no line the handler wrote), with the
pid that delivered it, and sleeps ``DBT_LOGW_EVENT_MS`` per event so that a kill
lands inside a batch.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange

KIND = os.environ["DBT_LOGW_KIND"]
URL = os.environ["DBT_LOGW_URL"]

source: Any
if KIND == "changelog":
    from dbtrigger.changelog import ChangeLogSource

    source = ChangeLogSource(url=URL, table="items")
elif KIND == "pglogical":
    from dbtrigger.cdc import PgLogicalSource

    source = PgLogicalSource(URL, ["public.items"])
else:
    from dbtrigger.cdc import BinlogSource

    source = BinlogSource(URL, ["items"])

trigger = PollTrigger(
    name="items-changes",
    source=source,
    checkpoint_store=FileCheckpointStore(os.environ["DBT_LOGW_STATE"]),
)

_out = os.open(os.environ["DBT_LOGW_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
_pause = float(os.environ.get("DBT_LOGW_EVENT_MS", "0")) / 1000


@trigger.handler
def handle(events: list[RowChange]) -> None:
    for e in events:
        image = e.after if e.after is not None else (e.before or {})
        record = {
            "pid": os.getpid(),
            "op": e.op,
            "id": e.pk.get("id"),
            "v": image.get("version"),
            "cursor": str(e.cursor),
        }
        os.write(_out, (json.dumps(record) + "\n").encode())
        time.sleep(_pause)
