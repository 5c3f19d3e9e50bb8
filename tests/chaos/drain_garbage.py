"""A drain of many small ticks in a fresh process, counting what its garbage left.

Run by ``tests/test_gc_pause.py`` in its own interpreter so that the collector's
rule (a full collection once the process has grown by a quarter) applies to a
process of a worker's size, not to a test runner's: there every full collection
walks the whole suite's objects. Each batch's handler leaves a reference cycle
behind, as a heartbeat and its watcher do; the script prints how many of them
were never collected as ``ALIVE TOTAL``.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cursor import Position
from dbtrigger.event_identity import make_event_id


class Cycle:
    """An object in a cycle with itself (only the collector frees it), holding
    containers as a batch's events do."""

    def __init__(self) -> None:
        self.me = self
        self.payload = [[] for _ in range(200)]


class Rows:
    """An in-memory source of ``n`` rows, cursor = key."""

    name = "memory:rows"

    def __init__(self, n: int) -> None:
        self.rows = [{"id": i, "c": i} for i in range(n)]

    def fingerprint(self) -> str:
        return "sha256:test"

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        start = 0 if after.is_beginning else after.cursor + 1
        return self.rows[start : start + limit]

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        return [
            RowChange(
                event_id=make_event_id(poller, {"id": r["id"]}, r["c"]),
                op="upsert",
                source=self.name,
                cursor=r["c"],
                pk={"id": r["id"]},
                before=None,
                after=dict(r),
            )
            for r in rows
        ]

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


def main() -> int:
    ticks = int(sys.argv[1])
    trigger = PollTrigger(
        name="p",
        source=Rows(2 * ticks),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=2,
        max_batches_per_tick=1,
        history=False,
    )
    refs: list[weakref.ref[Cycle]] = []

    def handler(events: Sequence[RowChange]) -> None:
        refs.append(weakref.ref(Cycle()))

    gc.collect()
    delivered = trigger.drain(handler)
    alive = sum(1 for ref in refs if ref() is not None)
    trigger.close()
    print(alive, len(refs), delivered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
