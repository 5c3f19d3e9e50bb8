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
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import NoSuchTableError, SQLAlchemyError
from sqlalchemy.sql import ColumnElement, Select

from dbtrigger.cursor import Position, canonical_json, encode_value
from dbtrigger.errors import (
    ConfigurationError,
    FetchError,
    SerializationError,
)
from dbtrigger.events import RowChange, make_event_id
from dbtrigger.names import validate_sql_identifier
from dbtrigger.settings import resolve_setting

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
        self._engine_kwargs = dict(engine_kwargs or {})
        try:
            self._url = make_url(resolve_setting(url)) if url else engine.url  # type: ignore[union-attr]
        except sa.exc.ArgumentError as exc:
            raise ConfigurationError(f"not a valid database URL: {exc}") from None
        self._engine = engine
        self._lock = threading.Lock()
        self._selectable: sa.FromClause | None = None
        self._columns: dict[str, ColumnElement[Any]] = {}
        self._select_list: list[ColumnElement[Any]] = []
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
        }

    # --- engine and shape -------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    kwargs = {"pool_pre_ping": True, **self._engine_kwargs}
                    self._engine = sa.create_engine(self._url, **kwargs)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()

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

    # --- the port ---------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> list[Mapping[str, Any]]:
        try:
            with self.engine.connect() as conn:
                self._resolve_shape(conn)
                result = conn.execute(self._statement(after, limit)).mappings().all()
                return cast("list[Mapping[str, Any]]", list(result))
        except (ConfigurationError, SerializationError):
            raise
        except SQLAlchemyError as exc:
            raise FetchError(f"fetch from {self.name} failed: {short_error(exc)}") from exc

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        events: list[RowChange] = []
        cursor_name = self._cursor_column
        pk_names = self._pk_columns
        source = self.name
        meta = {"poller": poller, "batch_id": batch_id}
        for row in rows:
            try:
                cursor = row[cursor_name]
                pk = {c: row[c] for c in pk_names}
            except KeyError as exc:
                raise SerializationError(
                    f"row from {source} lacks column {exc.args[0]!r}; it has {sorted(row)}",
                    poller=poller,
                    batch_id=batch_id,
                ) from None
            if any(v is None for v in pk.values()):
                raise SerializationError(
                    f"row from {source} has a NULL primary key {pk!r}; keys must be unique and set",
                    poller=poller,
                    batch_id=batch_id,
                )
            event_id = make_event_id(poller, pk, cursor)  # raises SerializationError on bad types
            events.append(
                RowChange(
                    event_id=event_id,
                    op="upsert",
                    source=source,
                    cursor=cursor,
                    pk=pk,
                    before=None,
                    after=dict(row),
                    metadata=meta,
                )
            )
        return events

    # --- operations helpers -----------------------------------------------------

    def count_after(self, after: Position) -> int:
        """Rows strictly after ``after`` (the lag in rows). Costs a range count."""
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
