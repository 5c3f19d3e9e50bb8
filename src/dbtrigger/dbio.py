"""Reading and writing a table from a function: :class:`DbReader` and :class:`DbWriter`.

The input and writer bindings (``@db.input``, ``@db.inject_reader``,
``@db.inject_writer``, see :mod:`dbtrigger.azure.io`) hand these to a
function, as azure-functions-db does, with the rules of every other dbtrigger
binding:

* **settings** - ``url`` may be a ``%SETTING%`` reference, read at the first
  use: a missing setting fails the invocations that need it, not the import
  of ``function_app.py``, and the function recovers once it is set;
* **lazy connections** - nothing connects until a read or a write: a
  function that does not touch the table never opens a connection, and the
  engine (created once, shared by every invocation) is built at the first
  use; ``engine=`` shares one of your own (the passwordless Entra ID engine);
* **errors** - a read that fails is a :class:`~dbtrigger.errors.FetchError`,
  a write an :class:`~dbtrigger.errors.OutputWriteError` (both retryable, the
  driver's error chained, no row values in the message); a missing table or
  column is a :class:`~dbtrigger.errors.ConfigurationError`, a value its
  column cannot store an :class:`~dbtrigger.errors.OutputValueError`;
  ``one()`` without a row raises :class:`~dbtrigger.errors.RowNotFoundError`.

A writer's operations each commit on their own; ``with writer.transaction():``
runs the ones inside on one connection, committed when the block ends and
rolled back if it raises. Inside a ``@db.trigger`` handler the writes happen
before the checkpoint commit, like ``@db.output``'s, so a handler that raises
after writing gets its batch again: make them idempotent (``upsert``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from dbtrigger._driver_errors import failed_as
from dbtrigger._lock_wait import DEFAULT_WRITE_LOCK_TIMEOUT, bounded_transaction
from dbtrigger._tables import TableHandle, upsert_statement
from dbtrigger.errors import (
    ConfigurationError,
    FetchError,
    OutputWriteError,
    RowNotFoundError,
)
from dbtrigger.names import validate_sql_identifier

Row = dict[str, Any]
T = TypeVar("T")

log = logging.getLogger("dbtrigger.output")


def _mapping(value: object, option: str, names: str = "column names") -> Mapping[str, Any]:
    """``value`` if it is a dict (of columns or bind values), else a ConfigurationError."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{option} takes a dict of {names} to values, got {type(value).__name__}"
        )
    return value


def _statement(sql: object, params: object) -> tuple[sa.TextClause, dict[str, Any]]:
    """A query's text and bind values, their kinds checked."""
    if not isinstance(sql, str):
        raise ConfigurationError(f"a query is SQL text, got {type(sql).__name__}")
    return sa.text(sql), dict(_mapping(params or {}, "params=", "bind parameter names"))


def _key_clause(table: sa.Table, pk: Mapping[str, Any], name: str) -> sa.ColumnElement[bool]:
    pk = _mapping(pk, "pk=")
    if not pk:
        raise ConfigurationError(f"{name}: a key needs at least one column")
    unknown = [c for c in pk if c not in table.c]
    if unknown:
        raise ConfigurationError(f"{name} has no key column(s) {', '.join(sorted(unknown))}")
    return sa.and_(*(table.c[c] == v for c, v in pk.items()))


class _OnTable:
    """What a reader and a writer share: the table they read or write
    (:class:`~dbtrigger._tables.TableHandle`: its engine made at the first use),
    its name and its close."""

    #: How errors name this kind of object ("DbReader needs url= or engine=").
    _what = "DbReader"

    def __init__(
        self,
        *,
        url: str | None = None,
        table: str | None = None,
        schema: str | None = None,
        engine: Engine | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._db = TableHandle(self._what, url, table, schema, engine, engine_kwargs)

    @property
    def name(self) -> str:
        return self._db.name

    def close(self) -> None:
        """Dispose of the connection pool (if this reader or writer created the engine)."""
        self._db.close()


class DbReader(_OnTable):
    """Reads rows (see the module doc): ``get(pk)`` from ``table``, or SQL queries.

    Args:
        url: SQLAlchemy URL or ``%SETTING%`` reference (read at the first use).
        table / schema: the table ``get`` reads (queries need none).
        engine: share an existing engine instead (``url`` then unused).
        engine_kwargs: passed to :func:`sqlalchemy.create_engine`.
    """

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[Connection]:
        with (
            failed_as(FetchError, f"{what} from {self._db.name} failed"),
            self._db.engine.connect() as conn,
        ):
            yield conn

    def get(self, *, pk: Mapping[str, Any]) -> Row | None:
        """The row of ``table`` with this key, or None."""
        with self._reading("reading a row") as conn:
            table = self._db.table(conn)
            row = conn.execute(
                sa.select(table).where(_key_clause(table, pk, self._db.name))
            ).mappings()
            found = row.first()
            return dict(found) if found is not None else None

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        """Every row of ``sql`` (``:name`` placeholders, values bound from ``params``)."""
        statement, values = _statement(sql, params)
        with self._reading("a query") as conn:
            return [dict(r) for r in conn.execute(statement, values).mappings()]

    def one_or_none(self, sql: str, params: Mapping[str, Any] | None = None) -> Row | None:
        """The one row of ``sql``, or None; more than one is a ConfigurationError."""
        rows = self.query(sql, params)
        if len(rows) > 1:
            raise ConfigurationError(f"expected at most one row, the query returned {len(rows)}")
        return rows[0] if rows else None

    def one(self, sql: str, params: Mapping[str, Any] | None = None) -> Row:
        """The one row of ``sql``; none raises RowNotFoundError."""
        row = self.one_or_none(sql, params)
        if row is None:
            raise RowNotFoundError(f"the query on {self._db.name} returned no row")
        return row

    def scalar(self, sql: str, params: Mapping[str, Any] | None = None) -> Any:
        """The first column of the first row of ``sql`` (None without a row)."""
        statement, values = _statement(sql, params)
        with self._reading("a query") as conn:
            return conn.execute(statement, values).scalar()


class DbWriter(_OnTable):
    """Writes rows of ``table`` (see the module doc).

    Every operation commits on its own, except inside ``with
    writer.transaction():``, where they share one connection and one
    transaction. Args as :class:`DbReader` (``table`` required), and
    ``lock_timeout_seconds``: how long a write waits for a lock another
    transaction holds before it gives up with
    :class:`~dbtrigger.errors.OutputLockTimeoutError` (default 30 s).
    """

    _what = "DbWriter"

    def __init__(
        self,
        *,
        url: str | None = None,
        table: str,
        schema: str | None = None,
        engine: Engine | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        lock_timeout_seconds: float = DEFAULT_WRITE_LOCK_TIMEOUT,
    ) -> None:
        # The reader's options, with ``table`` required: every write goes to it.
        if not table:
            raise ConfigurationError("DbWriter needs table= (the table every write goes to)")
        self._db = TableHandle(
            self._what,
            url,
            table,
            schema,
            engine,
            engine_kwargs,
            lock_timeout_seconds=lock_timeout_seconds,
        )
        self._conn: Connection | None = None

    @classmethod
    def _sharing(cls, other: DbWriter) -> DbWriter:
        """A writer of its own (its own transaction) on ``other``'s engine and table:
        one per invocation of a function, so concurrent invocations never share one."""
        writer = cls.__new__(cls)
        writer._db = other._db
        writer._conn = None
        return writer

    @contextlib.contextmanager
    def transaction(self) -> Iterator[DbWriter]:
        """Run the writes inside on one connection: committed at the end of the block,
        rolled back if it raises. Not reentrant (a nested call is a ConfigurationError)."""
        if self._conn is not None:
            raise ConfigurationError("DbWriter.transaction() is already open on this writer")
        with (
            failed_as(
                functools.partial(OutputWriteError, table=self.name),
                f"the transaction on {self._db.name} failed",
            ),
            bounded_transaction(self._db.engine, self._db.lock_timeout) as conn,
        ):
            self._conn = conn
            try:
                yield self
            finally:
                self._conn = None

    def _write(
        self,
        what: str,
        rows: int,
        work: Callable[[Connection], T],
        conflict_columns: Sequence[str] = (),
    ) -> T:
        """``work`` on the open transaction, or in one of its own that runs again when the
        database chose it as a deadlock victim (:meth:`TableHandle.transact`)."""
        return self._db.transact(
            f"{what} on", rows, work, conn=self._conn, conflict_columns=conflict_columns
        )

    def insert(self, *, data: Mapping[str, Any]) -> None:
        self.insert_many(rows=[data])

    def insert_many(self, *, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert ``rows`` (the same columns each) in one statement."""
        if not rows:
            return
        columns = _same_columns(rows)

        def work(conn: Connection) -> None:
            table = self._db.columns(conn, columns)
            self._db.write(conn, table, sa.insert(table), rows)

        self._write("an insert", len(rows), work)

    def upsert(self, *, data: Mapping[str, Any], conflict_columns: Sequence[str]) -> None:
        self.upsert_many(rows=[data], conflict_columns=conflict_columns)

    def upsert_many(
        self, *, rows: Sequence[Mapping[str, Any]], conflict_columns: Sequence[str]
    ) -> None:
        """Insert ``rows``, updating those whose ``conflict_columns`` (a key) exist."""
        if not rows:
            return
        if isinstance(conflict_columns, str) or not conflict_columns:
            raise ConfigurationError("conflict_columns must be a non-empty list of column names")
        for column in conflict_columns:
            validate_sql_identifier(column, "conflict column")
        columns = _same_columns(rows)
        self._db.refuse_null_keys(rows, conflict_columns)

        def work(conn: Connection) -> None:
            self._db.check_conflict_key(conn, conflict_columns)
            table = self._db.columns(conn, [*columns, *conflict_columns])
            statement = upsert_statement(conn.dialect.name, table, columns, tuple(conflict_columns))
            self._db.write(conn, table, statement, rows, conflict_columns=conflict_columns)

        self._write("an upsert", len(rows), work, conflict_columns)

    def update(self, *, data: Mapping[str, Any], pk: Mapping[str, Any]) -> int:
        """Set ``data`` on the row with key ``pk``; how many rows changed (0: none had it)."""
        if not _mapping(data, "data="):
            raise ConfigurationError("update(data=...) names no column to set")

        def work(conn: Connection) -> int:
            table = self._db.columns(conn, list(data))
            where = _key_clause(table, pk, self._db.name)
            statement = sa.update(table).where(where).values(dict(data))
            return int(self._db.write(conn, table, statement, [data], each=False).rowcount)

        return self._write("an update", 1, work)

    def delete(self, *, pk: Mapping[str, Any]) -> int:
        """Delete the row with key ``pk``; how many rows went (0: there was none)."""

        def work(conn: Connection) -> int:
            table = self._db.table(conn)
            where = _key_clause(table, pk, self._db.name)
            return int(conn.execute(sa.delete(table).where(where)).rowcount)

        return self._write("a delete", 1, work)


def _same_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    if isinstance(rows, (Mapping, str, bytes)) or not isinstance(rows, Sequence):
        raise ConfigurationError(
            f"rows= takes a list of dicts, got {type(rows).__name__} (one row: data=...)"
        )
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigurationError(f"row {index} is {type(row).__name__}, expected a dict")
    first = list(rows[0])
    if not first:
        raise ConfigurationError("a row has no columns: name at least one (a row of defaults)")
    for index, row in enumerate(rows):
        if set(row) != set(first):
            raise ConfigurationError(
                f"row {index} has columns {sorted(row)}, row 0 {sorted(first)}: give every "
                "row the same columns"
            )
    return first


__all__ = ["DbReader", "DbWriter"]
