"""The shape of a polled table or query: its columns and their types, learnt once.

A table is reflected; a query is probed with a statement that returns no row.
Either way the result is one set of column objects that every statement of the
source is built from (:mod:`dbtrigger.sources.keyset`), the declared type of
the cursor column (the visibility guard and the lag measurement choose by it)
and the checks that refuse a definition polling would silently get wrong
(:class:`~dbtrigger.sources.column_checks.ShapeChecks`: a lossy cursor or key
type, keys not proven unique, a checkpoint whose kinds no longer fit).

Learnt at the first connection, not when the source is built: the URL (and so
the dialect) may be an app setting that is only resolved then, and a table
that does not exist yet must not stop a Function App from indexing.

Kept up to date while the source runs: a shape remembers the columns ``SELECT
*`` returned when it was learnt (:mod:`dbtrigger._columns`), and
:meth:`Shape.follow` compares them with the table's now (the source asks at
most every ``CHECK_SECONDS``, and at once when a fetch fails). When they differ
(a column added, dropped, renamed or retyped) a new shape is learnt and
published as :attr:`Shape.successor`; the source and its twins build their
statements on it from their next one, and a definition the table no longer
fits (the cursor or a key column gone) is refused as at the first connection.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from dbtrigger._columns import ColumnWatch, Layout, probe, probe_or_none
from dbtrigger._engine import reflect_table
from dbtrigger.cursor import Position, encode_value
from dbtrigger.errors import ConfigurationError, SerializationError
from dbtrigger.names import validate_sql_identifier
from dbtrigger.sources.column_checks import ShapeChecks
from dbtrigger.sources.fingerprint import Definition
from dbtrigger.sources.table_identity import TableIdentity


@dataclass(frozen=True)
class SourceSpec:
    """What a keyset source reads and in which order: its validated definition.

    ``tiebreak`` are the key columns that break ties between equal cursors. A
    cursor that is itself the key (an append-only table polled by its id) has
    none: the keyset collapses to ``id > :id``.
    """

    table: str | None
    schema: str | None
    query: str | None
    cursor_column: str
    pk_columns: tuple[str, ...]
    where: str | None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    deleted_column: str | None = None

    @classmethod
    def validated(
        cls,
        *,
        table: str | None,
        schema: str | None,
        query: str | None,
        cursor_column: str,
        pk_columns: Sequence[str],
        where: str | None,
        parameters: Mapping[str, Any] | None,
        deleted_column: str | None,
        deleted_value: Any,
    ) -> SourceSpec:
        """The definition, every identifier checked (a ``ConfigurationError`` names the problem)."""
        if (table is None) == (query is None):
            raise ConfigurationError("SqlAlchemySource needs exactly one of table= or query=")
        if isinstance(pk_columns, str) or not isinstance(pk_columns, Iterable):
            raise ConfigurationError(
                f"pk_columns must be a list of column names, not {type(pk_columns).__name__}"
            )
        if not pk_columns:
            raise ConfigurationError("pk_columns must name at least one column")
        for option, text in (("query", query), ("where", where)):
            if text is not None and not isinstance(text, str):
                raise ConfigurationError(f"{option}= must be SQL text, not {type(text).__name__}")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ConfigurationError(
                f"parameters= must be a dict of bind values, not {type(parameters).__name__}"
            )
        table = validate_sql_identifier(table, "table") if table else None
        schema = validate_sql_identifier(schema, "schema") if schema else None
        cursor_column = validate_sql_identifier(cursor_column, "cursor_column")
        pk = tuple(validate_sql_identifier(c, "pk column") for c in pk_columns)
        if len(set(pk)) != len(pk):
            raise ConfigurationError(f"pk_columns names a column twice: {list(pk)}")
        if deleted_value is not None and deleted_column is None:
            raise ConfigurationError("deleted_value needs deleted_column")
        if deleted_column:
            deleted_column = validate_sql_identifier(deleted_column, "deleted_column")
        return cls(
            table=table,
            schema=schema,
            query=query,
            cursor_column=cursor_column,
            pk_columns=pk,
            where=where,
            parameters=dict(parameters or {}),
            deleted_column=deleted_column or None,
        )

    @property
    def tiebreak(self) -> tuple[str, ...]:
        return tuple(c for c in self.pk_columns if c != self.cursor_column)

    @property
    def table_mode(self) -> bool:
        return self.table is not None

    def definition(self, deleted_value: Any) -> Definition:
        """The part of this spec a fingerprint hashes; the soft-delete marking
        (column and encoded ``deleted_value``) only when configured, so the
        fingerprints of sources without it do not change."""
        deleted = self.deleted_column
        return Definition(
            schema=self.schema,
            table=self.table,
            query=self.query,
            cursor_column=self.cursor_column,
            pk_columns=self.pk_columns,
            where=self.where,
            parameters=self.parameters,
            deleted=[deleted, list(encode_value(deleted_value))] if deleted is not None else None,
        )

    def target(self) -> str:
        """``schema.table`` (or ``query``): the second half of the source's name."""
        name = self.table or "query"
        return f"{self.schema}.{name}" if self.schema else name

    def bound_parameters(self, clause: sa.TextClause) -> sa.TextClause:
        """``clause`` with the configured parameters it names bound (the others ignored)."""
        names = set(clause._bindparams)
        return clause.bindparams(**{k: v for k, v in self.parameters.items() if k in names})


def bind_name(column: str) -> str:
    """The parameter a keyset statement binds a position's value of ``column`` to."""
    return "dbtrigger_after_" + column


class Shape:
    """The columns of one source as the database has them (see the module docstring).

    Empty until :meth:`resolve` ran on a connection; every statement builder
    calls it first, and it does its work once.
    """

    def __init__(self, spec: SourceSpec, *, dialect: str, source_name: str) -> None:
        self.spec = spec
        self.dialect = dialect
        self.source_name = source_name
        #: One shape may serve several sources (a partitioned poller's partitions,
        #: see SqlAlchemySource.derive), resolved by whichever reads first.
        self._resolving = threading.Lock()
        self.checks = ShapeChecks(
            dialect=dialect,
            source=source_name,
            cursor_column=spec.cursor_column,
            pk_columns=spec.pk_columns,
        )
        self.selectable: sa.FromClause | None = None
        self.columns: dict[str, ColumnElement[Any]] = {}
        self.select_list: list[ColumnElement[Any]] = []
        #: The cursor column's declared type and comment (table mode only).
        self.cursor_type: sa.types.TypeEngine[Any] | None = None
        self.cursor_comment: str | None = None
        #: SQLite date/time key columns, read and compared as their text.
        self.text_typed: dict[str, sa.types.TypeEngine[Any]] = {}
        #: The columns this shape was learnt from, and when to compare them again.
        self.watch = ColumnWatch(None)
        #: What ``SELECT *`` of the table (or query) reads: the watch's probe.
        self._probed: sa.FromClause | None = None
        #: The shape learnt after the table's columns changed (see :meth:`follow`).
        self.successor: Shape | None = None
        #: Which table the source first read (PostgreSQL), kept by every successor.
        self.identity = TableIdentity(
            table=spec.table, schema=spec.schema, dialect=dialect, source=source_name
        )

    @property
    def resolved(self) -> bool:
        return self.selectable is not None

    @property
    def table(self) -> sa.Table | None:
        """The reflected table (None in query mode, or before :meth:`resolve`)."""
        return self.selectable if isinstance(self.selectable, sa.Table) else None

    def resolve(self, conn: Connection) -> None:
        """Reflect the table (or probe the query) once: column objects and types."""
        if self.selectable is not None:
            return
        with self._resolving:
            if self.selectable is None:
                self._resolve(conn)

    def _resolve(self, conn: Connection) -> None:
        spec = self.spec
        layout: Layout | None = None
        bare: sa.FromClause
        if spec.table is not None:
            bare = sa.table(spec.table, schema=spec.schema)
            self.identity.learn(conn)
            layout = probe_or_none(conn, bare)  # first: a change in between is seen next
            selectable: sa.FromClause = reflect_table(
                conn, spec.table, spec.schema, shown=self.source_name, keys_only=True
            )
        else:
            text = spec.bound_parameters(sa.text(spec.query or ""))
            selectable = text.columns().subquery("dbtrigger_src")
            layout = probe(conn, selectable)
            bare = text.columns().subquery("dbtrigger_src")
            selectable = text.columns(*(sa.column(name) for name, _ in layout)).subquery(
                "dbtrigger_src"
            )
        columns: dict[str, ColumnElement[Any]] = {c.name: c for c in selectable.c}
        required = (spec.cursor_column, *spec.pk_columns)
        if spec.deleted_column is not None:
            required = (*required, spec.deleted_column)
        missing = [c for c in required if c not in columns]
        if missing:
            raise SerializationError(
                f"source {self.source_name} has no column(s) {', '.join(missing)}; "
                f"available: {', '.join(sorted(columns))}",
                missing_columns=missing,
            )
        if spec.table is not None:
            declared = cast("sa.Column[Any]", columns[spec.cursor_column])
            self.cursor_type = declared.type
            self.cursor_comment = declared.comment
        if self.dialect == "sqlite":
            # SQLite keeps dates and times as text in whatever format the writer
            # used and compares them as text. Re-formatting a parsed value (with
            # or without microseconds, 'T' or ' ') would compare wrongly and skip
            # rows, so key columns are read, compared and checkpointed verbatim.
            for name in (spec.cursor_column, *spec.pk_columns):
                column = columns[name]
                if isinstance(column.type, (sa.DateTime, sa.Date, sa.Time)):
                    self.text_typed[name] = column.type
                    columns[name] = sa.type_coerce(column, sa.String)
        if isinstance(selectable, sa.Table):
            self.checks.table_reflected(
                selectable,
                compared_as_text=self.text_typed,
                is_view=lambda: self._is_view(conn),
                sql_dialect=conn.dialect,
            )
        else:
            self.checks.query_probed(layout)
        self.columns = columns
        self.select_list = [
            columns[c.name].label(c.name) if columns[c.name] is not c else c for c in selectable.c
        ]
        self.watch = ColumnWatch(layout)
        self._probed = bare
        self.selectable = selectable  # last: a shape with a selectable is whole

    def latest(self) -> Shape:
        """This shape, or the newest one learnt after it."""
        shape = self
        while shape.successor is not None:
            shape = shape.successor
        return shape

    def follow(self, conn: Connection, failure: BaseException | None = None) -> bool:
        """Compare the table's columns with this shape's; True if they changed (and
        the newer shape is learnt: :meth:`latest`).

        ``failure``: a statement built on this shape just failed on ``conn`` (it is
        rolled back, and named in the warning). The new shape is learnt with every
        check of the first connection, so a cursor or key column that is gone
        raises here (typed, as at start-up). A probe that fails changes nothing:
        the read goes on, or its own error stands.
        """
        if self.successor is not None:
            return True
        if conn.invalidated:
            return False
        if conn.in_transaction():
            conn.rollback()
        assert self._probed is not None  # noqa: S101 - resolved first
        try:
            change = self.watch.check(conn, self._probed)
        except sa.exc.DBAPIError:
            if conn.in_transaction() and not conn.invalidated:
                conn.rollback()
            return False
        if change is None:
            return False
        newer = Shape(self.spec, dialect=self.dialect, source_name=self.source_name)
        newer.identity = self.identity  # still the table the checkpoint was read from
        newer.resolve(conn)
        with self._resolving:
            if self.successor is None:
                self.successor = newer
                change.report(self.source_name, failure)
        return True

    def check_table(self, conn: Connection, after: Position) -> None:
        """Refuse a table dropped and created again under a checkpoint taken in the old
        one (:mod:`~dbtrigger.sources.table_identity`); read from the beginning, the new
        table is learnt (a newer shape, whose statements carry its oid)."""
        if self.identity.same(conn, after):
            return
        newer = Shape(self.spec, dialect=self.dialect, source_name=self.source_name)
        newer.resolve(conn)
        with self._resolving:
            if self.successor is None:
                self.successor = newer

    def _is_view(self, conn: Connection) -> bool:
        names = sa.inspect(conn).get_view_names(schema=self.spec.schema)
        return self.spec.table in names

    def typed(
        self, name: str, value: Any, *, named: bool = False, param: str | None = None
    ) -> ColumnElement[Any]:
        """``value`` bound for comparison with column ``name``.

        ``named``: a parameter named after the column (see
        :meth:`~dbtrigger.sources.keyset.Keyset.fetch_statement`), so the
        statement can be executed again with other values of the same Python
        type; ``param``: a parameter of that name; otherwise an anonymous literal.
        """
        column = self.columns[name]
        type_: Any = None  # query mode: no declared types; the value's own type binds
        if name in self.text_typed and type(value) in (int, float):
            pass  # a number SQLite stored in a date/time column: compared as that number
        elif name in self.text_typed and not isinstance(value, str):
            # A position given as a date/time (e.g. `reset --to-cursor`) rather than
            # read from a row: render it the way SQLAlchemy stores it on SQLite.
            type_ = self.text_typed[name]
        elif self.spec.table is not None:
            type_ = column.type
        if named or param is not None:
            return sa.bindparam(param or bind_name(name), value, type_=type_)
        return sa.literal(value, type_=type_)

    def position_of(self, row: Mapping[str, Any]) -> Position:
        spec = self.spec
        return Position(cursor=row[spec.cursor_column], pk={c: row[c] for c in spec.pk_columns})

    def check_position(
        self, after: Position, sample: Callable[[], Mapping[str, Any] | None]
    ) -> None:
        """Refuse a checkpoint whose values no longer fit their columns' types.

        ``sample`` reads one row's position columns, for a query whose kinds
        only a row can tell.
        """
        if after.is_beginning:
            return
        if self.checks.needs_sample:
            self.checks.learn_from_sample(sample)
        values = {self.spec.cursor_column: after.cursor}
        pk = after.pk
        for name in self.spec.tiebreak:
            if name in pk:
                values[name] = pk[name]
        self.checks.check_position(values)

    def sample_says_timestamp(self, value: Any) -> bool:
        """What one sampled cursor value says of the cursor (see ``Keyset.timestamp_probe``)."""
        return bool(value) if self.dialect == "sqlite" else isinstance(value, dt.datetime)


__all__ = ["Shape", "SourceSpec", "bind_name"]
