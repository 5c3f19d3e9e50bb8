"""A source over rows held in memory, with the same contract as a database source.

:class:`MemorySource` is the ``SourceAdapter`` to reach for when the thing
under test is a handler, a store or the runtime, not the database: a test puts
rows in, a :class:`~dbtrigger.PollTrigger` polls them out. It behaves like
:class:`~dbtrigger.SqlAlchemySource` on a table with a ``(cursor, pk)`` index
and no concurrent writers, and it passes the same source contract suite
(:class:`dbtrigger.testing.SourceContract`), so what a test learns from it holds
for the real thing:

* rows are returned in ``(cursor, *pk)`` order, strictly after a position,
  at most ``limit`` of them;
* :meth:`MemorySource.put` replaces a row with the same key, so an update moves
  the row to its new cursor (a cursor poller sees current state, not history);
* a row whose cursor is ``None`` has no place in cursor order: it is never
  fetched, and :meth:`MemorySource.null_cursor_keys` reports it, as the SQL
  source does.

Values must be ones a checkpoint can hold (ints, strings, timestamps,
decimals, ...): they are checked when a row is put, so a bad row fails the
test that put it rather than a later tick.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dbtrigger.cursor import Position, canonical_json, encode_value
from dbtrigger.errors import ConfigurationError, CorruptStateError, SerializationError
from dbtrigger.event_identity import EventIds
from dbtrigger.events import RowChange
from dbtrigger.names import validate_sql_identifier

_Key = tuple[Any, ...]


class MemorySource:
    """Poll rows held in memory by ``cursor_column`` plus ``pk_columns``.

    Args:
        rows: initial rows (mappings that include the cursor and key columns).
        cursor_column: the monotonic column; ``None`` values are never fetched.
        pk_columns: unique, non-null key columns; the tiebreaker for equal cursors.
        name: display name (``memory:<name>``); part of the fingerprint, so two
            memory sources with different names do not share checkpoints.

    Thread-safe: one test may put rows while a poller fetches.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]] = (),
        *,
        cursor_column: str,
        pk_columns: Sequence[str],
        name: str = "rows",
    ) -> None:
        if isinstance(pk_columns, str):
            raise ConfigurationError("pk_columns must be a list of column names, not a string")
        if not pk_columns:
            raise ConfigurationError("pk_columns must name at least one column")
        self._cursor_column = validate_sql_identifier(cursor_column, "cursor_column")
        self._pk_columns = tuple(validate_sql_identifier(c, "pk column") for c in pk_columns)
        if self._cursor_column in self._pk_columns:
            raise ConfigurationError("cursor_column must not also be a pk column")
        if not name:
            raise ConfigurationError("a MemorySource needs a non-empty name")
        self._label = name
        self._lock = threading.Lock()
        self._rows: dict[_Key, dict[str, Any]] = {}
        #: (cursor, pk tuple) of every row with a cursor, kept sorted.
        self._order: list[tuple[Any, _Key]] = []
        self.put(*rows)

    # --- data ---------------------------------------------------------------------

    def _check(self, row: Mapping[str, Any]) -> tuple[Any, _Key]:
        try:
            cursor = row[self._cursor_column]
            pk = tuple(row[c] for c in self._pk_columns)
        except KeyError as exc:
            raise ConfigurationError(
                f"row for {self.name} lacks column {exc.args[0]!r}; it has {sorted(row)}"
            ) from None
        if any(v is None for v in pk):
            raise ConfigurationError(f"row for {self.name} has a NULL key {pk!r}")
        for value in (cursor, *pk):
            encode_value(value)  # raises SerializationError for values no checkpoint can hold
        return cursor, pk

    def put(self, *rows: Mapping[str, Any]) -> None:
        """Insert rows, replacing any row with the same key (an update).

        Rows are applied in order; when one is refused, the rows before it stay.

        Raises:
            ConfigurationError: a row lacks a column, has a NULL key, or has a
                cursor that cannot be ordered against the cursors already held.
            SerializationError: a cursor or key value no checkpoint can hold.
        """
        checked = [(self._check(row), dict(row)) for row in rows]
        with self._lock:
            for (cursor, pk), row in checked:
                old = self._rows.get(pk)
                if old is not None:
                    self._unindex(old[self._cursor_column], pk)
                if cursor is not None:
                    try:
                        bisect.insort(self._order, (cursor, pk))
                    except TypeError as exc:
                        if old is not None:
                            self._index(old[self._cursor_column], pk)
                        raise ConfigurationError(
                            f"row {pk!r} of {self.name}: cursor {cursor!r} cannot be ordered "
                            f"against the cursors already held ({exc})"
                        ) from None
                self._rows[pk] = row

    def delete(self, pk: Mapping[str, Any]) -> bool:
        """Remove the row with key ``pk``; True if there was one."""
        key = tuple(pk[c] for c in self._pk_columns)
        with self._lock:
            old = self._rows.pop(key, None)
            if old is None:
                return False
            self._unindex(old[self._cursor_column], key)
            return True

    def _index(self, cursor: Any, pk: _Key) -> None:
        if cursor is not None:
            bisect.insort(self._order, (cursor, pk))

    def _unindex(self, cursor: Any, pk: _Key) -> None:
        if cursor is None:
            return
        at = bisect.bisect_left(self._order, (cursor, pk))
        del self._order[at]

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)

    # --- identity -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"memory:{self._label}"

    @property
    def cursor_column(self) -> str:
        return self._cursor_column

    @property
    def pk_columns(self) -> tuple[str, ...]:
        return self._pk_columns

    def fingerprint(self) -> str:
        """``sha256:`` of the name, cursor column and key columns (never of the data)."""
        definition = {
            "source": "memory",
            "name": self._label,
            "cursor_column": self._cursor_column,
            "pk_columns": list(self._pk_columns),
        }
        return "sha256:" + hashlib.sha256(canonical_json(definition).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cursor_column": self._cursor_column,
            "pk_columns": list(self._pk_columns),
            "rows": len(self),
        }

    def close(self) -> None:
        """Nothing to release; the rows stay."""

    # --- the port -----------------------------------------------------------------

    def _start(self, after: Position) -> int:
        """Index of the first row strictly after ``after`` (call under the lock)."""
        if after.is_beginning:
            return 0
        if after.cursor is None:
            raise SerializationError("a checkpoint position needs a cursor value, got NULL")
        key = (after.cursor, after.pk_tuple(self._pk_columns))
        try:
            return bisect.bisect_right(self._order, key)
        except TypeError as exc:
            raise SerializationError(
                f"checkpoint position {key!r} cannot be compared with the cursors of "
                f"{self.name} ({exc}); was it written for another source?"
            ) from None

    def last_position(self, before: Any = None) -> Position:
        """After the last row (``before``: the last whose cursor is below it), as
        :meth:`SqlAlchemySource.last_position`; the beginning when there is none."""
        with self._lock:
            order = self._order
            index = len(order) if before is None else bisect.bisect_left(order, (before,))
            if index == 0:
                return Position()
            cursor, key = order[index - 1]
            return Position(cursor=cursor, pk=dict(zip(self._pk_columns, key, strict=True)))

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        """Copies of up to ``limit`` rows strictly after ``after``, in position order."""
        if limit < 1:
            raise ConfigurationError(f"fetch limit must be at least 1, got {limit}")
        with self._lock:
            start = self._start(after)
            return [dict(self._rows[pk]) for _, pk in self._order[start : start + limit]]

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """One ``upsert`` event per row (raises ``SerializationError`` naming the row)."""
        meta = MappingProxyType({"poller": poller, "batch_id": batch_id})
        event_id = EventIds(poller, self._pk_columns)
        events: list[RowChange] = []
        for row in rows:
            try:
                cursor = row[self._cursor_column]
                pk = {c: row[c] for c in self._pk_columns}
            except KeyError as exc:
                raise SerializationError(
                    f"row from {self.name} lacks column {exc.args[0]!r}; it has {sorted(row)}",
                    poller=poller,
                    batch_id=batch_id,
                ) from None
            if any(v is None for v in pk.values()):
                raise SerializationError(
                    f"row from {self.name} has a NULL primary key {pk!r}",
                    poller=poller,
                    batch_id=batch_id,
                )
            events.append(
                RowChange._unchecked(
                    event_id(pk, cursor),
                    "upsert",
                    self.name,
                    cursor,
                    MappingProxyType(pk),
                    None,
                    MappingProxyType(dict(row)),
                    meta,
                )
            )
        return events

    def present(self, positions: Sequence[Position]) -> list[Position]:
        """Which of ``positions`` still hold a row (the settled window's lookup)."""
        found: list[Position] = []
        with self._lock:
            for position in positions:
                try:
                    row = self._rows.get(position.pk_tuple(self._pk_columns))
                except CorruptStateError:
                    continue  # a position of another key shape holds no row here
                if row is not None and row[self._cursor_column] == position.cursor:
                    cursor = row[self._cursor_column]
                    found.append(Position(cursor, {c: row[c] for c in self._pk_columns}))
        return found

    # --- operations helpers (as SqlAlchemySource offers them) ---------------------

    def count_after(self, after: Position) -> int:
        """Rows strictly after ``after`` (the lag in rows)."""
        with self._lock:
            return len(self._order) - self._start(after)

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        """Keys of rows whose cursor is ``None``: they have no place in cursor order."""
        with self._lock:
            keys = [
                dict(zip(self._pk_columns, pk, strict=True))
                for pk, row in self._rows.items()
                if row[self._cursor_column] is None
            ]
        return keys[:limit]


__all__ = ["MemorySource"]
