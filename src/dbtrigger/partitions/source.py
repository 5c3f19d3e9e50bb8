"""``PartitionSource``: the rows of one bucket range of a ``SqlAlchemySource``.

The range is a condition on the server (the stored ``dbt_bucket`` column when
the table has one, otherwise the hash expression), ANDed to the keyset query,
so the fetch keeps its shape and order. A merged partition also carries
*floors*: for each parent's bucket range, rows at or below the parent's own
checkpoint are excluded with the source's own typed keyset comparison, so
nothing the parent delivered is delivered again, and nothing is skipped.

Every fetched row's bucket is recomputed in Python; a disagreement with the
database is refused (:func:`~dbtrigger.partitions.buckets.check_rows`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql import ColumnElement

from dbtrigger.cursor import Position
from dbtrigger.errors import DbTriggerError
from dbtrigger.events import RowChange
from dbtrigger.partitions.buckets import (
    BUCKET_COLUMN,
    SQLITE_FUNCTION,
    check_rows,
    padded_columns,
    server_encoding,
    sql_bucket,
    sqlite_bucket,
    zerofill_columns,
)
from dbtrigger.partitions.layout import Floor, Partition
from dbtrigger.sources.keyset import Keyset
from dbtrigger.sources.lag import LagReading
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.sources.visibility import FetchInfo


def _register_sqlite_function(engine: sa.Engine) -> None:
    """Give every SQLite connection of ``engine`` the bucket function, once each."""
    if engine.dialect.name != "sqlite" or engine.__dict__.get("_dbt_bucket_listener"):
        return

    def on_checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        del proxy
        if not record.info.get(SQLITE_FUNCTION):
            dbapi_conn.create_function(SQLITE_FUNCTION, 1, sqlite_bucket, deterministic=True)
            record.info[SQLITE_FUNCTION] = True

    sa.event.listen(engine, "checkout", on_checkout)
    engine.__dict__["_dbt_bucket_listener"] = True


class PartitionSource:
    """One partition of ``base``: same table, same keyset, only buckets ``[lo, hi)``.

    Events are identified under ``poller`` (the partitioned poller's own name,
    not the partition's), so a row state keeps its ``event_id`` and dedup key
    when the partition count changes.
    """

    def __init__(
        self,
        base: SqlAlchemySource,
        partition: Partition,
        *,
        poller: str,
        floors_now: Callable[[], tuple[Floor, ...]] | None = None,
    ) -> None:
        self.base = base
        self.partition = partition
        self.poller = poller
        # A merged partition's floors, read again before every fetch until the
        # checkpoint has passed them: an operator's reset of the partition drops
        # them from the layout first, and a fetch after it must not skip rows.
        self._floors_now = floors_now if partition.floors else None
        self._inner = base.derive(self._condition)
        self._fingerprint: str | None = None
        self._padded: frozenset[str] = frozenset()  # learnt with the table's shape
        if base.dialect_name == "sqlite":
            # Before any statement of ours runs, not when the first one is built.
            _register_sqlite_function(base.engine)

    def _bucket(self, keyset: Keyset) -> ColumnElement[Any]:
        columns = keyset.columns
        if BUCKET_COLUMN in columns:
            return columns[BUCKET_COLUMN]
        engine = self.base.engine
        _register_sqlite_function(engine)
        quote = engine.dialect.identifier_preparer.quote
        encoding = server_encoding(engine) if keyset.dialect == "postgresql" else None
        return sa.literal_column(
            sql_bucket(
                keyset.dialect,
                self.pk_columns,
                quote,
                encoding=encoding,
                zerofill=zerofill_columns(keyset.dialect, keyset.columns, self.pk_columns),
            )
        )

    def _condition(self, keyset: Keyset) -> ColumnElement[bool]:
        self._padded = padded_columns(keyset.dialect, keyset.columns, self.pk_columns)
        bucket = self._bucket(keyset)
        part = self.partition
        condition = sa.and_(bucket >= part.lo, bucket < part.hi)
        if part.lo == 0:
            # A NULL key hashes to NULL in SQL (MariaDB's CONCAT_WS skips it instead):
            # in no range, every partition would go past the row without a word. The
            # first partition fetches it, and to_events refuses it as the plain poller
            # does (SerializationError, naming the row).
            condition = sa.or_(condition, bucket.is_(None))
        for floor in part.floors:
            in_floor = sa.and_(bucket >= floor.lo, bucket < floor.hi)
            beyond = keyset.after_predicate(floor.position)
            condition = sa.and_(condition, sa.or_(sa.not_(in_floor), beyond))
        return condition

    # --- identity ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The base source's: the rows' source is the table, and events name it
        (``RowChange.source``, ``ctx.source_name``) whatever the layout; the
        bucket range is in :meth:`describe` and in the partition poller's name."""
        return self.base.name

    @property
    def cursor_column(self) -> str:
        return self.base.cursor_column

    @property
    def pk_columns(self) -> tuple[str, ...]:
        return self.base.pk_columns

    def fingerprint(self) -> str:
        """The base source's, plus the bucket range (floors are transient, not identity)."""
        if self._fingerprint is None:
            material = f"{self.base.fingerprint()}|buckets:{self.partition.lo}-{self.partition.hi}"
            self._fingerprint = "sha256:" + hashlib.sha256(material.encode()).hexdigest()
        return self._fingerprint

    def describe(self) -> dict[str, Any]:
        info = self.base.describe()
        info.update(name=self.name, buckets=[self.partition.lo, self.partition.hi])
        if self.partition.floors:
            info["floors"] = len(self.partition.floors)
        return info

    def close(self) -> None:
        """The pool belongs to the base source; nothing of our own to release."""

    @property
    def last_fetch_info(self) -> FetchInfo | None:
        return self._inner.last_fetch_info

    def _current_floors(self, after: Position) -> None:
        """Follow the layout's floors of this partition (only ever removed in place).

        Floors matter only below them: once the checkpoint is at or past every floor,
        no row after it is excluded by one, so they are dropped here without asking
        the store, and the store is not read again before each fetch. A reset that
        moves the checkpoint back below them later can only repeat rows then, as the
        reset asks (it drops them from the layout too).
        """
        if self._floors_now is None:
            return
        floors = () if self._floors_passed(after) else self._floors_now()
        if floors != self.partition.floors:
            self.partition = Partition(self.partition.lo, self.partition.hi, floors)
            self._inner = self.base.derive(self._condition)
        if not floors:
            self._floors_now = None

    def _floors_passed(self, after: Position) -> bool:
        """``after`` is at or past every floor (in Python's order of the values).

        Where Python's order and the database's differ (a collation), a floor taken
        as passed too early only repeats rows the parent delivered, never skips one.
        """
        tiebreak = tuple(c for c in self.pk_columns if c != self.cursor_column)
        try:
            mark = (after.cursor, *after.pk_tuple(tiebreak))
            return all(
                mark >= (f.position.cursor, *f.position.pk_tuple(tiebreak))
                for f in self.partition.floors
            )
        except (TypeError, DbTriggerError):  # a NULL cursor, the beginning: ask the store
            return False

    # --- the port --------------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        self._current_floors(after)
        rows = self._inner.fetch(after, limit)
        check_rows(
            rows,
            self.pk_columns,
            self.partition.lo,
            self.partition.hi,
            self.name,
            padded=self._padded,
        )
        return rows

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        del poller  # the partition trigger's name; ids use the partitioned poller's
        return self._inner.to_events(rows, poller=self.poller, batch_id=batch_id)

    def count_after(self, after: Position) -> int:
        self._current_floors(after)
        return self._inner.count_after(after)

    def row_age(self, row: Mapping[str, Any], now: dt.datetime) -> LagReading:
        """How old a fetched row is, by the base source's basis (lag column or cursor)."""
        return self._inner.row_age(row, now)

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """``lag_seconds`` of this partition once its checkpoint is at ``after``."""
        return self._inner.lag_after(after, now)

    def present(self, positions: Sequence[Position]) -> list[Position]:
        """Which of ``positions`` still hold a row of this partition."""
        return self._inner.present(positions)

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        return self._inner.null_cursor_keys(limit)
