"""Cursor polling over any database SQLAlchemy speaks: the source's face.

``SqlAlchemySource`` reads a table (or a query) in keyset order: ``WHERE
(cursor, pk...) > (:cursor, :pk...) ORDER BY cursor, pk... LIMIT :n``, an index
range scan that costs O(batch) however deep the checkpoint is. This module is
the port (:class:`~dbtrigger.sources.base.SourceAdapter`) and the source's
identity; each job behind it has its own room:

* :mod:`dbtrigger.sources.shape` - the table's columns and types, reflected once;
* :mod:`dbtrigger.sources.keyset` - every statement (fetch, count, NULL probe,
  lookups), values always bound and typed with the column's own SQL type;
* :mod:`dbtrigger.sources.guarding` - which visibility guard is in force;
* :mod:`dbtrigger.sources.lag_meter` - ``lag_seconds``;
* :mod:`dbtrigger.sources.errors_map` - what a driver error means (a lock wait that ran
  out: :mod:`~dbtrigger.sources.lock_waits`), applied in ``SourceConnections.error``.

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
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from dbtrigger._database_url import DatabaseUrl
from dbtrigger._engine import LazyEngine
from dbtrigger._lock_wait import DEFAULT_WRITE_LOCK_TIMEOUT, check_lock_timeout
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, SerializationError, SourceDefinitionError
from dbtrigger.events import RowChange
from dbtrigger.names import validate_sql_identifier
from dbtrigger.redaction import safe_url_text
from dbtrigger.sources.clock import DatabaseClock
from dbtrigger.sources.connections import SourceConnections
from dbtrigger.sources.fingerprint import (
    Definition,
    previous_fingerprints,
    readable_definition,
    source_fingerprint,
)
from dbtrigger.sources.guarding import Guarding
from dbtrigger.sources.keyset import ROW_VALUE_DIALECTS, Keyset, RowFilter
from dbtrigger.sources.lag import LagReading
from dbtrigger.sources.lag_meter import LagMeter
from dbtrigger.sources.lock_waits import lock_wait_error
from dbtrigger.sources.lookups import KeysetLookups
from dbtrigger.sources.rows import ResultProcessors, Rows, mark_deletes, read_rows, rows_to_events
from dbtrigger.sources.shape import SourceSpec
from dbtrigger.sources.visibility import (
    FetchCondition,
    FetchInfo,
    GuardDescription,
    VisibilityGuard,
    parse_visibility,
)


class SqlAlchemySource(KeysetLookups):
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
            then only used for the name and fingerprint, and may be omitted);
            its settings are the caller's (``lock_timeout_seconds`` is not applied).
        lock_timeout_seconds: how long a statement on the engine made from ``url``
            waits for a lock (a read queued behind DDL on the table) before the fetch
            fails as a retryable ``FetchError``, unless the driver arguments set one.
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
        lock_timeout_seconds: float = DEFAULT_WRITE_LOCK_TIMEOUT,
    ) -> None:
        # Every constructor argument, so derive() can build a twin of this source.
        self._config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        if url is None and engine is None:
            raise ConfigurationError("SqlAlchemySource needs url= or engine=")
        self._spec = SourceSpec.validated(
            table=table,
            schema=schema,
            query=query,
            cursor_column=cursor_column,
            pk_columns=pk_columns,
            where=where,
            parameters=parameters,
            deleted_column=deleted_column,
            deleted_value=deleted_value,
        )
        self._deleted_value = deleted_value
        self._db_url = DatabaseUrl(url, engine)
        self._names: tuple[object, str, str] | None = None
        lock_wait = check_lock_timeout(lock_timeout_seconds)
        self._engines = LazyEngine(lambda: self._db_url.value, engine_kwargs, engine, lock_wait)
        self._guarding = Guarding(parse_visibility(visibility))
        window_column = getattr(self._guarding.request, "time_column", None)
        self._lag_column = (
            validate_sql_identifier(lag_column, "lag_column") if lag_column else window_column
        )
        self._row_filters: tuple[RowFilter, ...] = ()
        self._processors = ResultProcessors()
        #: What the visibility guard did on the latest fetch (None before one).
        self.last_fetch_info: FetchInfo | None = None
        # Built on first use: the URL (and so the dialect) may be an app setting
        # that is only resolved then.
        self._keyset_built: Keyset | None = None
        self._lag_built: LagMeter | None = None
        #: The source a twin (see :meth:`derive`) takes its table's shape from.
        self._shape_of: SqlAlchemySource | None = None
        #: Where every statement gets its connection, the one a catch-up keeps too.
        self._connections = SourceConnections(
            lambda: self.engine,
            lambda: self.name,
            lambda conn: self._keyset.shape.resolve(conn),  # noqa: PLW0108 - built on first use
            lambda exc, what: lock_wait_error(exc, what, self._engines, self._spec),
        )

    @property
    def _keyset(self) -> Keyset:
        """The source's statements over its shape (resolved on a connection's opening),
        built again over the newer shape once the table's columns changed."""
        keyset = self._keyset_built
        if keyset is None or keyset.shape.successor is not None:
            keyset = self._keyset_built = self._new_keyset(keyset)
        return keyset

    def _new_keyset(self, old: Keyset | None) -> Keyset:
        if old is not None:  # the columns changed: what was worked out for the old ones goes
            self._processors = ResultProcessors()
            return Keyset(old.shape.latest(), self._row_filters)
        from dbtrigger.sources.shape import Shape  # noqa: PLC0415 - keep the face light

        shape = (
            self._shape_of._keyset.shape
            if self._shape_of is not None
            else Shape(self._spec, dialect=self.dialect_name, source_name=self.name)
        )
        return Keyset(shape, self._row_filters)

    @property
    def _lag(self) -> LagMeter:
        if self._lag_built is None:
            clock = DatabaseClock(lambda: self._engines.engine, self.dialect_name)
            self._lag_built = LagMeter(self._lag_column, clock, source=self.name)
        return self._lag_built

    def derive(self, row_filter: RowFilter) -> SqlAlchemySource:
        """A twin of this source that only sees rows passing ``row_filter``.

        The twin shares this source's connection pool and its table's shape
        (reflected once for all twins: a partitioned poller's first round
        reflected the table once per partition, about ten queries each) and
        resolves its own visibility guard. ``row_filter`` is called with the twin's
        :class:`~dbtrigger.sources.keyset.Keyset` once its columns are resolved
        and returns a condition ANDed to every statement (fetch, count, NULL
        probe, guard). Partitioned polling uses it to read one range of
        buckets; the twin's fingerprint is this source's, so the caller adds
        the filter to its own identity.
        """
        twin = SqlAlchemySource(**self._config)
        twin._engines = self._engines
        twin._shape_of = self
        twin._row_filters = (*self._row_filters, row_filter)
        # Twins (a partitioned poller's partitions) say their guard once between them.
        twin._guarding.announced = self._guarding.announced
        return twin

    # --- identity ---------------------------------------------------------------

    @property
    def cursor_column(self) -> str:
        return self._spec.cursor_column

    @property
    def pk_columns(self) -> tuple[str, ...]:
        return self._spec.pk_columns

    @property
    def dialect_name(self) -> str:
        return self._named()[1]

    @property
    def name(self) -> str:
        return self._named()[2]

    def _named(self) -> tuple[object, str, str]:
        """(the URL, its dialect, the source's name): read several times a batch,
        so kept for as long as the URL object stays the same (it is resolved
        once: an app setting at first use)."""
        url = self._db_url.value
        named = self._names
        if named is None or named[0] is not url:
            dialect = url.get_backend_name()
            named = self._names = (url, dialect, f"{dialect}:{self._spec.target()}")
        return named

    @property
    def safe_url(self) -> str:
        return safe_url_text(self._db_url.value)

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
        return source_fingerprint(self._db_url.value, self._definition())

    def source_definition(self) -> dict[str, Any]:
        """What :meth:`fingerprint` hashes, readable and secret-free (kept in the state
        document so a changed definition can be shown, not only detected)."""
        return readable_definition(self._db_url.value, self._definition())

    def accepted_fingerprints(self) -> tuple[str, ...]:
        """Fingerprints a stored document may carry for this very definition.

        The current one first, then the one the previous algorithm gave the
        same configuration: a document written before the connection-only
        normalisation is still this poller's and must not be refused. A commit
        writes :meth:`fingerprint`, so the older value disappears on its own.
        """
        return (self.fingerprint(), *previous_fingerprints(self._db_url.value, self._definition()))

    def _definition(self) -> Definition:
        return self._spec.definition(self._deleted_value)

    def describe(self) -> dict[str, Any]:
        spec = self._spec
        return {
            "name": self.name,
            "url": self.safe_url,
            "table": spec.table,
            "schema": spec.schema,
            "query": spec.query,
            "cursor_column": spec.cursor_column,
            "pk_columns": list(spec.pk_columns),
            "where": spec.where,
            "row_value_predicate": self.dialect_name in ROW_VALUE_DIALECTS,
            "visibility": self.visibility_requested,
            "visibility_mode": self.visibility_mode,
            "visibility_guarantee": self.visibility_guarantee,
            "lag_column": self._lag_column,
        }

    @property
    def visibility_requested(self) -> str:
        """The ``visibility=`` setting: ``auto`` or the configured guard's label."""
        return self._guarding.requested

    @property
    def visibility_mode(self) -> str:
        """The guard in force. Under ``auto`` it is decided at the first fetch
        (it depends on the cursor column's type), ``auto`` until then."""
        return self._guarding.mode

    @property
    def visibility_guarantee(self) -> str | None:
        """What the guard in force promises (None while ``auto`` is undecided)."""
        return self._guarding.guarantee(self.dialect_name)

    # --- connections -------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engines.engine

    def close(self) -> None:
        """Dispose of the connection pool if this source created the engine."""
        self._connections.close()
        self._engines.dispose()

    # --- the connection kept between fetches (sources/connections.py) ---------------

    def _holds(self, engine: Engine) -> bool:
        """May fetches on ``engine`` keep their connection? Only in autocommit (every
        statement its own transaction, so nothing outlives a fetch but the socket),
        on a pool this source created with the default pooling, and not on a twin
        (the partitions of one process share a pool)."""
        return (
            engine is not self._engines.engine  # the autocommit engine of fetch_engine
            and self._shape_of is None
            and self._engines.holds_connections
        )

    @property
    def concurrent_reads(self) -> bool:
        """May :meth:`fetch` run on another thread while this source's other calls
        run (a trigger's read-ahead, :mod:`dbtrigger.runtime.readahead`)? A fetch
        runs on the connection a catch-up keeps (handed over under a lock) or one
        of its own, every other statement on one of its own, and what they share
        (the keyset's statements, the guard's bound) is built once or replaced
        whole; so yes, except on SQLite, whose in-memory databases are one per
        thread and whose reads gain nothing from another thread."""
        return self.dialect_name != "sqlite"

    @property
    def bulk_reads(self) -> bool:
        """May a tick read several batches with one :meth:`fetch` (see
        :mod:`dbtrigger.runtime.bulk`)? Yes: a fetch returns the first ``limit``
        rows after a position in checkpoint order; not a partition's twin, whose
        floors are read again before each fetch."""
        return self._shape_of is None

    def release_connection(self) -> None:
        """Give the connection a catch-up keeps (see :meth:`fetch`) back to the pool;
        nothing when none is kept."""
        self._connections.release()

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

        A fetch in autocommit that returns a full batch keeps its connection for
        the next one (:mod:`dbtrigger.sources.connections`).
        """
        engine = self._guarding.fetch_engine(self.engine)
        if not self._holds(engine):
            what = f"fetch from {self.name}"
            with self._connections.open(what, engine=engine, diagnose=True) as conn:
                return self._read(conn, after, limit)
        connections = self._connections
        generation = connections.generation
        try:  # (what ``mapped`` does, without a context manager a batch)
            conn = connections.take(engine) or connections.checkout(engine)
            try:
                self._keyset.shape.resolve(conn)
                rows = self._read(conn, after, limit)
            except BaseException:
                connections.give_back(conn, generation)
                raise
        except sa.exc.SQLAlchemyError as exc:
            raise connections.error(exc, f"fetch from {self.name}", diagnose=True) from exc
        if len(rows) >= limit:
            connections.keep(conn, generation)
        else:
            connections.give_back(conn, generation)
        return rows

    def _read(self, conn: Connection, after: Position, limit: int) -> Rows:
        """:meth:`_read_once` on the table's columns as they are now: compared every
        ``CHECK_SECONDS`` (:mod:`dbtrigger._columns`), and when a read fails, returns a
        value its column's type cannot give or finds the checkpoint unfit for the
        columns, which is then run again once if they changed (a column dropped or
        retyped under the worker); a table
        dropped and created again is refused (:mod:`.table_identity`)."""
        shape = self._keyset.shape
        if shape.watch.due():
            shape.follow(conn)
        if shape.identity.due():  # a table dropped and created again
            shape.latest().check_table(conn, after)
        try:
            return self._read_once(conn, after, limit)
        except (sa.exc.DBAPIError, SerializationError, SourceDefinitionError) as exc:
            if not shape.follow(conn, exc):
                raise
        return self._read_once(conn, after, limit)

    def _read_once(self, conn: Connection, after: Position, limit: int) -> Rows:
        keyset = self._keyset
        self._check_position(conn, after)
        guard = self._guarding.activate(conn, keyset, source=self.name)
        if conn.in_transaction():
            conn.rollback()
        if guard is None:
            return Rows(keyset.select_names(), [])
        condition: Any = guard.before_fetch(conn, after)
        if condition is not None and not isinstance(condition, FetchCondition):
            condition = FetchCondition(condition)  # a guard that returns a bare predicate
        stmt, params, reused = keyset.fetch_statement(after, limit, condition)
        rows = read_rows(
            conn,
            stmt,
            params,
            self._processors,
            source=self.name,
            key_columns=self.pk_columns,
            reused=reused,
        )
        rows.types = keyset.shape.checks.check_rows(rows.columns, rows.tuples)
        self.last_fetch_info = guard.after_fetch(conn, after, rows, limit)
        return rows

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
            cursor_column=self.cursor_column,
            pk_columns=self.pk_columns,
            source=self.name,
            poller=poller,
            batch_id=batch_id,
        )
        if self._spec.deleted_column is not None:
            return mark_deletes(events, self._spec.deleted_column, self._deleted_value)
        return events

    def _check_position(self, conn: Connection, after: Position) -> None:
        """Refuse a checkpoint whose values no longer fit their columns' types."""
        keyset = self._keyset
        keyset.shape.check_position(after, lambda: keyset.sample_row(conn))

    def validate(self, position: Position | None = None) -> None:
        """Reflect and check the definition now, as the first fetch would; fetch nothing.

        Raises what the first fetch would raise for the definition (missing
        table or columns, a lossy cursor/key type, keys not proven unique, a
        database or permission error) and, given the stored ``position``, a
        checkpoint whose kinds no longer fit the columns. ``dbtrigger check``
        and worker start-up call it. Worded as the first fetch words it (a
        start-up check may be the only place an operator reads it): the
        diagnosis first.
        """
        with self._connections.open(f"checking {self.name}", diagnose=True) as conn:
            if position is not None:
                self._check_position(conn, position)

    def reflected_table(self) -> sa.Table | None:
        """The reflected table (None in query mode, or before :meth:`validate`/a fetch)."""
        return self._keyset_built.shape.table if self._keyset_built is not None else None

    @property
    def uniqueness_note(self) -> str | None:
        """Why ``(cursor, pk)`` uniqueness is unproven though polling goes on (a view), or None."""
        return self._keyset.shape.checks.unverified_unique

    # --- visibility guard (sources/guarding.py) -----------------------------------

    def planned_guard(self) -> VisibilityGuard | None:
        """The visibility guard in force, or the one ``auto`` will choose (after reflection).

        None in query mode off PostgreSQL until a row shows the cursor's type.
        """
        return self._guarding.planned(self._keyset_built, self.dialect_name)

    def describe_guard(self) -> GuardDescription:
        """Which visibility guard is in force and what an exact one needs (``check``).

        Decides ``auto`` now if no fetch has yet (it connects; on MariaDB/MySQL
        it checks the PROCESS privilege). While ``auto`` cannot decide (query
        mode, no row yet) the mode is ``auto``.
        """
        with self._connections.open(f"describing {self.name}") as conn:
            guard = self._guarding.activate(conn, self._keyset, source=self.name)
        if guard is None:
            return GuardDescription("auto", "none", "undecided until a row has a cursor value")
        return guard.describe_guard()

    # --- lag (sources/lag_meter.py) -----------------------------------------------

    def cursor_age_seconds(self, cursor: Any, now: dt.datetime) -> float | None:
        """How old ``cursor`` is at ``now`` (aware UTC): the ``lag_seconds`` of a checkpoint.

        Aware timestamps are compared with ``now``; naive ones (and SQLite's
        date/time text) with the database's own wall clock, whose offset to UTC
        is read once every five minutes (:class:`~dbtrigger.sources.clock.DatabaseClock`).
        None for cursors that carry no time (integers, decimals).
        """
        return self._lag.age(cursor, now)

    def lag_basis(self, *, resolve: bool = False) -> str | None:
        """How ``lag_seconds`` is measured: ``cursor``, ``column:<name>`` or ``observed``.

        None while the cursor's type is unknown (before reflection), unless
        ``resolve`` (then the table is reflected now; errors give None).
        """
        reflected = self._keyset_built is not None and self._keyset_built.shape.resolved
        kind = self.cursor_kind if reflected or resolve else None
        return self._lag.basis(kind, self._cursor_type)

    def _cursor_type(self) -> sa.types.TypeEngine[Any] | None:
        """The cursor column's declared type (None before reflection, or in query mode)."""
        return self._keyset_built.shape.cursor_type if self._keyset_built is not None else None

    def row_age(self, row: Mapping[str, Any], now: dt.datetime) -> LagReading:
        """How old a fetched row is: its lag column, else its cursor (``observed``: None)."""
        return self._lag.row_age(row, self.cursor_column, now)

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """``lag_seconds`` with the checkpoint at ``after`` (called after each commit).

        A timestamp cursor is aged as it is (no query). Otherwise one keyset
        query, at most once a second; None in between (the gauge keeps its value).
        """
        lag = self._lag
        reading = lag.without_query(after, now)
        if reading is not None or not lag.due():
            return reading
        with (
            lag.unreadable_values(),
            self._connections.open(f"measuring the lag of {self.name}") as conn,
        ):
            return lag.measure(conn, self._keyset, after, now)

    def cursor_kind(self) -> str | None:
        """The checkpoint kind the cursor column's values take (None: not known yet).

        What ``reset --to-cursor`` should parse a typed value as when there is
        no stored checkpoint to copy the kind from. From the declared type in
        table mode; in query mode from one row (None while the source is empty).
        """
        return self.column_kinds()[self.cursor_column]

    def column_kinds(self) -> dict[str, str | None]:
        """:meth:`cursor_kind` for the cursor and every key column."""
        with self._connections.open(f"reading the column types of {self.name}") as conn:
            keyset = self._keyset
            checks = keyset.shape.checks
            checks.learn_from_sample(lambda: keyset.sample_row(conn))
            return dict(checks.primary)


__all__ = ["ROW_VALUE_DIALECTS", "SqlAlchemySource"]
