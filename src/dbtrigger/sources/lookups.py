"""What a keyset source answers besides the delivery read: rows at given
positions or keys, where a poller starting now resumes, how many rows wait.

The window looks up rows it cannot place by their exact ``(cursor, pk)``
tuples, a replay compares recorded rows with the rows as they are now, and
the operator's commands count and probe; each is one statement on a
connection of its own (never the one a catch-up keeps), built by the
source's :class:`~dbtrigger.sources.keyset.Keyset`. Kept apart from
:class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource`, whose base this is,
so that the source's face shows the read path on one screen.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, cast

from dbtrigger.cursor import Position
from dbtrigger.sources.connections import SourceConnections
from dbtrigger.sources.keyset import Keyset
from dbtrigger.sources.rows import ResultProcessors, Rows, read_rows

__all__ = ["KeysetLookups"]


class KeysetLookups(ABC):
    """Lookups of :class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource`,
    which provides these attributes."""

    _connections: SourceConnections
    _processors: ResultProcessors

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def pk_columns(self) -> tuple[str, ...]: ...

    @property
    @abstractmethod
    def _keyset(self) -> Keyset: ...

    def present(self, positions: Sequence[Position]) -> list[Position]:
        """Which of ``positions`` still hold a row of this source (its filter
        applies), as the rows read now: the settled window's lookup of entries
        a read could not place (:class:`~dbtrigger.sources.base.LocatesRows`).
        """
        if not positions:
            return []
        found: list[Position] = []
        with self._connections.open(f"window lookup on {self.name}") as conn:
            keyset = self._keyset
            for stmt in keyset.lookups(positions):
                rows = conn.execute(stmt).mappings()
                found += [keyset.shape.position_of(cast(Mapping[str, Any], r)) for r in rows]
                conn.rollback()
        return found

    def rows_with_keys(self, keys: Sequence[Mapping[str, Any]]) -> Rows:
        """The rows of this source (its filter applies) with these key values, as
        they are now, wherever their cursor is: what a replay compares the rows it
        recorded against (a row updated since has moved to a later cursor)."""
        columns: Sequence[str] = self._keyset.select_names()
        tuples: list[tuple[Any, ...]] = []
        with self._connections.open(f"key lookup on {self.name}") as conn:
            for stmt in self._keyset.key_lookups(keys):
                rows = read_rows(
                    conn,
                    stmt,
                    None,
                    self._processors,
                    source=self.name,
                    key_columns=self.pk_columns,
                )
                columns = rows.columns
                tuples += rows.tuples
                conn.rollback()
        return Rows(columns, tuples)

    def last_position(self, before: Any = None) -> Position:
        """Where a poller starting now resumes: after the last row (``before``: after
        the last row whose cursor is below it); the beginning when there is none."""
        with self._connections.open(f"start position on {self.name}") as conn:
            row = conn.execute(self._keyset.newest(before)).mappings().first()
        if row is None:
            return Position()
        return self._keyset.shape.position_of(cast(Mapping[str, Any], row))

    # --- operations helpers -----------------------------------------------------

    def count_after(self, after: Position) -> int:
        """Rows strictly after ``after`` (the lag in rows). Costs a range count.

        Counts every visible row, including rows the visibility guard still
        withholds: they are pending, just not consumable yet.
        """
        with self._connections.open(f"count on {self.name}") as conn:
            return int(conn.execute(self._keyset.count(after)).scalar_one())

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        """Keys of rows whose cursor is NULL: they have no place in cursor order."""
        with self._connections.open(f"NULL-cursor probe on {self.name}") as conn:
            return [dict(r) for r in conn.execute(self._keyset.null_probe(limit)).mappings()]

    def numbers_before_text_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        """Keys of rows an SQLite date/time cursor holds as numbers beside text
        (sorted before every text: behind a text checkpoint, never fetched)."""
        stmt = self._keyset.numbers_among_text_probe(limit)
        if stmt is None:
            return []
        with self._connections.open(f"number-cursor probe on {self.name}") as conn:
            return [dict(r) for r in conn.execute(stmt).mappings()]
