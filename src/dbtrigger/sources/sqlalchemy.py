"""Cursor polling over any database SQLAlchemy speaks.

The fetch is a keyset query: ``WHERE (cursor, pk...) > (:cursor, :pk...)
ORDER BY cursor, pk... LIMIT :n``. With a composite index on ``(cursor, pk)``
every fetch is an index range scan that costs O(batch), however deep into the
table the checkpoint is. PostgreSQL, MySQL/MariaDB and SQLite compare row values
natively; on other dialects the predicate is expanded into the equivalent
``OR`` chain.

Values are always bound, typed with the column's own SQL type in table mode
(so a timestamp is compared as a timestamp, never as text), and identifiers
from configuration are validated and quoted by SQLAlchemy.

NULL cursors: a row whose cursor is NULL has no place in cursor order, so the
keyset cannot deliver it exactly once in order, and delivering it on every tick
would be worse. Such rows are excluded from fetches and *reported*, never
dropped silently and never allowed to stall the poller:
:meth:`SqlAlchemySource.null_cursor_keys` finds them (an indexed ``IS NULL``
probe), and the poller sets the ``null_cursor_rows`` gauge and names their keys
in a warning. Once the row gets a cursor value it is delivered like any other.
The remedy is a ``NOT NULL`` cursor column with a default, or a query-mode
source selecting ``COALESCE(updated_at, created_at) AS cursor_ts``.

Late commits: a writer that takes a small cursor value and commits after a
writer with a larger one would land behind the checkpoint. The ``visibility=``
guard (:mod:`dbtrigger.sources.visibility`, on by default) adds one condition to
the fetch so only the settled part of the cursor order is consumed; the keyset
shape and its O(batch) index range scan are unchanged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import NoSuchTableError, SQLAlchemyError
from sqlalchemy.sql import ColumnElement, Select

from dbtrigger._engine import LazyEngine
from dbtrigger.cursor import Position, canonical_json, encode_value
from dbtrigger.errors import (
    ConfigurationError,
    FetchError,
    SerializationError,
)
from dbtrigger.events import EventIds, RowChange
from dbtrigger.names import validate_sql_identifier
from dbtrigger.settings import resolve_setting
from dbtrigger.sources.visibility import (
    ActiveGuard,
    FetchInfo,
    GuardTarget,
    NoGuard,
    VisibilityGuard,
    choose,
    parse_visibility,
)

log = logging.getLogger("dbtrigger.sources")

#: Dialects whose SQL compares row values: ``(a, b) > (x, y)``.
ROW_VALUE_DIALECTS = frozenset({"postgresql", "mysql", "mariadb", "sqlite"})

_SECRET_QUERY_KEYS = ("pass", "pwd", "secret", "token", "key", "credential", "sig")


def redact_url(url: URL) -> URL:
    """The URL without password and without query options that look like secrets."""
    query = {
        k: v for k, v in url.query.items() if not any(s in k.lower() for s in _SECRET_QUERY_KEYS)
    }
    return url.set(password=None, query=query)


def safe_url_text(url: URL) -> str:
    return redact_url(url).render_as_string(hide_password=True)


def short_error(exc: BaseException) -> str:
    """One line naming a driver error, without the SQL text or bound values."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{type(orig).__name__}: {first}"[:300]


class SqlAlchemySource:
    """Poll a table (or a query) by a monotonic cursor column plus its primary key.

    Args:
        url: SQLAlchemy URL; ``%APP_SETTING%`` references are resolved from the
            environment. The password never reaches logs or the fingerprint.
        table / schema: the table to poll (validated identifiers).
        query: alternatively, a SELECT whose result is polled (wrapped as a
            subquery; it must return the cursor and key columns).
        cursor_column: monotonic non-decreasing column (timestamp, sequence,
            rowversion...). Index ``(cursor_column, *pk_columns)``.
        pk_columns: stable, unique key columns; the tiebreaker for equal cursors.
        where: optional extra filter (SQL text from configuration, not user
            input); ``:name`` placeholders are bound from ``parameters``.
        engine_kwargs: passed to :func:`sqlalchemy.create_engine`.
        engine: share an existing engine instead of creating one (``url`` is
            then only used for the name and fingerprint, and may be omitted).
        visibility: how to avoid skipping rows of transactions that commit out
            of cursor order: ``"auto"`` (default: the strongest guard the
            dialect and cursor support, see ``docs/visibility.md``), ``"none"``,
            or a guard from :mod:`dbtrigger.sources.visibility`
            (``SnapshotHorizon()``, ``TransactionHorizon()``,
            ``SafetyWindow(seconds)``). After each fetch, :attr:`last_fetch_info`
            says what the guard did (horizon, held back, blocking backend).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        table: str | None = None,
        schema: str | None = None,
        query: str | None = None,
        cursor_column: str,
        pk_columns: Sequence[str],
        where: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        engine: Engine | None = None,
        visibility: str | VisibilityGuard = "auto",
    ) -> None:
        if (table is None) == (query is None):
            raise ConfigurationError("SqlAlchemySource needs exactly one of table= or query=")
        if isinstance(pk_columns, str):
            raise ConfigurationError("pk_columns must be a list of column names, not a string")
        if not pk_columns:
            raise ConfigurationError("pk_columns must name at least one column")
        if url is None and engine is None:
            raise ConfigurationError("SqlAlchemySource needs url= or engine=")
        self._table_name = validate_sql_identifier(table, "table") if table else None
        self._schema = validate_sql_identifier(schema, "schema") if schema else None
        self._query = query
        self._cursor_column = validate_sql_identifier(cursor_column, "cursor_column")
        self._pk_columns = tuple(validate_sql_identifier(c, "pk column") for c in pk_columns)
        if self._cursor_column in self._pk_columns:
            raise ConfigurationError("cursor_column must not also be a pk column")
        self._where = where
        self._parameters = dict(parameters or {})
        try:
            self._url = make_url(resolve_setting(url)) if url else engine.url  # type: ignore[union-attr]
        except sa.exc.ArgumentError as exc:
            raise ConfigurationError(f"not a valid database URL: {exc}") from None
        self._engines = LazyEngine(self._url, engine_kwargs, engine)
        self._lock = threading.Lock()
        self._selectable: sa.FromClause | None = None
        self._columns: dict[str, ColumnElement[Any]] = {}
        self._select_list: list[ColumnElement[Any]] = []
        self._cursor_type: sa.types.TypeEngine[Any] | None = None
        self._cursor_comment: str | None = None
        self._visibility = parse_visibility(visibility)
        self._guard: ActiveGuard | None = None
        #: What the visibility guard did on the latest fetch (None before one).
        self.last_fetch_info: FetchInfo | None = None
        self._text_typed: dict[str, sa.types.TypeEngine[Any]] = {}

    # --- identity ---------------------------------------------------------------

    @property
    def cursor_column(self) -> str:
        return self._cursor_column

    @property
    def pk_columns(self) -> tuple[str, ...]:
        return self._pk_columns

    @property
    def dialect_name(self) -> str:
        return self._url.get_backend_name()

    @property
    def name(self) -> str:
        target = self._table_name or "query"
        if self._schema:
            target = f"{self._schema}.{target}"
        return f"{self.dialect_name}:{target}"

    @property
    def safe_url(self) -> str:
        return safe_url_text(self._url)

    def fingerprint(self) -> str:
        """``sha256:`` of what a stored position means; secrets excluded.

        The visibility guard is deliberately *not* part of it. A guard only
        decides *when* a row may be consumed; it never changes which rows exist
        after a position, their order, or how a position is written. A
        checkpoint written with no guard is exactly as valid under a horizon or
        a window (and vice versa), so switching protection on must not force a
        reset. Changing the cursor to a transaction-id column does change the
        position's meaning, and ``cursor_column`` is in the fingerprint.
        """
        definition = {
            "url": self.safe_url,
            "schema": self._schema,
            "table": self._table_name,
            "query": self._query,
            "cursor_column": self._cursor_column,
            "pk_columns": list(self._pk_columns),
            "where": self._where,
            "parameters": {k: list(encode_value(v)) for k, v in sorted(self._parameters.items())},
        }
        digest = hashlib.sha256(canonical_json(definition).encode()).hexdigest()
        return f"sha256:{digest}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.safe_url,
            "table": self._table_name,
            "schema": self._schema,
            "query": self._query,
            "cursor_column": self._cursor_column,
            "pk_columns": list(self._pk_columns),
            "where": self._where,
            "row_value_predicate": self.dialect_name in ROW_VALUE_DIALECTS,
            "visibility": self.visibility_requested,
            "visibility_mode": self.visibility_mode,
            "visibility_guarantee": self.visibility_guarantee,
        }

    @property
    def visibility_requested(self) -> str:
        """The ``visibility=`` setting: ``auto`` or the configured guard's label."""
        request = self._visibility
        return request if isinstance(request, str) else request.label()

    @property
    def visibility_mode(self) -> str:
        """The guard in force. Under ``auto`` it is decided at the first fetch
        (it depends on the cursor column's type), ``auto`` until then."""
        if self._guard is not None:
            return self._guard.guard.label()
        return self.visibility_requested

    @property
    def visibility_guarantee(self) -> str | None:
        """What the guard in force promises (None while ``auto`` is undecided)."""
        if self._guard is not None:
            return self._guard.guarantee
        request = self._visibility
        return None if isinstance(request, str) else request.guarantee(self.dialect_name)

    # --- engine and shape -------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engines.engine

    def close(self) -> None:
        """Dispose of the connection pool if this source created the engine."""
        self._engines.dispose()

    def _base_filter(self) -> ColumnElement[bool] | None:
        if not self._where:
            return None
        clause = sa.text(self._where)
        names = set(clause._bindparams)
        params = {k: v for k, v in self._parameters.items() if k in names}
        return sa.and_(sa.true(), clause.bindparams(**params))

    def _resolve_shape(self, conn: Connection) -> None:
        """Reflect the table (or probe the query) once: column objects and types."""
        if self._selectable is not None:
            return
        if self._table_name is not None:
            try:
                selectable: sa.FromClause = sa.Table(
                    self._table_name, sa.MetaData(), schema=self._schema, autoload_with=conn
                )
            except NoSuchTableError:
                raise ConfigurationError(
                    f"table {self.name} does not exist (or is not visible to this user)"
                ) from None
        else:
            text = sa.text(self._query or "")
            names = set(text._bindparams)
            text = text.bindparams(**{k: v for k, v in self._parameters.items() if k in names})
            selectable = text.columns().subquery("dbtrigger_src")
            probe: Select[Any] = (
                sa.select(sa.literal_column("*")).select_from(selectable).where(sa.false())
            )
            keys = list(conn.execute(probe).keys())
            selectable = text.columns(*(sa.column(k) for k in keys)).subquery("dbtrigger_src")
        columns: dict[str, ColumnElement[Any]] = {c.name: c for c in selectable.c}
        missing = [c for c in (self._cursor_column, *self._pk_columns) if c not in columns]
        if missing:
            raise SerializationError(
                f"source {self.name} has no column(s) {', '.join(missing)}; "
                f"available: {', '.join(sorted(columns))}",
                missing_columns=missing,
            )
        if self._table_name is not None:
            declared = cast("sa.Column[Any]", columns[self._cursor_column])
            self._cursor_type = declared.type
            self._cursor_comment = declared.comment
        if self.dialect_name == "sqlite":
            # SQLite keeps dates and times as text in whatever format the writer
            # used and compares them as text. Re-formatting a parsed value (with
            # or without microseconds, 'T' or ' ') would compare wrongly and skip
            # rows, so key columns are read, compared and checkpointed verbatim.
            for name in (self._cursor_column, *self._pk_columns):
                column = columns[name]
                if isinstance(column.type, (sa.DateTime, sa.Date, sa.Time)):
                    self._text_typed[name] = column.type
                    columns[name] = sa.type_coerce(column, sa.String)
        self._columns = columns
        self._selectable = selectable
        self._select_list = [
            columns[c.name].label(c.name) if columns[c.name] is not c else c for c in selectable.c
        ]

    def _typed(self, name: str, value: Any) -> ColumnElement[Any]:
        column = self._columns[name]
        if name in self._text_typed and not isinstance(value, str):
            # A position given as a date/time (e.g. `reset --to-cursor`) rather than
            # read from a row: render it the way SQLAlchemy stores it on SQLite.
            return sa.literal(value, type_=self._text_typed[name])
        if self._table_name is not None:
            return sa.literal(value, type_=column.type)
        return sa.literal(value)  # query mode: no declared types; the value's own type binds

    def _after_predicate(self, after: Position) -> ColumnElement[bool]:
        cols = [self._columns[self._cursor_column], *(self._columns[c] for c in self._pk_columns)]
        vals = [
            self._typed(self._cursor_column, after.cursor),
            *(
                self._typed(c, v)
                for c, v in zip(self._pk_columns, after.pk_tuple(self._pk_columns), strict=False)
            ),
        ]
        if self.dialect_name in ROW_VALUE_DIALECTS:
            return sa.tuple_(*cols) > sa.tuple_(*vals)
        # (c0 > v0) OR (c0 = v0 AND c1 > v1) OR ...
        branches = []
        for i in range(len(cols)):
            equal = [cols[j] == vals[j] for j in range(i)]
            branches.append(sa.and_(*equal, cols[i] > vals[i]))
        return sa.or_(*branches)

    def _select(self) -> Select[Any]:
        stmt = sa.select(*self._select_list)
        base = self._base_filter()
        return stmt.where(base) if base is not None else stmt

    def _key_order(self) -> list[ColumnElement[Any]]:
        return [self._columns[c] for c in self._pk_columns]

    def _statement(self, after: Position, limit: int) -> Select[Any]:
        cursor = self._columns[self._cursor_column]
        stmt = self._select().where(cursor.is_not(None))
        if not after.is_beginning:
            if after.cursor is None:
                raise SerializationError("a checkpoint position needs a cursor value, got NULL")
            stmt = stmt.where(self._after_predicate(after))
        return stmt.order_by(cursor, *self._key_order()).limit(limit)

    # --- visibility guard ---------------------------------------------------------

    def _guard_target(self) -> GuardTarget:
        assert self._selectable is not None  # noqa: S101 - _resolve_shape ran first
        return GuardTarget(
            dialect=self.dialect_name,
            source_name=self.name,
            cursor_name=self._cursor_column,
            cursor=self._columns[self._cursor_column],
            cursor_type=self._cursor_type,
            cursor_comment=self._cursor_comment,
            columns=dict(self._columns),
            selectable=self._selectable,
            base_filter=self._base_filter(),
            bind=lambda value: self._typed(self._cursor_column, value),
            pending=lambda position: self._statement(position, 1).order_by(None).limit(None),
            position_of=self._position_of,
            table_mode=self._table_name is not None,
        )

    def _position_of(self, row: Mapping[str, Any]) -> Position:
        return Position(cursor=row[self._cursor_column], pk={c: row[c] for c in self._pk_columns})

    def _sample_is_timestamp(self, conn: Connection) -> bool | None:
        """Query mode has no declared types: look at one cursor value (None: no rows yet)."""
        cursor = self._columns[self._cursor_column]
        probe: ColumnElement[Any] = cursor
        if self.dialect_name == "sqlite":
            probe = sa.func.julianday(cursor).is_not(None)
        stmt = self._select().with_only_columns(probe).where(cursor.is_not(None)).limit(1)
        row = conn.execute(stmt).first()
        conn.rollback()
        if row is None:
            return None
        return bool(row[0]) if self.dialect_name == "sqlite" else isinstance(row[0], dt.datetime)

    def _active_guard(self, conn: Connection) -> ActiveGuard | None:
        """The guard bound to this source; None while ``auto`` cannot decide yet."""
        if self._guard is not None:
            return self._guard
        request = self._visibility
        if isinstance(request, VisibilityGuard):
            guard = request
        else:
            sample = None
            if self._cursor_type is None and self.dialect_name != "postgresql":
                sample = self._sample_is_timestamp(conn)
                if sample is None:
                    return None  # no row has a cursor yet; decide when one does
            guard = choose(
                self.dialect_name,
                cursor_type=self._cursor_type,
                cursor_comment=self._cursor_comment,
                sample_is_timestamp=sample,
            )
        active = guard.activate(self._guard_target())
        with self._lock:
            if self._guard is None:
                self._guard = active
        unprotected = isinstance(guard, NoGuard) and request == "auto"
        level = logging.WARNING if unprotected and self.dialect_name != "sqlite" else logging.INFO
        log.log(
            level,
            "%s: visibility %s (%s): %s",
            self.name,
            guard.label(),
            "auto" if request == "auto" else "configured",
            active.guarantee,
            extra={
                "event": "visibility_mode",
                "source": self.name,
                "mode": guard.label(),
                "requested": self.visibility_requested,
                "guarantee": active.guarantee,
            },
        )
        return self._guard

    # --- the port ---------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        """Up to ``limit`` rows after ``after`` that the visibility guard lets through.

        The guard's predicate joins the keyset statement; some guards run a
        short statement first (each in its own transaction) and one after (for
        reporting only). The row read always starts a fresh transaction, so its
        snapshot is never older than the guard's bound.
        """
        try:
            with self.engine.connect() as conn:
                self._resolve_shape(conn)
                guard = self._active_guard(conn)
                if conn.in_transaction():
                    conn.rollback()
                if guard is None:
                    return []
                predicate = guard.before_fetch(conn, after)
                stmt = self._statement(after, limit)
                if predicate is not None:
                    stmt = stmt.where(predicate)
                result = conn.execute(stmt)
                # Plain dicts: building them from the row tuples costs a third of
                # what RowMapping objects do, and to_events copies them at C speed.
                keys = tuple(result.keys())
                rows: list[Mapping[str, Any]] = [
                    dict(zip(keys, row, strict=True)) for row in result.all()
                ]
                self.last_fetch_info = guard.after_fetch(conn, after, rows, limit)
                return rows
        except (ConfigurationError, SerializationError):
            raise
        except SQLAlchemyError as exc:
            raise FetchError(f"fetch from {self.name} failed: {short_error(exc)}") from exc

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """One ``upsert`` event per row (raises ``SerializationError`` naming the row).

        This runs for every row delivered, so the per-row work is kept to what
        an event needs: the key dict, a copy of the row (the event's ``after``;
        the caller's row is never shared), the event id, and the event itself,
        built from parts made here for it alone (``RowChange._unchecked``).
        """
        events: list[RowChange] = []
        append = events.append
        cursor_name = self._cursor_column
        pk_names = self._pk_columns
        single_key = pk_names[0] if len(pk_names) == 1 else None
        source = self.name
        meta = MappingProxyType({"poller": poller, "batch_id": batch_id})
        event_id = EventIds(poller, pk_names)
        new_event = RowChange._unchecked
        for row in rows:
            try:
                cursor = row[cursor_name]
                if single_key is not None:
                    value = row[single_key]
                    pk = {single_key: value}
                    null_key = value is None
                else:
                    pk = {c: row[c] for c in pk_names}
                    null_key = any(v is None for v in pk.values())
            except KeyError as exc:
                raise SerializationError(
                    f"row from {source} lacks column {exc.args[0]!r}; it has {sorted(row)}",
                    poller=poller,
                    batch_id=batch_id,
                ) from None
            if null_key:
                raise SerializationError(
                    f"row from {source} has a NULL primary key {pk!r}; keys must be unique and set",
                    poller=poller,
                    batch_id=batch_id,
                )
            append(
                new_event(
                    event_id(pk, cursor),  # raises SerializationError on bad types
                    "upsert",
                    source,
                    cursor,
                    MappingProxyType(pk),
                    None,
                    MappingProxyType(dict(row)),
                    meta,
                )
            )
        return events

    # --- operations helpers -----------------------------------------------------

    def count_after(self, after: Position) -> int:
        """Rows strictly after ``after`` (the lag in rows). Costs a range count.

        Counts every visible row, including rows the visibility guard still
        withholds: they are pending, just not consumable yet.
        """
        try:
            with self.engine.connect() as conn:
                self._resolve_shape(conn)
                sub = self._statement(after, 1).limit(None).order_by(None).subquery()
                return int(conn.execute(sa.select(sa.func.count()).select_from(sub)).scalar_one())
        except SQLAlchemyError as exc:
            raise FetchError(f"count on {self.name} failed: {short_error(exc)}") from exc

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        """Keys of rows whose cursor is NULL: they have no place in cursor order."""
        try:
            with self.engine.connect() as conn:
                self._resolve_shape(conn)
                cursor = self._columns[self._cursor_column]
                stmt = (
                    sa.select(*self._key_order())
                    .select_from(self._selectable)  # type: ignore[arg-type]
                    .where(cursor.is_(None))
                    .order_by(*self._key_order())
                    .limit(limit)
                )
                base = self._base_filter()
                if base is not None:
                    stmt = stmt.where(base)
                return [dict(r) for r in conn.execute(stmt).mappings()]
        except SQLAlchemyError as exc:
            raise FetchError(
                f"NULL-cursor probe on {self.name} failed: {short_error(exc)}"
            ) from exc
