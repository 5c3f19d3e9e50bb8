"""In-process history: for tests and for pollers on the in-memory checkpoint store.

Passes the same contract suite as the durable history stores.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dbtrigger import options as opt
from dbtrigger.history.records import record_time
from dbtrigger.history.store import DEFAULT_RETENTION, Retention, encode_line, expect_end, numbered

#: The most records an in-process history keeps per poller: the process's own
#: memory is its store, and a record holds its batch's keys and image CRCs (a
#: worker on the in-memory state store delivering 100k events grew by about
#: 25 MB when nothing but age and total bytes bounded it).
DEFAULT_MAX_RECORDS = 1000


class MemoryHistory:
    """Records as JSON lines in a dict of lists, guarded by a lock; the oldest beyond
    ``max_records`` per poller are dropped as new ones are appended."""

    def __init__(
        self, *, retention: Retention = DEFAULT_RETENTION, max_records: int = DEFAULT_MAX_RECORDS
    ) -> None:
        #: How long the runtime keeps records here (it prunes after its appends).
        self.retention = retention
        self.max_records = opt.whole("max_records", max_records, minimum=1)
        #: Per poller: (number, ``at`` as written, the record's JSON line). A record
        #: kept as its line is a tenth of its objects (a 100-event batch's keys and
        #: CRCs); its time is parsed only when pruning asks.
        self._records: dict[str, list[tuple[int, object, bytes]]] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "memory"

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if not records:
            return
        lines = [(int(r["seq"]), r.get("at"), encode_line(r)) for r in numbered(records, after_seq)]
        with self._lock:
            held = self._records.setdefault(poller, [])
            last = held[-1][0] if held else 0
            expect_end(poller, last, after_seq)
            held.extend(lines)
            if len(held) > self.max_records:
                del held[: len(held) - self.max_records]

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        with self._lock:
            lines = [line for _, _, line in self._records.get(poller, [])[-count:]] if count else []
        return [json.loads(line) for line in lines]

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        with self._lock:
            lines = [line for seq, _, line in self._records.get(poller, []) if seq > since_seq]
        for line in lines:
            yield json.loads(line)

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        cutoff = retention.cutoff(now)
        with self._lock:
            held = self._records.get(poller, [])
            total = sum(len(line) for _, _, line in held)
            drop = 0
            for _, at, line in held[:-1]:
                when = record_time({"at": at}) if cutoff is not None else None
                old = cutoff is not None and when is not None and when <= cutoff
                big = retention.max_bytes is not None and total > retention.max_bytes
                if not (old or big):
                    break
                total -= len(line)
                drop += 1
            del held[:drop]
            return drop


__all__ = ["DEFAULT_MAX_RECORDS", "MemoryHistory"]
