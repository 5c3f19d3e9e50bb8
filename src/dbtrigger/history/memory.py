"""In-process history: for tests and for pollers on the in-memory checkpoint store.

Passes the same contract suite as the durable history stores.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dbtrigger import options as opt
from dbtrigger.errors import CasConflictError
from dbtrigger.history.records import record_time
from dbtrigger.history.store import DEFAULT_RETENTION, Retention, encode_line, numbered

#: The most records an in-process history keeps per poller: the process's own
#: memory is its store, and a record holds its batch's keys and image CRCs (a
#: worker on the in-memory state store delivering 100k events grew by about
#: 25 MB when nothing but age and total bytes bounded it).
DEFAULT_MAX_RECORDS = 1000


class MemoryHistory:
    """Records in a dict of lists, guarded by a lock; the oldest beyond
    ``max_records`` per poller are dropped as new ones are appended."""

    def __init__(
        self, *, retention: Retention = DEFAULT_RETENTION, max_records: int = DEFAULT_MAX_RECORDS
    ) -> None:
        #: How long the runtime keeps records here (it prunes after its appends).
        self.retention = retention
        self.max_records = opt.whole("max_records", max_records, minimum=1)
        self._records: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "memory"

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if not records:
            return
        with self._lock:
            held = self._records.setdefault(poller, [])
            last = int(held[-1]["seq"]) if held else 0
            if last != after_seq:
                raise CasConflictError(
                    f"the history of {poller!r} ends at record {last}, not {after_seq}"
                )
            held.extend(numbered(records, after_seq))
            if len(held) > self.max_records:
                del held[: len(held) - self.max_records]

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        with self._lock:
            held = self._records.get(poller, [])
            return [dict(r) for r in held[-count:]] if count else []

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        with self._lock:
            held = [dict(r) for r in self._records.get(poller, []) if r["seq"] > since_seq]
        yield from held

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        cutoff = retention.cutoff(now)
        with self._lock:
            held = self._records.get(poller, [])
            total = sum(len(encode_line(r)) for r in held)
            drop = 0
            for record in held[:-1]:
                when = record_time(record)
                old = cutoff is not None and when is not None and when <= cutoff
                big = retention.max_bytes is not None and total > retention.max_bytes
                if not (old or big):
                    break
                total -= len(encode_line(record))
                drop += 1
            del held[:drop]
            return drop


__all__ = ["DEFAULT_MAX_RECORDS", "MemoryHistory"]
