"""The SQL of a keyset source: every statement it runs, built from its shape.

The fetch is ``WHERE (cursor, pk...) > (:cursor, :pk...) ORDER BY cursor,
pk... LIMIT :n``. With a composite index on ``(cursor, pk)`` every fetch is an
index range scan that costs O(batch), however deep into the table the
checkpoint is. PostgreSQL, MySQL/MariaDB and SQLite compare row values
natively; on other dialects the predicate is expanded into the equivalent
``OR`` chain. Values are always bound, typed with the column's own SQL type in
table mode (so a timestamp is compared as a timestamp, never as text).

Rows whose cursor is NULL have no place in cursor order: every statement here
leaves them out, and :meth:`Keyset.null_probe` finds them for the warning.

Statements are only built here; running them (and mapping what the driver
raises) is the source's (:mod:`dbtrigger.sources.sqlalchemy`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement, Select

from dbtrigger.cursor import Position
from dbtrigger.errors import SerializationError
from dbtrigger.sources.shape import Shape, bind_name
from dbtrigger.sources.visibility import FetchCondition

#: Dialects whose SQL compares row values: ``(a, b) > (x, y)``.
ROW_VALUE_DIALECTS = frozenset({"postgresql", "mysql", "mariadb", "sqlite"})

#: Tuples per statement of a window lookup (:meth:`Keyset.lookups`).
LOOKUP_CHUNK = 100

#: Statements kept per cache before it is emptied (shapes of position, predicates).
_CACHE_LIMIT = 32

#: An extra condition a derived source adds, built from the twin's resolved keyset.
RowFilter = Callable[["Keyset"], ColumnElement[bool]]


def _aware(value: Any) -> bool:
    """Part of a position's shape: an aware and a naive timestamp may bind differently."""
    return getattr(value, "tzinfo", None) is not None


class Keyset:
    """The statements of one source over its :class:`~dbtrigger.sources.shape.Shape`.

    ``row_filters`` are conditions a derived source ANDs to every statement
    (fetch, count, NULL probe, lookup, guard): partitioned polling reads one
    range of buckets this way. Built once the shape is resolved.
    """

    def __init__(self, shape: Shape, row_filters: Sequence[RowFilter] = ()) -> None:
        self.shape = shape
        self.spec = shape.spec
        self.dialect = shape.dialect
        self._row_filters = tuple(row_filters)
        self._templates: dict[tuple[Any, ...], Select[Any]] = {}
        self._guarded: dict[
            tuple[Any, ...], tuple[ColumnElement[bool], Select[Any], Select[Any]]
        ] = {}

    @property
    def columns(self) -> dict[str, ColumnElement[Any]]:
        return self.shape.columns

    @property
    def cursor(self) -> ColumnElement[Any]:
        return self.shape.columns[self.spec.cursor_column]

    def select_names(self) -> list[str]:
        return [c.name for c in self.shape.select_list]

    def base_filter(self) -> ColumnElement[bool] | None:
        """``where=``, the derived sources' filters and the table's identity, ANDed
        (None: no filter)."""
        conditions: list[ColumnElement[bool] | sa.TextClause] = [
            row_filter(self) for row_filter in self._row_filters
        ]
        if self.spec.where:
            conditions.insert(0, self.spec.bound_parameters(sa.text(self.spec.where)))
        same_table = self.shape.identity.predicate()
        if same_table is not None:
            conditions.append(same_table)
        if not conditions:
            return None
        return sa.and_(sa.true(), *conditions)

    def select(self) -> Select[Any]:
        stmt = sa.select(*self.shape.select_list)
        base = self.base_filter()
        return stmt.where(base) if base is not None else stmt

    def key_order(self) -> list[ColumnElement[Any]]:
        return [self.columns[c] for c in self.spec.pk_columns]

    def after_predicate(self, after: Position, *, named: bool = False) -> ColumnElement[bool]:
        """``(cursor, tiebreak...) > after``, in the form the dialect can use as a range."""
        typed, tiebreak = self.shape.typed, self.spec.tiebreak
        cols = [self.cursor, *(self.columns[c] for c in tiebreak)]
        vals = [
            typed(self.spec.cursor_column, after.cursor, named=named),
            *(
                typed(c, v, named=named)
                for c, v in zip(tiebreak, after.pk_tuple(tiebreak), strict=True)
            ),
        ]
        if len(cols) == 1:
            return cols[0] > vals[0]
        if self.dialect in ROW_VALUE_DIALECTS:
            keyset = sa.tuple_(*cols) > sa.tuple_(*vals)
            if self.dialect in ("mysql", "mariadb"):
                # MariaDB/MySQL do not turn a row-value comparison into an index
                # range: without the redundant leading bound every fetch scans
                # the (cursor, pk) index from its start (measured: a full index
                # scan at 100k rows, ~118 ms a fetch), growing with the table.
                return sa.and_(cols[0] >= vals[0], keyset)
            return keyset
        # (c0 > v0) OR (c0 = v0 AND c1 > v1) OR ...
        branches = []
        for i in range(len(cols)):
            equal = [cols[j] == vals[j] for j in range(i)]
            branches.append(sa.and_(*equal, cols[i] > vals[i]))
        return sa.or_(*branches)

    def statement(self, after: Position, limit: int, *, named: bool = False) -> Select[Any]:
        """The rows after ``after`` in cursor order, at most ``limit`` of them."""
        stmt = self.select().where(self.cursor.is_not(None))
        if not after.is_beginning:
            if after.cursor is None:
                raise SerializationError("a checkpoint position needs a cursor value, got NULL")
            stmt = stmt.where(self.after_predicate(after, named=named))
        order = (self.columns[c] for c in self.spec.tiebreak)
        return stmt.order_by(self.cursor, *order).limit(limit)

    def pending(self, after: Position) -> Select[Any]:
        """Every row after ``after``, unordered and unlimited (counts, guards)."""
        return self.statement(after, 1).order_by(None).limit(None)

    def fetch_statement(
        self, after: Position, limit: int, condition: FetchCondition | None = None
    ) -> tuple[Select[Any], dict[str, Any] | None, bool]:
        """The fetch for ``after`` (and the guard's ``condition``), the values to
        execute it with, and whether that statement object is reused.

        Building and hashing a statement costs more than a small batch's rows,
        so one statement with named parameters is built per shape of position
        (beginning or not, the Python types of its values, the limit) and
        reused; SQLAlchemy then finds its compiled form without re-walking it.
        A guard's predicate is added once per predicate object (a guard keeps
        returning the same one while only its bound moves, see
        :class:`~dbtrigger.sources.visibility.FetchCondition`); a statement
        counts as reused from its second fetch on, so a guard that makes a new
        predicate every time costs no more than before.
        """
        if after.is_beginning:
            signature: tuple[Any, ...] = (limit,)
            params: dict[str, Any] = {}
        else:
            values = {self.spec.cursor_column: after.cursor, **after.pk}
            params = {bind_name(name): value for name, value in values.items()}
            signature = (limit, *((n, type(v), _aware(v)) for n, v in values.items()))
        stmt = self._templates.get(signature)
        if stmt is None:
            stmt = self.statement(after, limit, named=True)
            if len(self._templates) > _CACHE_LIMIT:
                self._templates.clear()
            self._templates[signature] = stmt
        if condition is None:
            return stmt, params or None, True
        predicate = condition.predicate
        key = (signature, id(predicate))
        found = self._guarded.get(key)
        # The entry holds the predicate and the base statement, so neither id
        # can be taken by a new object while it exists; still, compare them.
        if found is not None and found[0] is predicate and found[1] is stmt:
            guarded, reused = found[2], True
        else:
            guarded, reused = stmt.where(predicate), False
            if len(self._guarded) > _CACHE_LIMIT:
                self._guarded.clear()
            self._guarded[key] = (predicate, stmt, guarded)
        params.update(condition.params)
        return guarded, params or None, reused

    def count(self, after: Position) -> Select[Any]:
        """How many rows are after ``after`` (a range count)."""
        sub = self.statement(after, 1).limit(None).order_by(None).subquery()
        return sa.select(sa.func.count()).select_from(sub)

    def null_probe(self, limit: int) -> Select[Any]:
        """Keys of rows whose cursor is NULL, in key order (an indexed ``IS NULL``)."""
        stmt = (
            sa.select(*self.key_order())
            .select_from(self.shape.selectable)  # type: ignore[arg-type]
            .where(self.cursor.is_(None))
            .order_by(*self.key_order())
            .limit(limit)
        )
        base = self.base_filter()
        return stmt.where(base) if base is not None else stmt

    def numbers_among_text_probe(self, limit: int) -> Select[Any] | None:
        """Keys of rows whose SQLite date/time cursor holds a number while others hold text.

        SQLite keeps a number written to a ``DATETIME`` column as a number and
        sorts every number before every text: once the checkpoint is text, such
        a row is behind it and no fetch reads it. ``< ''`` selects exactly the
        numbers through the cursor's index. None: not such a column (a column of
        numbers only is ordered like any number).
        """
        if self.dialect != "sqlite" or self.spec.cursor_column not in self.shape.text_typed:
            return None
        text = self.select().with_only_columns(sa.literal(1)).where(self.cursor >= "")
        stmt = (
            sa.select(*self.key_order())
            .select_from(self.shape.selectable)  # type: ignore[arg-type]
            .where(self.cursor < "", text.exists())
            .order_by(*self.key_order())
            .limit(limit)
        )
        base = self.base_filter()
        return stmt.where(base) if base is not None else stmt

    def lookups(self, positions: Sequence[Position]) -> list[Select[Any]]:
        """Statements returning which of ``positions`` still hold a row, in chunks.

        An equality per tuple, ORed: served by the ``(cursor, pk)`` index, and
        correct for any collation (equality, unlike order, is what a unique
        key already promises).
        """
        typed, tiebreak, cursor_column = (
            self.shape.typed,
            self.spec.tiebreak,
            self.spec.cursor_column,
        )
        keys = [self.columns[c] for c in tiebreak]
        statements = []
        for start in range(0, len(positions), LOOKUP_CHUNK):
            matches = [
                sa.and_(
                    self.cursor == typed(cursor_column, p.cursor),
                    *(
                        column == typed(name, value)
                        for column, name, value in zip(
                            keys, tiebreak, p.pk_tuple(tiebreak), strict=True
                        )
                    ),
                )
                for p in positions[start : start + LOOKUP_CHUNK]
            ]
            statements.append(
                self.select()
                .with_only_columns(self.cursor, *self.key_order())
                .where(sa.or_(*matches))
            )
        return statements

    def key_lookups(self, keys: Sequence[Mapping[str, Any]]) -> list[Select[Any]]:
        """Statements returning the rows (every column) with these key values, in chunks,
        wherever their cursor is now (a replay looking for rows that moved)."""
        typed, pk_columns = self.shape.typed, self.spec.pk_columns
        statements = []
        for start in range(0, len(keys), LOOKUP_CHUNK):
            matches = [
                sa.and_(*(self.columns[c] == typed(c, key[c]) for c in pk_columns))
                for key in keys[start : start + LOOKUP_CHUNK]
            ]
            statements.append(self.select().where(self.cursor.is_not(None), sa.or_(*matches)))
        return statements

    def sample_position(self) -> Select[Any]:
        """One row's position columns (any row with a cursor), to learn their kinds."""
        names = self.shape.checks.position_columns
        stmt = self.select().with_only_columns(*(self.columns[n].label(n) for n in names))
        return stmt.where(self.cursor.is_not(None)).limit(1)

    def sample_row(self, conn: Connection) -> dict[str, Any] | None:
        """:meth:`sample_position` read on ``conn`` (None while the source is empty)."""
        row = conn.execute(self.sample_position()).mappings().first()
        return dict(row) if row is not None else None

    def timestamp_probe(self) -> Select[Any]:
        """Whether the cursor holds timestamps, asked of one row (query mode has no types).

        :meth:`~dbtrigger.sources.shape.Shape.sample_says_timestamp` reads the answer.
        """
        probe: ColumnElement[Any] = self.cursor
        if self.dialect == "sqlite":
            # Text that julianday() reads. julianday() also takes a bare number
            # as a Julian day, so without the typeof() test an integer cursor
            # passed for a timestamp and got a window that held every value
            # above today's day number (2.46 million) back for good.
            probe = sa.and_(
                sa.func.typeof(self.cursor) == "text",
                sa.func.julianday(self.cursor).is_not(None),
            )
        return self.select().with_only_columns(probe).where(self.cursor.is_not(None)).limit(1)

    def position_keys(self) -> list[ColumnElement[Any]]:
        """The cursor and tiebreak columns: a position's values, in keyset order."""
        return [self.cursor, *(self.columns[c] for c in self.spec.tiebreak)]

    def newest(self, before: Any = None) -> Select[Any]:
        """The last row in keyset order (its position columns); with ``before``, the
        last whose cursor is below it (where a poller starting at ``before`` resumes)."""
        keys = self.position_keys()
        stmt = (
            self.select()
            .with_only_columns(*keys)
            .where(self.cursor.is_not(None))
            .order_by(*(k.desc() for k in keys))
            .limit(1)
        )
        if before is not None:
            stmt = stmt.where(self.cursor < self.shape.typed(self.spec.cursor_column, before))
        return stmt


__all__ = ["LOOKUP_CHUNK", "ROW_VALUE_DIALECTS", "Keyset", "RowFilter"]
