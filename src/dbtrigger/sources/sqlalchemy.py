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

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import NoSuchTableError, SQLAlchemyError
from sqlalchemy.sql import ColumnElement, Select

from dbtrigger._driver_errors import encoding_problem, short_error
from dbtrigger._engine import LazyEngine, parse_database_url, permanent_problem
from dbtrigger.cursor import Position, encode_value
from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    FetchError,
    MissingSettingError,
    SerializationError,
    SourceDefinitionError,
)
from dbtrigger.events import RowChange
from dbtrigger.names import validate_sql_identifier
from dbtrigger.redaction import safe_url_text
from dbtrigger.sources import lag as lagmod
from dbtrigger.sources.clock import DatabaseClock
from dbtrigger.sources.column_checks import ShapeChecks
from dbtrigger.sources.errors_map import source_error
from dbtrigger.sources.fingerprint import legacy_fingerprint, source_fingerprint
from dbtrigger.sources.lag import LagReading, ObservedLag
from dbtrigger.sources.rows import ResultProcessors, Rows, read_rows, rows_to_events
from dbtrigger.sources.visibility import (
    ActiveGuard,
    FetchCondition,
    FetchInfo,
    GuardDescription,
    GuardTarget,
    NoGuard,
    VisibilityGuard,
    choose,
    is_auto_increment,
    parse_visibility,
)
from dbtrigger.sources.visibility.base import BOUND_PARAMETER

log = logging.getLogger("dbtrigger.sources")

#: Dialects whose SQL compares row values: ``(a, b) > (x, y)``.
ROW_VALUE_DIALECTS = frozenset({"postgresql", "mysql", "mariadb", "sqlite"})


def _is_marked(mark: Any, value: Any) -> bool:
    """Soft-delete test: equal to ``value`` if one is configured, else set and not false/0.

    A boolean or integer flag column (``is_deleted``) is deleted when true; a
    timestamp column (``deleted_at``) when it holds any value.
    """
    if value is not None:
        return bool(mark == value)
    return mark is not None and mark is not False and not (isinstance(mark, int) and mark == 0)


#: Tuples per statement of a window lookup (:meth:`SqlAlchemySource.present`).
_LOOKUP_CHUNK = 100


def _bind_name(column: str) -> str:
    """The parameter a keyset statement binds a position's value of ``column`` to."""
    return "dbtrigger_after_" + column


def _aware(value: Any) -> bool:
    """Part of a position's shape: an aware and a naive timestamp may bind differently."""
    return getattr(value, "tzinfo", None) is not None


#: An extra condition a derived source adds, built from the resolved source.
RowFilter = Callable[["SqlAlchemySource"], ColumnElement[bool]]


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
        deleted_column: soft deletes: a row whose value in this column is set
            (not NULL and not false) is delivered as ``op="delete"`` with the
            row in ``before`` (see ``docs/changes.md``).
        deleted_value: with ``deleted_column``, the value that means deleted
            (e.g. ``deleted_column="status", deleted_value="deleted"``).
        lag_column: a timestamp column (``created_at``) whose value on the
            oldest undelivered row gives ``lag_seconds`` when the cursor carries
            no time (an integer or decimal cursor). Defaults to the
            ``time_column`` of a ``SafetyWindow`` guard. Without either such a
            cursor's lag is *observed* (see :mod:`dbtrigger.sources.lag`). Not
            part of the fingerprint: it changes no row's delivery.
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
        deleted_column: str | None = None,
        deleted_value: Any = None,
        lag_column: str | None = None,
    ) -> None:
        # Every constructor argument, so derive() can build a twin of this source.
        self._config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
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
        if len(set(self._pk_columns)) != len(self._pk_columns):
            raise ConfigurationError(f"pk_columns names a column twice: {list(self._pk_columns)}")
        # The key columns that break ties between equal cursors. A cursor that is
        # itself the key (an append-only table polled by its id) has none: the
        # keyset collapses to ``id > :id``.
        self._tiebreak = tuple(c for c in self._pk_columns if c != self._cursor_column)
        self._where = where
        self._parameters = dict(parameters or {})
        if deleted_value is not None and deleted_column is None:
            raise ConfigurationError("deleted_value needs deleted_column")
        self._deleted_column = (
            validate_sql_identifier(deleted_column, "deleted_column") if deleted_column else None
        )
        self._deleted_value = deleted_value
        self._url_spec = url
        self._url_value: URL | None = None if url else engine.url  # type: ignore[union-attr]
        if url:
            # A %SETTING% that is missing is reported at first use, not here: in a
            # Function App one missing setting must not stop every function indexing.
            with contextlib.suppress(MissingSettingError):
                self._url_value = parse_database_url(url)
        self._engines = LazyEngine(lambda: self._url, engine_kwargs, engine)
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
        self._templates: dict[tuple[Any, ...], Select[Any]] = {}
        self._guarded: dict[
            tuple[Any, ...], tuple[ColumnElement[bool], Select[Any], Select[Any]]
        ] = {}
        self._processors = ResultProcessors()
        self._autocommit: Engine | None = None
        self._row_filters: tuple[RowFilter, ...] = ()
        # Built on first use: the URL (and so the dialect) may be an app setting
        # that is only resolved then.
        self._checks_built: ShapeChecks | None = None
        self._clock_built: DatabaseClock | None = None
        window_column = getattr(self._visibility, "time_column", None)
        self._lag_column = (
            validate_sql_identifier(lag_column, "lag_column") if lag_column else window_column
        )
        self._observed_lag = ObservedLag()
        self._lag_measured_at = float("-inf")

    @property
    def _checks(self) -> ShapeChecks:
        if self._checks_built is None:
            self._checks_built = ShapeChecks(
                dialect=self.dialect_name,
                source=self.name,
                cursor_column=self._cursor_column,
                pk_columns=self._pk_columns,
            )
        return self._checks_built

    @property
    def _clock(self) -> DatabaseClock:
        if self._clock_built is None:
            self._clock_built = DatabaseClock(lambda: self._engines.engine, self.dialect_name)
        return self._clock_built

    def derive(self, row_filter: RowFilter) -> SqlAlchemySource:
        """A twin of this source that only sees rows passing ``row_filter``.

        The twin shares this source's connection pool and resolves its own
        shape and visibility guard. ``row_filter`` is called with the twin once
        its columns are resolved and returns a condition ANDed to every
        statement (fetch, count, NULL probe, guard). Partitioned polling uses it
        to read one range of buckets; the twin's fingerprint is this source's,
        so the caller adds the filter to its own identity.
        """
        twin = SqlAlchemySource(**self._config)
        twin._engines = self._engines
        twin._row_filters = (*self._row_filters, row_filter)
        return twin

    @property
    def _url(self) -> URL:
        """The database URL, ``%SETTING%`` references resolved (at the first use)."""
        if self._url_value is None:
            self._url_value = parse_database_url(self._url_spec or "")
        return self._url_value

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

        How the database is *reached* is not part of it either (driver, port
        written out, loopback spelling, TLS options, password): see
        :mod:`dbtrigger.sources.fingerprint`.
        """
        return source_fingerprint(url=self._url, **self._definition())

    def accepted_fingerprints(self) -> tuple[str, ...]:
        """Fingerprints a stored document may carry for this very definition.

        The current one first, then the one the previous algorithm gave the
        same configuration: a document written before the connection-only
        normalisation is still this poller's and must not be refused. A commit
        writes :meth:`fingerprint`, so the older value disappears on its own.
        """
        legacy = legacy_fingerprint(safe_url=self.safe_url, **self._definition())
        return (self.fingerprint(), legacy)

    def _definition(self) -> dict[str, Any]:
        definition: dict[str, Any] = {
            "schema": self._schema,
            "table": self._table_name,
            "query": self._query,
            "cursor_column": self._cursor_column,
            "pk_columns": self._pk_columns,
            "where": self._where,
            "parameters": self._parameters,
        }
        if self._deleted_column is not None:
            # Only when set, so the fingerprints of sources without it do not change.
            definition["deleted"] = [self._deleted_column, list(encode_value(self._deleted_value))]
        return definition

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
            "lag_column": self._lag_column,
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

    @contextlib.contextmanager
    def _connect(self, engine: Engine | None = None) -> Iterator[Connection]:
        """``engine.connect()``, a driver failure outside the DB-API tree mapped.

        Every statement of the source runs on a connection from here. The one
        such failure known (a PostgreSQL database in ``SQL_ASCII``, where the
        dialect's first connection raises ``TypeError``) is an operator error
        naming the fix (:func:`~dbtrigger.sources.errors_map.encoding_problem`),
        never a raw exception out of a tick.
        """
        try:
            conn = (engine or self.engine).connect()
        except TypeError as exc:
            problem = encoding_problem(exc)
            if problem is None:
                raise
            raise SourceDefinitionError(f"connecting to {self.name} failed: {problem}") from exc
        with conn:
            yield conn

    def _base_filter(self) -> ColumnElement[bool] | None:
        conditions: list[ColumnElement[bool] | sa.TextClause] = [
            row_filter(self) for row_filter in self._row_filters
        ]
        if self._where:
            clause = sa.text(self._where)
            names = set(clause._bindparams)
            params = {k: v for k, v in self._parameters.items() if k in names}
            conditions.insert(0, clause.bindparams(**params))
        if not conditions:
            return None
        return sa.and_(sa.true(), *conditions)

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
            probed = conn.execute(probe)
            keys = list(probed.keys())
            description = probed.cursor.description if probed.cursor is not None else None
            probed.close()
            selectable = text.columns(*(sa.column(k) for k in keys)).subquery("dbtrigger_src")
        columns: dict[str, ColumnElement[Any]] = {c.name: c for c in selectable.c}
        required = (self._cursor_column, *self._pk_columns)
        if self._deleted_column is not None:
            required = (*required, self._deleted_column)
        missing = [c for c in required if c not in columns]
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
        if isinstance(selectable, sa.Table):
            self._checks.table_reflected(
                selectable,
                compared_as_text=self._text_typed,
                is_view=lambda: self._is_view(conn),
                sql_dialect=conn.dialect,
            )
        else:
            self._checks.query_probed(description)
        self._columns = columns
        self._selectable = selectable
        self._select_list = [
            columns[c.name].label(c.name) if columns[c.name] is not c else c for c in selectable.c
        ]

    def _is_view(self, conn: Connection) -> bool:
        names = sa.inspect(conn).get_view_names(schema=self._schema)
        return self._table_name in names

    def _sample_position(self, conn: Connection) -> Mapping[str, Any] | None:
        """One row's position columns (any row with a cursor), to learn their kinds."""
        names = self._checks.position_columns
        cursor = self._columns[self._cursor_column]
        stmt = self._select().with_only_columns(*(self._columns[n].label(n) for n in names))
        row = conn.execute(stmt.where(cursor.is_not(None)).limit(1)).mappings().first()
        return dict(row) if row is not None else None

    def _check_position(self, conn: Connection, after: Position) -> None:
        """Refuse a checkpoint whose values no longer fit their columns' types."""
        if after.is_beginning:
            return
        checks = self._checks
        if checks.needs_sample:
            checks.learn_from_sample(lambda: self._sample_position(conn))
        values = {self._cursor_column: after.cursor}
        pk = after.pk
        for name in self._tiebreak:
            if name in pk:
                values[name] = pk[name]
        checks.check_position(values)

    def validate(self, position: Position | None = None) -> None:
        """Reflect and check the definition now, as the first fetch would; fetch nothing.

        Raises what the first fetch would raise for the definition (missing
        table or columns, a lossy cursor/key type, keys not proven unique, a
        database or permission error) and, given the stored ``position``, a
        checkpoint whose kinds no longer fit the columns. ``dbtrigger check``
        and worker start-up call it.
        """
        try:
            with self._connect() as conn:
                self._resolve_shape(conn)
                if position is not None:
                    self._check_position(conn, position)
        except SQLAlchemyError as exc:
            # Worded as the first fetch words it (a start-up check may be the
            # only place an operator reads it): the diagnosis first.
            problem = permanent_problem(exc)
            error = source_error(exc, f"checking {self.name}", problem)
            if problem is not None and isinstance(error, FetchError):
                raise ConfigurationError(
                    f"checking {self.name} failed: {problem} ({short_error(exc)}); "
                    "fix the source configuration"
                ) from exc
            raise error from exc

    def reflected_table(self) -> sa.Table | None:
        """The reflected table (None in query mode, or before :meth:`validate`/a fetch)."""
        return self._selectable if isinstance(self._selectable, sa.Table) else None

    @property
    def uniqueness_note(self) -> str | None:
        """Why ``(cursor, pk)`` uniqueness is unproven though polling goes on (a view), or None."""
        return self._checks.unverified_unique

    def planned_guard(self) -> VisibilityGuard | None:
        """The visibility guard in force, or the one ``auto`` will choose (after reflection).

        None in query mode off PostgreSQL until a row shows the cursor's type.
        """
        if self._guard is not None:
            return self._guard.guard
        request = self._visibility
        if isinstance(request, VisibilityGuard):
            return request
        if self._cursor_type is None and self.dialect_name != "postgresql":
            return None
        return choose(
            self.dialect_name,
            cursor_type=self._cursor_type,
            cursor_comment=self._cursor_comment,
            sample_is_timestamp=None,
        )

    def cursor_age_seconds(self, cursor: Any, now: dt.datetime) -> float | None:
        """How old ``cursor`` is at ``now`` (aware UTC): the ``lag_seconds`` of a checkpoint.

        Aware timestamps are compared with ``now``; naive ones (and SQLite's
        date/time text) with the database's own wall clock, whose offset to UTC
        is read once every five minutes (:class:`~dbtrigger.sources.clock.DatabaseClock`).
        None for cursors that carry no time (integers, decimals).
        """
        try:
            return self._clock.age_seconds(cursor, now)
        except SQLAlchemyError as exc:
            raise source_error(exc, f"reading the clock of {self.name}") from exc

    # --- lag in seconds (sources/lag.py) -----------------------------------------------

    def lag_basis(self, *, resolve: bool = False) -> str | None:
        """How ``lag_seconds`` is measured: ``cursor``, ``column:<name>`` or ``observed``.

        None while the cursor's type is unknown (before reflection), unless
        ``resolve`` (then the table is reflected now; errors give None).
        """
        if self._lag_column is not None:
            return lagmod.column_basis(self._lag_column)
        kind: str | None = None
        if self._selectable is not None or resolve:
            try:
                kind = self.cursor_kind()
            except DbTriggerError:
                return None
        if isinstance(self._cursor_type, sa.DateTime):  # SQLite's DATETIME compares as text
            return lagmod.CURSOR
        if kind is None:
            return None
        return lagmod.CURSOR if kind in ("timestamp", "naive_timestamp") else lagmod.OBSERVED

    def row_age(self, row: Mapping[str, Any], now: dt.datetime) -> LagReading:
        """How old a fetched row is: its lag column, else its cursor (``observed``: None)."""
        if self._lag_column is not None:
            basis = lagmod.column_basis(self._lag_column)
            return LagReading(self._age(row.get(self._lag_column), now), basis)
        age = self._age(row.get(self._cursor_column), now)
        return LagReading(age, lagmod.CURSOR if age is not None else lagmod.OBSERVED)

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """``lag_seconds`` with the checkpoint at ``after`` (called after each commit).

        A timestamp cursor is aged as it is (no query). Otherwise one keyset
        query reads the oldest undelivered row (and, with no lag column, the
        newest row for :class:`~dbtrigger.sources.lag.ObservedLag`), at most
        once a second; None in between (the gauge keeps its value).
        """
        if self._lag_column is None:
            age = self._age(after.cursor, now)
            if age is not None:
                return LagReading(age, lagmod.CURSOR)
        started = time.monotonic()
        if started - self._lag_measured_at < lagmod.MEASURE_INTERVAL_SECONDS:
            return None
        self._lag_measured_at = started
        try:
            with self._connect() as conn:
                self._resolve_shape(conn)
                return self._measure_lag(conn, after, now)
        except SQLAlchemyError as exc:
            raise source_error(exc, f"measuring the lag of {self.name}") from exc
        except (ValueError, TypeError, ArithmeticError) as exc:
            # A value the driver cannot convert (an SQLite DATETIME holding
            # text, a MariaDB zero date) in the lag column or the keys.
            raise SerializationError(
                f"measuring the lag of {self.name} failed: a value of the oldest pending row "
                f"cannot be read ({type(exc).__name__}: {exc}); lag_seconds is not updated "
                "until that row is delivered or fixed"
            ) from exc

    def _measure_lag(self, conn: Connection, after: Position, now: dt.datetime) -> LagReading:
        cursor = self._columns[self._cursor_column]
        keys = [cursor, *(self._columns[c] for c in self._tiebreak)]
        if self._lag_column is not None:
            column = self._columns.get(self._lag_column)
            if column is None:
                raise ConfigurationError(
                    f"lag_column {self._lag_column!r} is not a column of {self.name}"
                )
            oldest = self._statement(after, 1).with_only_columns(column.label("lag"))
            row = conn.execute(oldest).first()
            basis = lagmod.column_basis(self._lag_column)
            if row is None:
                return LagReading(0.0, basis)  # nothing pending
            return LagReading(self._age(row[0], now), basis)
        first = conn.execute(self._statement(after, 1).with_only_columns(*keys)).first()
        newest = None
        if first is not None:
            last = (
                self._select()
                .with_only_columns(*keys)
                .where(cursor.is_not(None))
                .order_by(*(k.desc() for k in keys))
                .limit(1)
            )
            newest = conn.execute(last).first()
        seconds = self._observed_lag.observe(
            now,
            tuple(first) if first is not None else None,
            tuple(newest) if newest is not None else None,
        )
        return LagReading(seconds, lagmod.OBSERVED)

    def _age(self, value: Any, now: dt.datetime) -> float | None:
        if value is None:
            return None
        try:
            return self._clock.age_seconds(value, now)
        except SQLAlchemyError as exc:
            raise source_error(exc, f"reading the clock of {self.name}") from exc

    def cursor_kind(self) -> str | None:
        """The checkpoint kind the cursor column's values take (None: not known yet).

        What ``reset --to-cursor`` should parse a typed value as when there is
        no stored checkpoint to copy the kind from. From the declared type in
        table mode; in query mode from one row (None while the source is empty).
        """
        return self.column_kinds()[self._cursor_column]

    def column_kinds(self) -> dict[str, str | None]:
        """:meth:`cursor_kind` for the cursor and every key column."""
        try:
            with self._connect() as conn:
                self._resolve_shape(conn)
                self._checks.learn_from_sample(lambda: self._sample_position(conn))
                return dict(self._checks.primary)
        except SQLAlchemyError as exc:
            raise source_error(exc, f"reading the column types of {self.name}") from exc

    def _typed(
        self, name: str, value: Any, *, named: bool = False, param: str | None = None
    ) -> ColumnElement[Any]:
        """``value`` bound for comparison with column ``name``.

        ``named``: a parameter named after the column (see :meth:`_keyset`),
        so the statement can be executed again with other values of the same
        Python type; ``param``: a parameter of that name; otherwise an
        anonymous literal.
        """
        column = self._columns[name]
        type_: Any = None  # query mode: no declared types; the value's own type binds
        if name in self._text_typed and type(value) in (int, float):
            pass  # a number SQLite stored in a date/time column: compared as that number
        elif name in self._text_typed and not isinstance(value, str):
            # A position given as a date/time (e.g. `reset --to-cursor`) rather than
            # read from a row: render it the way SQLAlchemy stores it on SQLite.
            type_ = self._text_typed[name]
        elif self._table_name is not None:
            type_ = column.type
        if named or param is not None:
            return sa.bindparam(param or _bind_name(name), value, type_=type_)
        return sa.literal(value, type_=type_)

    def _after_predicate(self, after: Position, *, named: bool = False) -> ColumnElement[bool]:
        cols = [self._columns[self._cursor_column], *(self._columns[c] for c in self._tiebreak)]
        vals = [
            self._typed(self._cursor_column, after.cursor, named=named),
            *(
                self._typed(c, v, named=named)
                for c, v in zip(self._tiebreak, after.pk_tuple(self._tiebreak), strict=True)
            ),
        ]
        if len(cols) == 1:
            return cols[0] > vals[0]
        if self.dialect_name in ROW_VALUE_DIALECTS:
            keyset = sa.tuple_(*cols) > sa.tuple_(*vals)
            if self.dialect_name in ("mysql", "mariadb"):
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

    def _select(self) -> Select[Any]:
        stmt = sa.select(*self._select_list)
        base = self._base_filter()
        return stmt.where(base) if base is not None else stmt

    def _key_order(self) -> list[ColumnElement[Any]]:
        return [self._columns[c] for c in self._pk_columns]

    def _statement(self, after: Position, limit: int, *, named: bool = False) -> Select[Any]:
        cursor = self._columns[self._cursor_column]
        stmt = self._select().where(cursor.is_not(None))
        if not after.is_beginning:
            if after.cursor is None:
                raise SerializationError("a checkpoint position needs a cursor value, got NULL")
            stmt = stmt.where(self._after_predicate(after, named=named))
        return stmt.order_by(cursor, *(self._columns[c] for c in self._tiebreak)).limit(limit)

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
            bind_bound=lambda value: self._typed(self._cursor_column, value, param=BOUND_PARAMETER),
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
            # Text that julianday() reads. julianday() also takes a bare number
            # as a Julian day, so without the typeof() test an integer cursor
            # passed for a timestamp and got a window that held every value
            # above today's day number (2.46 million) back for good.
            probe = sa.and_(
                sa.func.typeof(cursor) == "text", sa.func.julianday(cursor).is_not(None)
            )
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
                conn=conn,  # MariaDB/MySQL: may the account read INNODB_TRX?
                auto_increment=is_auto_increment(self._guard_target()),
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

    def describe_guard(self) -> GuardDescription:
        """Which visibility guard is in force and what an exact one needs (``check``).

        Decides ``auto`` now if no fetch has yet (it connects; on MariaDB/MySQL
        it checks the PROCESS privilege). While ``auto`` cannot decide (query
        mode, no row yet) the mode is ``auto``.
        """
        try:
            with self._connect() as conn:
                self._resolve_shape(conn)
                guard = self._active_guard(conn)
        except SQLAlchemyError as exc:
            raise source_error(exc, f"describing {self.name}") from exc
        if guard is None:
            return GuardDescription("auto", "none", "undecided until a row has a cursor value")
        return guard.describe_guard()

    # --- the port ---------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> Rows:
        """Up to ``limit`` rows after ``after`` that the visibility guard lets through.

        The guard's predicate joins the keyset statement; some guards run a
        short statement first (each in its own transaction) and one after (for
        reporting only). The row read always starts a fresh transaction, so its
        snapshot is never older than the guard's bound.

        The rows come back as the driver's tuples (:class:`~dbtrigger.sources.rows.Rows`),
        processed only where SQLAlchemy would process them. Without a guard on
        PostgreSQL the read runs in autocommit: one statement, one round trip,
        instead of ``BEGIN``, the query and ``ROLLBACK``.
        """
        try:
            with self._connect(self._fetch_engine()) as conn:
                self._resolve_shape(conn)
                self._check_position(conn, after)
                guard = self._active_guard(conn)
                if conn.in_transaction():
                    conn.rollback()
                if guard is None:
                    return Rows(self._select_names(), [])
                condition: Any = guard.before_fetch(conn, after)
                if condition is not None and not isinstance(condition, FetchCondition):
                    condition = FetchCondition(condition)  # a guard that returns a bare predicate
                stmt, params, reused = self._keyset(after, limit, condition)
                rows = read_rows(
                    conn,
                    stmt,
                    params,
                    self._processors,
                    source=self.name,
                    key_columns=self._pk_columns,
                    reused=reused,
                )
                self._checks.check_rows(rows.columns, rows.tuples)
                self.last_fetch_info = guard.after_fetch(conn, after, rows, limit)
                return rows
        except (ConfigurationError, SerializationError):
            raise
        except SQLAlchemyError as exc:
            problem = permanent_problem(exc)
            error = source_error(exc, f"fetch from {self.name}", problem)
            if problem is not None and isinstance(error, FetchError):
                raise ConfigurationError(
                    f"fetch from {self.name} failed: {problem} ({short_error(exc)}); "
                    "fix the source configuration"
                ) from exc
            raise error from exc

    def _fetch_engine(self) -> Engine:
        """The engine for fetches: on PostgreSQL in autocommit once the guard is
        known not to need a transaction (every statement its own snapshot, taken
        when it starts: after the guard's own reads)."""
        guard = self._guard
        if guard is None or not guard.autocommit_reads or self.dialect_name != "postgresql":
            return self.engine
        if self._autocommit is None:
            self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        return self._autocommit

    def _select_names(self) -> list[str]:
        return [c.name for c in self._select_list]

    def _keyset(
        self, after: Position, limit: int, condition: FetchCondition | None = None
    ) -> tuple[Select[Any], dict[str, Any] | None, bool]:
        """The keyset statement for ``after`` (and the guard's ``condition``), the
        values to execute it with, and whether that statement object is reused.

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
            values = {self._cursor_column: after.cursor, **after.pk}
            params = {_bind_name(name): value for name, value in values.items()}
            signature = (limit, *((n, type(v), _aware(v)) for n, v in values.items()))
        stmt = self._templates.get(signature)
        if stmt is None:
            stmt = self._statement(after, limit, named=True)
            if len(self._templates) > 32:
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
            if len(self._guarded) > 32:
                self._guarded.clear()
            self._guarded[key] = (predicate, stmt, guarded)
        params.update(condition.params)
        return guarded, params or None, reused

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """One ``upsert`` event per row (raises ``SerializationError`` naming the row).

        Events are built lazily over the fetched tuples (see
        :func:`dbtrigger.sources.rows.rows_to_events`): the key, the ``after``
        mapping and the event id are made when first read.
        """
        events = rows_to_events(
            rows,
            cursor_column=self._cursor_column,
            pk_columns=self._pk_columns,
            source=self.name,
            poller=poller,
            batch_id=batch_id,
        )
        if self._deleted_column is not None:
            return self._mark_deletes(events)
        return events

    def _mark_deletes(self, events: list[RowChange]) -> list[RowChange]:
        """Soft deletes: a row whose mark is set becomes ``delete`` with itself as ``before``."""
        column, value = self._deleted_column, self._deleted_value
        out: list[RowChange] = []
        for event in events:
            row = event.after or {}
            if not _is_marked(row.get(column) if column else None, value):
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

    def present(self, positions: Sequence[Position]) -> list[Position]:
        """Which of ``positions`` still hold a row of this source (its filter
        applies), as the rows read now: the settled window's lookup of entries
        a read could not place (:class:`~dbtrigger.sources.base.LocatesRows`).

        An equality per tuple, ORed, in chunks: served by the ``(cursor, pk)``
        index, and correct for any collation (equality, unlike order, is what
        a unique key already promises).
        """
        if not positions:
            return []
        found: list[Position] = []
        try:
            with self.engine.connect() as conn:
                self._resolve_shape(conn)
                cursor = self._columns[self._cursor_column]
                keys = [self._columns[c] for c in self._tiebreak]
                for start in range(0, len(positions), _LOOKUP_CHUNK):
                    matches = [
                        sa.and_(
                            cursor == self._typed(self._cursor_column, p.cursor),
                            *(
                                column == self._typed(name, value)
                                for column, name, value in zip(
                                    keys, self._tiebreak, p.pk_tuple(self._tiebreak), strict=True
                                )
                            ),
                        )
                        for p in positions[start : start + _LOOKUP_CHUNK]
                    ]
                    stmt = (
                        self._select()
                        .with_only_columns(cursor, *self._key_order())
                        .where(sa.or_(*matches))
                    )
                    rows = conn.execute(stmt).mappings()
                    found += [self._position_of(cast(Mapping[str, Any], r)) for r in rows]
                    conn.rollback()
        except SQLAlchemyError as exc:
            raise source_error(exc, f"window lookup on {self.name}") from exc
        return found

    # --- operations helpers -----------------------------------------------------

    def count_after(self, after: Position) -> int:
        """Rows strictly after ``after`` (the lag in rows). Costs a range count.

        Counts every visible row, including rows the visibility guard still
        withholds: they are pending, just not consumable yet.
        """
        try:
            with self._connect() as conn:
                self._resolve_shape(conn)
                sub = self._statement(after, 1).limit(None).order_by(None).subquery()
                return int(conn.execute(sa.select(sa.func.count()).select_from(sub)).scalar_one())
        except SQLAlchemyError as exc:
            raise source_error(exc, f"count on {self.name}") from exc

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]:
        """Keys of rows whose cursor is NULL: they have no place in cursor order."""
        try:
            with self._connect() as conn:
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
            raise source_error(exc, f"NULL-cursor probe on {self.name}") from exc


__all__ = ["ROW_VALUE_DIALECTS", "SqlAlchemySource"]
