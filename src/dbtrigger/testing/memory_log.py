"""``MemoryLogSource``: a log-based source over transactions a test commits in memory.

It behaves as a log source must (:class:`~dbtrigger.testing.LogSourceContract`
checks it): changes in commit order, each at a
:class:`~dbtrigger.cdc.position.LogPosition` (commit, ordinal), transactions
whole, and it implements :class:`~dbtrigger.sources.base.AcknowledgesCheckpoints`
by recording what the runtime acknowledged, so a test can see that a slot
would be released only behind durable checkpoints.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from dbtrigger.cdc.changes import Change, to_events
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.events import RowChange


class MemoryLogSource:
    """A log of committed transactions.

    ``commit([...])`` appends one transaction; each change is a mapping with
    ``op`` (insert/update/delete), ``pk`` and optionally ``before``, ``after``
    and ``table`` (default ``"public.t"``). :attr:`acknowledged` lists the
    positions the runtime acknowledged, in order.
    """

    def __init__(self, name: str = "memory:log") -> None:
        if not name:
            raise ConfigurationError("a MemoryLogSource needs a non-empty name")
        self._name = name
        self._log: list[Change] = []
        self._commits = itertools.count(1)
        self._lock = threading.Lock()
        self.acknowledged: list[Position] = []

    @property
    def name(self) -> str:
        return self._name

    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(f"memory-log:{self._name}".encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"name": self._name, "kind": "memory_log", "changes": len(self._log)}

    def share(self) -> MemoryLogSource:
        """Another instance over the same log (what a restarted worker would see)."""
        other = type(self)(self._name)
        other._log = self._log
        other._commits = self._commits
        other._lock = self._lock
        return other

    def commit(self, changes: Sequence[Mapping[str, Any]]) -> str:
        """Append one transaction; its commit token."""
        with self._lock:
            commit = f"{next(self._commits):016d}"
            for ordinal, change in enumerate(changes, start=1):
                self._log.append(
                    Change(
                        position=LogPosition(commit, ordinal),
                        op=change["op"],
                        table=change.get("table", "public.t"),
                        pk=dict(change["pk"]),
                        before=change.get("before"),
                        after=change.get("after"),
                        transaction_id=commit,
                        last_in_transaction=ordinal == len(changes),
                    )
                )
            return commit

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        if limit < 1:
            raise ConfigurationError(f"limit must be at least 1, got {limit}")
        start = LogPosition.of(after)
        with self._lock:
            rows = [c for c in self._log if start is None or c["position"] > start]
        return rows[:limit]

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        return to_events(rows, poller=poller, batch_id=batch_id, source=self._name)

    def acknowledge(self, position: Position) -> None:
        with self._lock:
            self.acknowledged.append(position)

    def close(self) -> None:
        return None


__all__ = ["MemoryLogSource"]
