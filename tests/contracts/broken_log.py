"""Deliberately broken log sources: the log-source contract must fail on each.

Each gets one thing wrong that a real reader could, and nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import Position
from dbtrigger.events import RowChange
from dbtrigger.testing import LogOp, MemoryLogSource
from tests.contracts.log_harnesses import MemoryLogHarness


class PositionOnlyCheckpoint(MemoryLogSource):
    """Checkpoints the commit alone (Debezium's DBZ-1554): a restart inside a
    multi-row statement skips the rest of it."""

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        start = LogPosition.of(after)
        rows = [c for c in self._log if start is None or c["position"].commit > start.commit]
        return rows[:limit]


class InclusiveAfter(MemoryLogSource):
    """Returns the change at the checkpoint again."""

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        start = LogPosition.of(after)
        return [c for c in self._log if start is None or c["position"] >= start][:limit]


class IdsByKey(MemoryLogSource):
    """Event ids from the key alone: two changes of one row look like one."""

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        events = super().to_events(rows, poller=poller, batch_id=batch_id)
        return [
            RowChange(
                hashlib.sha256(repr(sorted(e.pk.items())).encode()).hexdigest()[:32],
                e.op,
                e.source,
                e.cursor,
                e.pk,
                e.before,
                e.after,
                e.metadata,
            )
            for e in events
        ]


class ForgetsOnAcknowledge(MemoryLogSource):
    """Releases the whole transaction of the acknowledged change, not just up to it."""

    def acknowledge(self, position: Position) -> None:
        acked = LogPosition.of(position)
        assert acked is not None
        self._log[:] = [c for c in self._log if c["position"].commit > acked.commit]


class StartOrderHarness(MemoryLogHarness):
    """Delivers crossed transactions in the order they began."""

    def commit_crossed(self, first: Sequence[LogOp], second: Sequence[LogOp]) -> None:
        self.commit(first)
        self.commit(second)


class RolledBackHarness(MemoryLogHarness):
    """Logs a transaction's changes before it commits, and keeps them on rollback."""

    def rollback(self, ops: Sequence[LogOp]) -> None:
        self.commit(ops)


class KeylessDeleteHarness(MemoryLogHarness):
    """A delete without a before image."""

    def changes(self, ops: Sequence[LogOp]) -> list[dict[str, Any]]:
        out = super().changes(ops)
        return [dict(c, before=None) if c["op"] == "delete" else c for c in out]


BROKEN_LOG_HARNESSES = {
    "position_only_checkpoint": lambda: MemoryLogHarness(PositionOnlyCheckpoint("memory:t")),
    "inclusive_after": lambda: MemoryLogHarness(InclusiveAfter("memory:t")),
    "ids_by_key": lambda: MemoryLogHarness(IdsByKey("memory:t")),
    "forgets_on_acknowledge": lambda: MemoryLogHarness(ForgetsOnAcknowledge("memory:t")),
    "start_order": StartOrderHarness,
    "keeps_rolled_back": RolledBackHarness,
    "keyless_delete": KeylessDeleteHarness,
}
