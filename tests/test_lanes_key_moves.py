"""A retried update that moved its row to another key holds back both keys.

Log sources deliver ``UPDATE t SET id = 40 WHERE id = 4`` as one update keyed
40 with the old key in ``before`` (PgLogicalSource, BinlogSource). Lanes keep
keys 4 and 40 in one lane; but a retried move (``ctx.retry``) held later
events back by its new key only, so a later change of key 4 - a new row
under the key the move freed - was settled, or handed out, before the move
itself was: that key's changes out of order. The source here is an in-memory
one that delivers moves as the log sources do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.memory import MemorySource
from dbtrigger.testing import MemoryLogSource


class MovingSource(MemorySource):
    """A memory source whose rows with a ``from_id`` are updates that moved their
    row from key ``from_id`` (``before`` holds the old key), as a log delivers them."""

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        out = []
        for event, row in zip(
            super().to_events(rows, poller=poller, batch_id=batch_id), rows, strict=True
        ):
            old = row.get("from_id")
            out.append(
                RowChange._unchecked(
                    event.event_id,
                    "upsert" if old is None else "update",
                    event.source,
                    event.cursor,
                    MappingProxyType(dict(event.pk)),
                    None if old is None else MappingProxyType({"id": old, "v": 0}),
                    MappingProxyType(dict(row)),
                    MappingProxyType(dict(event.metadata)),
                )
            )
        return out


def source(*rows: dict[str, Any]) -> MovingSource:
    return MovingSource(rows, cursor_column="v", pk_columns=["id"], name="moves")


def trigger(src: MemorySource, lanes: int, batch_size: int = 10) -> PollTrigger:
    return PollTrigger(
        name=f"moves-{lanes}",
        source=src,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=batch_size,
        max_concurrency=lanes,
        retry_delay_seconds=0,
        retry_delay_max_seconds=0,
    )


def label(event: RowChange) -> str:
    return f"{event.op} {event.pk['id']}"


MOVE = {"id": 40, "v": 2, "from_id": 4}
AGAIN = {"id": 4, "v": 3}  # a new row under the key the move freed
OTHERS = [{"id": n, "v": 10 + n} for n in (7, 8, 9)]


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_change_of_the_old_key_is_settled_only_after_the_retried_move(lanes: int) -> None:
    poller = trigger(source(MOVE, AGAIN, *OTHERS), lanes)
    ticks: list[list[str]] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        ticks[-1].extend(label(e) for e in events)
        for e in events:
            if e.op == "update" and len(ticks) == 1:
                ctx.retry(e, "not yet")

    for _ in range(3):
        ticks.append([])
        poller.tick(handler)
    assert sorted(ticks[0]) == sorted(["update 40", "upsert 4", "upsert 7", "upsert 8", "upsert 9"])
    # Key 4's new row comes again after the move (before: settled in the first tick,
    # ahead of the move that freed its key).
    assert ticks[1] == ["update 40", "upsert 4"]
    assert ticks[2] == []
    poller.close()


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_waiting_move_holds_back_a_later_change_of_its_old_key(lanes: int) -> None:
    src = source(MOVE)
    poller = trigger(src, lanes, batch_size=1)
    seen: list[str] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        seen.extend(label(e) for e in events)
        for e in events:
            if e.op == "update":
                ctx.retry(e, "much later", delay_seconds=3600)

    poller.tick(handler)
    assert seen == ["update 40"]
    src.put(AGAIN)
    for _ in range(5):
        poller.tick(handler)
    # Before: "upsert 4" was handed out while the move still waited.
    assert seen == ["update 40"]
    poller.close()


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_waiting_change_of_the_old_key_holds_back_the_move(lanes: int) -> None:
    src = source({"id": 4, "v": 1})
    poller = trigger(src, lanes, batch_size=1)
    seen: list[str] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        seen.extend(label(e) for e in events)
        for e in events:
            if e.pk["id"] == 4:
                ctx.retry(e, "much later", delay_seconds=3600)

    poller.tick(handler)
    assert seen == ["upsert 4"]
    src.put(MOVE)
    for _ in range(5):
        poller.tick(handler)
    assert seen == ["upsert 4"]  # the move waits behind key 4's earlier change
    poller.close()


@pytest.mark.parametrize("lanes", [1, 4])
def test_the_log_source_path_holds_the_old_key_behind_a_retried_move(lanes: int) -> None:
    """The same through a log source (MemoryLogSource: the LogSource machinery the
    PostgreSQL and MariaDB sources share), a move delivered as one update."""
    log = MemoryLogSource()
    log.commit([{"op": "insert", "pk": {"id": 4}, "after": {"id": 4, "s": "a"}}])
    log.commit([{"op": "update", "pk": {"id": 40}, "before": {"id": 4}, "after": {"id": 40}}])
    log.commit([{"op": "insert", "pk": {"id": 4}, "after": {"id": 4, "s": "again"}}])
    log.commit([{"op": "insert", "pk": {"id": n}, "after": {"id": n}} for n in (7, 8, 9)])
    poller = PollTrigger(
        name=f"log-moves-{lanes}",
        source=log,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=10,
        max_concurrency=lanes,
        retry_delay_seconds=0,
        retry_delay_max_seconds=0,
    )
    ticks: list[list[str]] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        ticks[-1].extend(label(e) for e in events)
        for e in events:
            if e.op == "update" and len(ticks) == 1:
                ctx.retry(e, "not yet")

    for _ in range(3):
        ticks.append([])
        poller.tick(handler)
    assert ticks[1] == ["update 40", "insert 4"]  # before: ["update 40"]
    assert ticks[2] == []
    poller.close()
