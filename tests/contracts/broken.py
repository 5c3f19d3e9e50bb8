"""Deliberately broken implementations: each contract suite must fail on them.

Every class here gets one thing wrong that a real adapter could plausibly get
wrong, and nothing else. ``tests/test_*_contract.py`` run the suites on them in
a nested pytest session and check that the suite fails, and in the test that
names the mistake. A suite that passes any of these cannot tell a correct
implementation from a broken one.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dbtrigger import InMemoryCheckpointStore
from dbtrigger.cursor import Position
from dbtrigger.errors import CasConflictError
from dbtrigger.quarantine import QuarantineRecord
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state.stores.base import StoredDocument
from dbtrigger.testing import MemoryQuarantineSink
from tests.contracts.harnesses import MemoryHarness

# --- sources ------------------------------------------------------------------------


class _ListSource(MemorySource):
    """A MemorySource whose fetch is rewritten over the plain list of rows."""

    def _all(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._rows.values()]

    def _key(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        return (row["seq"], row["tenant"], row["id"])

    def _after_key(self, after: Position) -> tuple[Any, ...]:
        return (after.cursor, after.pk["tenant"], after.pk["id"])


class InsertionOrder(_ListSource):
    """Forgets ORDER BY: rows come back in the order they were written."""

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        rows = self._all()
        if not after.is_beginning:
            rows = [r for r in rows if self._key(r) > self._after_key(after)]
        return list(rows[:limit])


class CursorOnlyOrder(_ListSource):
    """Orders by the cursor alone: ties come back in write order."""

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        rows = sorted(self._all(), key=lambda r: r["seq"])
        if not after.is_beginning:
            rows = [r for r in rows if self._key(r) > self._after_key(after)]
        return rows[:limit]


class KeysAsText(_ListSource):
    """Compares key values as text: id 10 sorts before id 9."""

    def _key(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        return (row["seq"], row["tenant"], str(row["id"]))

    def _after_key(self, after: Position) -> tuple[Any, ...]:
        return (after.cursor, after.pk["tenant"], str(after.pk["id"]))

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        rows = sorted(self._all(), key=self._key)
        if not after.is_beginning:
            rows = [r for r in rows if self._key(r) > self._after_key(after)]
        return rows[:limit]


class InclusiveAfter(_ListSource):
    """``>=`` instead of ``>``: the checkpoint row comes back again."""

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        rows = sorted(self._all(), key=self._key)
        if not after.is_beginning:
            rows = [r for r in rows if self._key(r) >= self._after_key(after)]
        return rows[:limit]


class CursorOnlyAfter(_ListSource):
    """``cursor > :c`` without the key: the rest of a tie is skipped."""

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        rows = sorted(self._all(), key=self._key)
        if not after.is_beginning:
            rows = [r for r in rows if r["seq"] > after.cursor]
        return rows[:limit]


class IgnoresLimit(_ListSource):
    """Returns every row after the position, however many were asked for."""

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        del limit
        rows = sorted(self._all(), key=self._key)
        if not after.is_beginning:
            rows = [r for r in rows if self._key(r) > self._after_key(after)]
        return rows


_instances = itertools.count()


class FingerprintPerInstance(MemorySource):
    """Hashes something that differs between two instances of one definition."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._serial = next(_instances)

    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(f"{self.name}/{self._serial}".encode()).hexdigest()


class FingerprintOfData(MemorySource):
    """Hashes the data as well as the definition: every new row is a 'new source'."""

    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(f"{self.name}/{len(self)}".encode()).hexdigest()


class EventsWithoutTiebreaker(MemorySource):
    """Builds events whose key lacks a column: the checkpoint cannot hold the tie."""

    def to_events(self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str) -> Any:
        events = super().to_events(rows, poller=poller, batch_id=batch_id)
        return [
            type(e)(
                event_id=e.event_id,
                op=e.op,
                source=e.source,
                cursor=e.cursor,
                pk={"id": e.pk["id"]},
                before=e.before,
                after=e.after,
                metadata=e.metadata,
            )
            for e in events
        ]


class _BrokenHarness(MemoryHarness):
    def __init__(self, cls: type[MemorySource], fresh_per_open: bool = False) -> None:
        super().__init__()
        self.memory = cls(cursor_column="seq", pk_columns=["tenant", "id"], name="contract_rows")
        self._cls = cls
        self._fresh = fresh_per_open

    def open(self) -> MemorySource:
        if not self._fresh:
            return self.memory
        # A new instance over the same rows (as a database source would be).
        other = self._cls(cursor_column="seq", pk_columns=["tenant", "id"], name="contract_rows")
        other._rows, other._order, other._lock = (
            self.memory._rows,
            self.memory._order,
            self.memory._lock,
        )
        return other


BROKEN_SOURCES: dict[str, Callable[[], MemoryHarness]] = {
    "insertion_order": lambda: _BrokenHarness(InsertionOrder),
    "cursor_only_order": lambda: _BrokenHarness(CursorOnlyOrder),
    "keys_as_text": lambda: _BrokenHarness(KeysAsText),
    "inclusive_after": lambda: _BrokenHarness(InclusiveAfter),
    "cursor_only_after": lambda: _BrokenHarness(CursorOnlyAfter),
    "ignores_limit": lambda: _BrokenHarness(IgnoresLimit),
    "fingerprint_per_instance": lambda: _BrokenHarness(FingerprintPerInstance, True),
    "fingerprint_of_data": lambda: _BrokenHarness(FingerprintOfData),
    "events_without_tiebreaker": lambda: _BrokenHarness(EventsWithoutTiebreaker),
}

# --- stores -------------------------------------------------------------------------


class LastWriterWins(InMemoryCheckpointStore):
    """Checks the etag on create but not on update: a stale writer overwrites."""

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        current = self.read(key)
        if current is None or if_match is None:
            return super().write(key, data, if_match=if_match)
        return super().write(key, data, if_match=current.etag)


class ContentEtag(InMemoryCheckpointStore):
    """Etag = hash of the bytes: rewriting identical bytes keeps an old etag valid."""

    def __init__(self) -> None:
        super().__init__()
        self._docs: dict[str, bytes] = {}

    def read(self, key: str) -> StoredDocument | None:
        data = self._docs.get(key)
        return None if data is None else StoredDocument(data, hashlib.sha256(data).hexdigest())

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        current = self.read(key)
        if (current is None) != (if_match is None) or (current and current.etag != if_match):
            raise CasConflictError(f"{key}: etag mismatch")
        self._docs[key] = data
        return hashlib.sha256(data).hexdigest()

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        current = self.read(key)
        if current is not None and if_match is not None and current.etag != if_match:
            raise CasConflictError(f"{key}: etag mismatch")
        self._docs.pop(key, None)

    def list_keys(self) -> list[str]:
        return sorted(self._docs)


BROKEN_STORES: dict[str, Callable[[], InMemoryCheckpointStore]] = {
    "last_writer_wins": LastWriterWins,
    "content_etag": ContentEtag,
}

# --- sinks --------------------------------------------------------------------------


class KeepsLastPut(MemoryQuarantineSink):
    """Each put replaces what the sink held (a file opened with "w", not "a")."""

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        with self._lock:
            self._records.clear()
        super().put(records)


class KeyedByEventOnly(MemoryQuarantineSink):
    """Keys records by event id alone: a second poller's record is dropped."""

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        with self._lock:
            held = {event_id for _, event_id in self._records}
        super().put([r for r in records if r.event_id not in held])


class StringifiesRows(MemoryQuarantineSink):
    """Writes ``str(row)``: typed values no longer read back."""

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        super().put(
            [
                QuarantineRecord.from_json({**r.to_json(), "row": {"text": str(r.row)}})
                for r in records
            ]
        )


class RawOSError(MemoryQuarantineSink):
    """Lets the storage error escape untranslated."""

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        if self.unavailable:
            raise OSError(28, "No space left on device")
        super().put(records)


class SwallowsFailures(MemoryQuarantineSink):
    """Logs nothing, raises nothing: a put that failed looks like one that worked."""

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        if self.unavailable:
            return
        super().put(records)


def unavailable(sink: MemoryQuarantineSink) -> MemoryQuarantineSink:
    """The same sink, its storage down."""
    sink.unavailable = True
    return sink


BROKEN_SINKS: dict[str, Callable[[], MemoryQuarantineSink]] = {
    "keeps_last_put": KeepsLastPut,
    "keyed_by_event_only": KeyedByEventOnly,
    "stringifies_rows": StringifiesRows,
    "raw_os_error": RawOSError,
    "swallows_failures": SwallowsFailures,
}
