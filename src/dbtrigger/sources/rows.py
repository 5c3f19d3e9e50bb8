"""Reading a fetched batch at the speed of the driver, and turning it into events.

A catch-up reads every row of a backlog once, so whatever is done per row sets
its speed. The floor is the bare driver: a keyset query whose rows come back as
tuples. This module keeps the poller close to it:

* :func:`read_rows` takes the row tuples straight from the DB-API cursor of the
  executed statement, skipping SQLAlchemy's ``Row`` objects. Values stay
  exactly what SQLAlchemy would have returned: where a column type has a result
  processor (SQLite dates and decimals, MySQL booleans, JSON text, enums) it is
  applied, column by column; where the driver's own value is already the
  column's value (most PostgreSQL types) nothing is done at all.
* :class:`Rows` is the batch as the source port returns it: a sequence of
  mappings to whoever reads it as one (a guard's report, ``health``, tests),
  while :func:`rows_to_events` wraps the tuples in lazy events directly.

A value the dialect cannot convert (an SQLite ``DATETIME`` column holding
``'yesterday'``) is a :class:`~dbtrigger.errors.SerializationError` naming the
column and the row's key, never a bare ``ValueError`` out of a tick.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from itertools import groupby
from typing import Any, overload

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult, Dialect
from sqlalchemy.sql import Select

from dbtrigger.errors import SerializationError
from dbtrigger.events import RowChange, RowShape, events_from_rows

Processor = Callable[[Any], Any]


def plain_types(types: Iterable[Any]) -> bool:
    """Do these column types (SQLAlchemy types of a reflected table) only ever
    yield values that cannot be changed in place? Numbers, strings, booleans,
    dates, times, UUIDs and binary do; JSON, arrays, hstore, MySQL
    ``SET``, anything unknown (query mode's ``NullType``) and any type that
    processes values its own way (a ``TypeDecorator``) may not."""
    return all(_plain_type(t) for t in types)


def _plain_type(kind: Any) -> bool:
    if isinstance(kind, sa.types.TypeDecorator) or type(kind).__name__ == "SET":
        return False  # MySQL SET (a String) yields a Python set
    return isinstance(kind, _PLAIN_TYPES)


_PLAIN_TYPES = (
    sa.Integer,
    sa.Numeric,
    sa.Float,  # and Double
    sa.String,  # and Text, Unicode, Enum
    sa.Boolean,
    sa.Date,
    sa.DateTime,
    sa.Time,
    sa.LargeBinary,
    sa.Uuid,
)


class Rows(Sequence[Mapping[str, Any]]):
    """A fetched batch: column names and one tuple per row, in column order.

    Reading it as a sequence of mappings builds a dict per row read (so equal
    to a list of dicts with the same content); :func:`rows_to_events` uses the
    tuples as they are. ``plain``: every column's type yields values that
    cannot be changed in place (:func:`plain_types`), so
    the events' reads need not guard against a nested value.
    """

    __slots__ = ("columns", "plain", "tuples", "types")

    def __init__(
        self, columns: Sequence[str], tuples: list[tuple[Any, ...]], *, plain: bool = False
    ) -> None:
        self.columns = tuple(columns)
        self.tuples = tuples
        self.plain = plain
        #: Column index -> the types of that column's values in ``tuples``, for
        #: the columns the source's check of the batch scanned (the events' check
        #: takes them instead of scanning again); set once, with the tuples final.
        self.types: dict[int, set[type]] | None = None

    def __len__(self) -> int:
        return len(self.tuples)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [dict(zip(self.columns, row, strict=True)) for row in self.tuples[index]]
        return dict(zip(self.columns, self.tuples[index], strict=True))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        columns = self.columns
        for row in self.tuples:
            yield dict(zip(columns, row, strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Rows):
            return self.columns == other.columns and self.tuples == other.tuples
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({list(self)!r})"


class _Direct:
    """A reusable statement compiled once, to run on the driver's own cursor."""

    __slots__ = ("bind_processors", "columns", "compiled", "sql", "stmt")

    def __init__(self, stmt: Select[Any], dialect: Dialect, columns: Sequence[str]) -> None:
        self.stmt = stmt  # keeps the statement alive: plans are keyed by its id
        self.compiled = stmt.compile(dialect=dialect)
        self.sql = self.compiled.string
        self.columns = tuple(columns)
        escaped = getattr(self.compiled, "escaped_bind_names", None) or {}
        self.bind_processors: dict[str, Processor] = {}
        for bind, name in self.compiled.bind_names.items():
            proc = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if proc is not None:
                self.bind_processors[escaped.get(name, name)] = proc

    def parameters(self, params: Mapping[str, Any] | None) -> MutableMapping[str, Any]:
        values = self.compiled.construct_params(dict(params) if params else None)
        for name, proc in self.bind_processors.items():
            if name in values:
                values[name] = proc(values[name])
        return values


class ResultProcessors:
    """What reading a source's rows needs beyond the driver, worked out once.

    * The result processors SQLAlchemy would apply to the selected columns,
      computed from their types for the dialect and the cursor's type codes
      exactly as SQLAlchemy's own result machinery does (the same for every
      fetch of one source, so kept per set of type codes).
    * For a statement executed again and again with new values (the keyset
      statement, see ``SqlAlchemySource._keyset``) on psycopg: its compiled
      SQL, so later fetches go to the driver's cursor directly. SQLAlchemy's
      execution path (cache lookup, execution context, result metadata) costs
      about as much as a hundred rows; it still runs the first execution, and
      every statement with anything compiled per execution, and every
      statement on an engine whose statement events are listened to.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], list[Processor | None]] = {}
        self._direct: dict[int, _Direct] = {}
        self._plain: dict[int, tuple[Select[Any], bool]] = {}

    def for_result(
        self, stmt: Select[Any], dialect: Dialect, codes: tuple[Any, ...]
    ) -> list[Processor | None]:
        """The result processors for ``stmt``'s columns, given the driver's type
        codes of the result (``cursor.description``'s second field)."""
        found = self._cache.get(codes)
        if found is None:
            types = [c.type for c in stmt.selected_columns]
            found = [
                t.dialect_impl(dialect).result_processor(dialect, code)
                for t, code in zip(types, codes, strict=True)
            ]
            if len(self._cache) > 16:
                self._cache.clear()
            self._cache[codes] = found
        return found

    def plain(self, stmt: Select[Any]) -> bool:
        """Do ``stmt``'s column types only yield values that cannot be changed
        in place (see :func:`plain_types`)? Kept per statement."""
        key = id(stmt)
        found = self._plain.get(key)
        if found is None or found[0] is not stmt:
            if len(self._plain) > 32:
                self._plain.clear()
            found = self._plain[key] = (stmt, plain_types(c.type for c in stmt.selected_columns))
        return found[1]

    def direct(self, stmt: Select[Any], dialect: Dialect) -> _Direct | None:
        plan = self._direct.get(id(stmt))
        return plan if plan is not None and plan.stmt is stmt else None

    def learn_direct(self, stmt: Select[Any], dialect: Dialect, columns: Sequence[str]) -> None:
        """After a first execution through SQLAlchemy: run ``stmt`` directly from now on,
        if the driver and the compiled statement allow it."""
        if dialect.name != "postgresql" or dialect.driver != "psycopg":
            return
        plan = _Direct(stmt, dialect, columns)
        if plan.compiled.literal_execute_params or plan.compiled.post_compile_params:
            return  # parts of it are rendered per execution
        if len(self._direct) > 32:
            self._direct.clear()
        self._direct[id(stmt)] = plan


def read_rows(
    conn: Connection,
    stmt: Select[Any],
    params: Mapping[str, Any] | None,
    processors: ResultProcessors,
    *,
    source: str,
    key_columns: Sequence[str],
    reused: bool = False,
) -> Rows:
    """Execute ``stmt`` and read all its rows as driver tuples (processed where needed).

    ``reused``: the statement object will be executed again with other values
    (it may then run on the driver's cursor directly, see :class:`ResultProcessors`).

    Raises:
        SerializationError: a value the dialect cannot convert, naming the
            column and the row's key.
        sqlalchemy.exc.DBAPIError: the driver failed while reading the rows
            (wrapped as SQLAlchemy wraps errors of its own fetches).
    """
    dialect = conn.dialect
    dbapi_error = dialect.loaded_dbapi.Error
    plan = processors.direct(stmt, dialect) if reused and not _observed(conn) else None
    try:
        if plan is not None:
            columns = plan.columns
            codes, raw = _execute_direct(conn, plan, params)
        else:
            result: CursorResult[Any] = conn.execute(stmt, dict(params) if params else None)
            try:
                cursor = result.cursor
                codes = tuple(d[1] for d in cursor.description)
                columns = tuple(result.keys())
                raw = cursor.fetchall()
            finally:
                result.close()
            if reused:
                processors.learn_direct(stmt, dialect, columns)
    except dbapi_error as exc:
        # What SQLAlchemy's own fetch would raise, so callers classify it the same way.
        wrapped = sa.exc.DBAPIError.instance(None, None, exc, dbapi_error, dialect=dialect)
        raise wrapped from exc
    except sa.exc.SQLAlchemyError:
        raise
    except Exception as exc:  # a driver's value loader failed outside its error tree
        raise SerializationError(
            f"rows from {source} cannot be read: the database driver failed to convert a "
            f"value ({type(exc).__name__}: {exc})"
        ) from exc
    if not raw:
        return Rows(columns, [])
    plain = processors.plain(stmt)
    active = [
        (index, proc)
        for index, proc in enumerate(processors.for_result(stmt, dialect, codes))
        if proc is not None
    ]
    if not active:
        # The common PostgreSQL case: the driver's values are the columns' values.
        return Rows(columns, raw if isinstance(raw, list) else list(raw), plain=plain)
    by_column: list[Sequence[Any]] = list(zip(*raw, strict=True))
    for index, proc in active:
        try:
            by_column[index] = list(map(proc, by_column[index]))
        except Exception as exc:  # noqa: BLE001 - any conversion failure is reported, naming the row
            _raise_unreadable(raw, columns, index, proc, exc, source, key_columns)
    return Rows(columns, list(zip(*by_column, strict=True)), plain=plain)


def _observed(conn: Connection) -> bool:
    """True when statement events are listened to (tracing, logging, tests): then
    every statement goes through SQLAlchemy, so its listeners see them all."""
    dispatch = conn.dispatch
    return bool(
        dispatch.before_execute
        or dispatch.after_execute
        or dispatch.before_cursor_execute
        or dispatch.after_cursor_execute
    )


def _execute_direct(
    conn: Connection, plan: _Direct, params: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], Sequence[tuple[Any, ...]]]:
    """Run a compiled statement on the connection's driver cursor; (type codes, rows).

    The psycopg cursor is kept with the pooled connection and used again by
    the next fetch on it (making one costs a fifth of a one-row fetch); it
    holds the latest result until the next execution, i.e. one batch. The type
    codes are read from the result itself, without building
    ``cursor.description``'s column objects.
    """
    fairy = conn.connection
    dbapi_connection: Any = fairy.dbapi_connection
    cursor = fairy.info.get(_CURSOR_KEY)
    if cursor is None or cursor.closed or cursor.connection is not dbapi_connection:
        cursor = fairy.info[_CURSOR_KEY] = dbapi_connection.cursor()
    try:
        cursor.execute(plan.sql, plan.parameters(params))
        rows = cursor.fetchall()
        result = cursor.pgresult
        return tuple(result.ftype(i) for i in range(result.nfields)), rows
    except BaseException as exc:
        # Its state is unknown now: the next fetch makes a new one.
        fairy.info.pop(_CURSOR_KEY, None)
        lost = isinstance(exc, conn.dialect.loaded_dbapi.Error) and conn.dialect.is_disconnect(
            exc, dbapi_connection, cursor
        )
        cursor.close()
        if lost:
            conn.invalidate()  # as SQLAlchemy does: the pool must not hand it out again
        raise


#: Where a pooled connection keeps the driver cursor the direct path reuses.
_CURSOR_KEY = "dbtrigger_direct_cursor"


def _raise_unreadable(
    raw: Sequence[tuple[Any, ...]],
    columns: Sequence[str],
    index: int,
    proc: Processor,
    first: Exception,
    source: str,
    key_columns: Sequence[str],
) -> None:
    """Find the row whose value in column ``index`` does not convert; raise naming it."""
    where = {name: i for i, name in enumerate(columns)}
    for row in raw:
        try:
            proc(row[index])
        except Exception as exc:  # this is the row being looked for
            key = {c: row[where[c]] for c in key_columns if c in where}
            raise SerializationError(
                f"row from {source} with key {key!r} cannot be read: column "
                f"{columns[index]!r} holds {row[index]!r}, which the database driver "
                f"cannot convert ({type(exc).__name__}: {exc}). Fix or remove the value, "
                "or select the column cast to text",
                column=columns[index],
                key=key,
            ) from exc
    raise SerializationError(  # a conversion that failed once and then did not
        f"rows from {source} cannot be read: column {columns[index]!r}: "
        f"{type(first).__name__}: {first}",
        column=columns[index],
    ) from first


def rows_to_events(
    rows: Sequence[Mapping[str, Any]],
    *,
    cursor_column: str,
    pk_columns: Sequence[str],
    source: str,
    poller: str,
    batch_id: str,
) -> list[RowChange]:
    """One lazy ``upsert`` event per row (see :func:`dbtrigger.events.events_from_rows`).

    :class:`Rows` are wrapped as they are; any other mappings (a test's dicts,
    a wrapping source) are turned into tuples first, one shape per run of rows
    with the same columns.

    Raises:
        SerializationError: a missing key or cursor column, a NULL key, or a
            key or cursor value with no checkpoint encoding; naming the row.
    """

    def shape_for(columns: Sequence[str], plain: bool = False) -> RowShape:
        # What the batches of one poller share is worked out once (see _shapes).
        key = (tuple(columns), plain, cursor_column, tuple(pk_columns), source, poller)
        shape = _shapes.get(key)
        if shape is not None:
            return shape.for_batch(batch_id)
        shape = RowShape(
            columns,
            cursor_column=cursor_column,
            pk_columns=pk_columns,
            source=source,
            poller=poller,
            batch_id=batch_id,
            plain=plain,
        )
        if len(_shapes) >= 64:
            _shapes.clear()
        _shapes[key] = shape
        return shape

    if isinstance(rows, Rows):
        if not rows.tuples:
            return []
        return events_from_rows(shape_for(rows.columns, rows.plain), rows.tuples, rows.types)
    events: list[RowChange] = []
    for columns, run in groupby(rows, key=tuple):
        tuples = [tuple(row[c] for c in columns) for row in run]
        events.extend(events_from_rows(shape_for(columns), tuples))
    return events


#: The shapes of the batches last made, by their columns, key and cursor, source and
#: poller: a batch's shape is one of these for its batch id (RowShape.for_batch).
_shapes: dict[tuple[Any, ...], RowShape] = {}


def _is_marked(mark: Any, value: Any) -> bool:
    """Soft-delete test: equal to ``value`` if one is configured, else set and not false/0.

    A boolean or integer flag column (``is_deleted``) is deleted when true; a
    timestamp column (``deleted_at``) when it holds any value.
    """
    if value is not None:
        return bool(mark == value)
    return mark is not None and mark is not False and not (isinstance(mark, int) and mark == 0)


def mark_deletes(events: list[RowChange], column: str, value: Any) -> list[RowChange]:
    """Soft deletes: an event whose row has ``column`` marked (see :func:`_is_marked`)
    becomes ``op="delete"`` with the row as ``before`` and no ``after``."""
    out: list[RowChange] = []
    for event in events:
        row = event.after or {}
        if not _is_marked(row.get(column), value):
            out.append(event)
            continue
        out.append(
            RowChange(
                event_id=event.event_id,
                op="delete",
                source=event.source,
                cursor=event.cursor,
                pk=event.pk,
                before=event.after,
                after=None,
                metadata=event.metadata,
            )
        )
    return out
