"""One table of one database, as the function bindings write and read it (internal).

``db.output``'s :class:`~dbtrigger.output.OutputTarget` and the reader and
writer of :mod:`dbtrigger.dbio` share what a binding needs of its table:

* :class:`TableHandle`: the URL (``%SETTING%`` references read at the first
  use), the engine made once at the first use or shared (``engine=``), and the
  table reflected once, under a lock, with the errors a missing table or column
  is (:class:`~dbtrigger.errors.ConfigurationError`, naming it);
* :meth:`TableHandle.write`: a write of rows, a value its column cannot
  store refused as :class:`~dbtrigger.errors.OutputValueError` naming the row,
  the column and the value's type (never the value), not retried as if the
  database had failed;
* :meth:`TableHandle.transact`: one write transaction, its lock waits bounded
  (``lock_timeout_seconds``, :mod:`dbtrigger._lock_wait`): a write that waits
  longer for another transaction's lock gives up as
  :class:`~dbtrigger.errors.OutputLockTimeoutError` (retryable, naming who
  holds locks on the table when that can be told); a row that breaks a rule
  of the table (a unique key, NOT NULL, CHECK, a value too long or out of
  range) is :class:`~dbtrigger.errors.OutputConstraintError` or
  ``OutputValueError``, never retried (:mod:`dbtrigger._write_refusals`);
* :func:`upsert_statement`: ``INSERT ... ON CONFLICT`` / ``ON DUPLICATE KEY
  UPDATE`` per dialect.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from decimal import Decimal
from typing import Any, TypeVar
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger._database_url import DatabaseUrl
from dbtrigger._driver_errors import (
    lost_to_another_transaction,
    names_a_missing_object,
    short_error,
)
from dbtrigger._engine import LazyEngine, reflect_table
from dbtrigger._lock_wait import (
    DEFAULT_WRITE_LOCK_TIMEOUT,
    bounded_transaction,
    check_lock_timeout,
    gave_up_waiting,
    lock_timed_out,
)
from dbtrigger._write_refusals import refusal, refusal_error
from dbtrigger._write_values import (
    in_key_order,
    mark_json_columns,
    packet_misfit,
    refuse_values,
    type_text,
    unserializable_json,
)
from dbtrigger.errors import (
    ConfigurationError,
    OutputLockTimeoutError,
    OutputValueError,
    OutputWriteError,
)
from dbtrigger.names import validate_sql_identifier

log = logging.getLogger("dbtrigger.output")
T = TypeVar("T")

#: Tries of one write (db.output's, or a DbWriter operation in a transaction of its
#: own) when the database picks it as a deadlock victim or fails it on serialization
#: (a whole transaction it rolled back), the first included.
WRITE_ATTEMPTS = 3

#: Dialects with a native upsert statement we know how to build.
UPSERT_DIALECTS = frozenset({"postgresql", "sqlite", "mysql", "mariadb"})

#: Column types that hold one plain value: a dict, a list or a set given to one of
#: them cannot be written, whatever the driver (MariaDB's SET, a string type, takes a set).
_PLAIN_TYPES: tuple[type[Any], ...] = (
    sa.String,
    sa.Integer,
    sa.Numeric,
    sa.Boolean,
    sa.Date,
    sa.DateTime,
    sa.Time,
    sa.LargeBinary,
)
_STRUCTURES = (Mapping, list, tuple, set, frozenset)
#: Values every driver sends as they are: never the value a failure is blamed on.
_SCALARS: tuple[type[Any], ...] = (str, bytes, bytearray, memoryview, int, float, Decimal)
_SCALARS += (dt.date, dt.time, dt.timedelta, UUID)
#: What a number column is given that the database can judge itself (a string of
#: digits is the server's to convert or refuse).
_NUMBER_LIKE = (numbers.Number, str, bytes)


class TableHandle:
    """One database (and optionally one table): the lazily made engine, the reflected
    table. Shared by every invocation of a binding; safe to use from several threads.

    Args:
        what: how errors name the owner (``"db.output"``: "db.output needs url= or
            engine=", "db.output url").
        noun: how errors name the table (``"output table"``).
        check: called with the URL once it is known (a dialect the owner refuses).
        lock_timeout_seconds: how long a write waits for a lock another transaction
            holds before it gives up (:mod:`dbtrigger._lock_wait`).
    """

    def __init__(
        self,
        what: str,
        url: str | None,
        table: str | None,
        schema: str | None,
        engine: Engine | None,
        engine_kwargs: Mapping[str, Any] | None,
        *,
        noun: str = "table",
        check: Callable[[URL], None] | None = None,
        lock_timeout_seconds: float = DEFAULT_WRITE_LOCK_TIMEOUT,
    ) -> None:
        if url is None and engine is None:
            raise ConfigurationError(f"{what} needs url= or engine=")
        self.lock_timeout = check_lock_timeout(lock_timeout_seconds)
        self.what = what
        self.noun = noun
        self.table_name = validate_sql_identifier(table, "table") if table else None
        self.schema = validate_sql_identifier(schema, "schema") if schema else None
        self._db_url = DatabaseUrl(url, engine, f"{what} url", check)
        self._engines = LazyEngine(lambda: self._db_url.value, engine_kwargs, engine)
        self._table: sa.Table | None = None
        self._lock = threading.Lock()
        #: Sets of conflict columns found to be a key of the table.
        self._keys_checked: set[frozenset[str]] = set()

    @property
    def url(self) -> URL:
        """The database URL, its app settings read now if they could not be before."""
        return self._db_url.value

    @property
    def dialect(self) -> str:
        return self.url.get_backend_name()

    @property
    def engine(self) -> Engine:
        return self._engines.engine

    @property
    def name(self) -> str:
        """``dialect:schema.table`` (``(queries)`` without a table), for messages."""
        where = self.table_name or "(queries)"
        if self.schema and self.table_name:
            where = f"{self.schema}.{self.table_name}"
        return f"{self.dialect}:{where}"

    def table(self, conn: Connection) -> sa.Table:
        """The table, reflected on ``conn`` at the first call."""
        if self.table_name is None:
            raise ConfigurationError(f"{self.what}: this needs table=")
        if self._table is None:
            with self._lock:
                if self._table is None:
                    table = reflect_table(
                        conn, self.table_name, self.schema, shown=self.name, noun=self.noun
                    )
                    mark_json_columns(conn, table)
                    self._table = table
        return self._table

    def forget(self) -> None:
        """Reflect the table again at the next use (it was altered, dropped or made anew)."""
        with self._lock:
            self._table = None
            self._keys_checked = set()

    def columns(self, conn: Connection, names: Sequence[str]) -> sa.Table:
        """The table, after checking that it has every column of ``names``: a column
        not in the table as reflected makes it read again (one added since)."""
        table = self.table(conn)
        unknown = [c for c in names if c not in table.c]
        if unknown:
            self.forget()
            table = self.table(conn)
            unknown = [c for c in names if c not in table.c]
        if unknown:
            raise ConfigurationError(
                f"{self.noun} {self.name} has no column(s) {', '.join(sorted(unknown))}"
            )
        return table

    def close(self) -> None:
        """Dispose of the connection pool if this handle created the engine."""
        self._engines.dispose()

    def write(
        self,
        conn: Connection,
        table: sa.Table,
        statement: Any,
        rows: Sequence[Mapping[str, Any]],
        *,
        each: bool = True,
        conflict_columns: Sequence[str] = (),
    ) -> Any:
        """Execute ``statement`` for ``rows`` (``each=False``: the values are in the
        statement already); the result.

        Raises:
            OutputValueError: a value its column cannot store: a dict, list or set
                in a column of a plain type (refused before anything is sent:
                drivers fail on it each their own way, MariaDB's with an SQL
                syntax error), or a value the column type or the driver refused,
                too long or out of range for its column.
            OutputConstraintError: a row breaks a unique key (not the upsert's
                ``conflict_columns``), a NOT NULL or a CHECK of the table.
            OutputReferenceError: a row's foreign key finds no row (retryable).
        """
        columns = list(rows[0]) if rows else []
        for column in columns:
            column_type = table.c[column].type
            if isinstance(column_type, _PLAIN_TYPES) and type(column_type).__name__ != "SET":
                numeric = isinstance(column_type, (sa.Integer, sa.Numeric))
                for index, row in enumerate(rows):
                    value = row.get(column)
                    if isinstance(value, _STRUCTURES) or (
                        # PyMySQL sends an object it does not know as its str(), which a
                        # MariaDB/MySQL server outside strict mode stores in a number
                        # column as 0, with a warning no one reads.
                        numeric and value is not None and not isinstance(value, _NUMBER_LIKE)
                    ):
                        raise self._unwritable(index, column, value, column_type, "")
        refuse_values(conn.dialect.name, table, rows, self.name)
        try:
            if not each:
                return conn.execute(statement)
            return conn.execute(statement, in_key_order(table, rows, conflict_columns))
        except OverflowError as exc:  # pysqlite, an int past 64 bits: outside the DB-API
            found = refusal(exc, table, rows)
            if found is None:
                raise
            raise refusal_error(found, self.name, table, rows, conflict_columns) from exc
        except (TypeError, ValueError) as exc:
            # psycopg serialises a JSON column's value itself, when the statement runs,
            # and its json.dumps error comes out of execute() as it is.
            problem = unserializable_json(conn.dialect, table, rows, self.name)
            if problem is None:
                raise
            raise problem from exc
        except SQLAlchemyError as exc:
            problem = self._refused_value(exc, conn, table, rows, columns)
            problem = problem or packet_misfit(self.engine, exc, rows, self.name)
            if problem is not None:
                raise problem from exc
            found = refusal(exc, table, rows)
            if found is None:
                raise
            if found.row is None and each and len(rows) > 1:
                found = replace(found, row=_failing_row(conn, statement, rows, exc))
            raise refusal_error(found, self.name, table, rows, conflict_columns) from exc

    def transact(
        self,
        what: str,
        rows: int,
        work: Callable[[Connection], T],
        *,
        conn: Connection | None = None,
        conflict_columns: Sequence[str] = (),
    ) -> T:
        """``work`` on ``conn`` (a caller's open transaction) or in a transaction of its
        own. One of its own that the database chose as a deadlock victim (or failed on
        serialization) was rolled back whole: it runs again, up to ``WRITE_ATTEMPTS``
        tries. On ``conn`` the caller's whole block was rolled back: that is the
        caller's to run again, and the error says so.

        ``what`` reads before the table's name: ``"an insert on"``, ``"writing 3 row(s) to"``.

        Raises:
            OutputWriteError: the database refused or failed the write (the driver's
                error, never the row values).
        """
        attempt = 1
        reflected_again = False
        while True:
            try:
                if conn is not None:
                    return work(conn)
                with bounded_transaction(self.engine, self.lock_timeout) as own:
                    return work(own)
            except SQLAlchemyError as exc:
                if lock_timed_out(exc):
                    raise self._lock_timeout(what, rows, attempt, exc) from exc
                if names_a_missing_object(exc):
                    # The table or a column went since it was reflected: read it again,
                    # so that the write fails naming what is missing (ConfigurationError)
                    # or succeeds on the table made anew, not on a stale copy for ever.
                    self.forget()
                    if conn is None and not reflected_again:
                        reflected_again = True
                        continue
                found = refusal(exc, None, ())
                if found is not None:
                    raise refusal_error(found, self.name, None, (), conflict_columns) from exc
                lost = lost_to_another_transaction(exc)
                if lost and conn is None and attempt < WRITE_ATTEMPTS:
                    log.info(
                        "%s %s lost to another transaction (%s); running it again "
                        "(attempt %d of %d)",
                        what,
                        self.name,
                        short_error(exc),
                        attempt + 1,
                        WRITE_ATTEMPTS,
                        extra={"event": "output_write_retried", "table": self.name},
                    )
                    attempt += 1
                    continue
                why = short_error(exc)
                if lost and conn is not None:
                    why += " (the database rolled the whole transaction back: run it again)"
                raise OutputWriteError(
                    f"{what} {self.name} failed: {why}",
                    table=self.name,
                    rows=rows,
                    attempts=attempt,
                ) from exc

    def _lock_timeout(
        self, what: str, rows: int, attempt: int, exc: BaseException
    ) -> OutputLockTimeoutError:
        """The error of a write that gave up waiting for a lock (the transaction is
        rolled back by now): who holds locks on the table, if that can be told."""
        text, holders = gave_up_waiting(
            self.engine,
            self.table_name or "",
            self.schema,
            self.lock_timeout,
            exc,
            "nothing was written, the write runs again with the batch. End the transaction "
            "left open there; raise lock_timeout_seconds only below the lease",
        )
        return OutputLockTimeoutError(
            f"{what} {self.name} {text}",
            table=self.name,
            rows=rows,
            attempts=attempt,
            seconds=self.lock_timeout,
            holders=holders or None,
        )

    def check_conflict_key(self, conn: Connection, conflict_columns: Sequence[str]) -> None:
        """Refuse ``conflict_columns`` that are not exactly the primary key or a unique
        constraint or index of the table (checked once per set of columns).

        An upsert on anything else never matches on MariaDB/MySQL (each call inserts the
        row again) and fails as a write error elsewhere.

        Raises:
            ConfigurationError: names the columns and the table.
        """
        wanted = frozenset(conflict_columns)
        if wanted in self._keys_checked:
            return
        table = self.columns(conn, list(conflict_columns))
        inspector = sa.inspect(conn)
        keys: list[set[str]] = [{c.name for c in table.primary_key.columns}]
        keys += [
            {c for c in u["column_names"] if c}
            for u in inspector.get_unique_constraints(table.name, schema=self.schema)
        ]
        keys += [
            {c for c in i["column_names"] if c}
            for i in inspector.get_indexes(table.name, schema=self.schema)
            if i.get("unique")
        ]
        if set(wanted) not in keys:
            raise ConfigurationError(
                f"{self.noun} {self.name} has no primary key or unique constraint on exactly "
                f"({', '.join(conflict_columns)}); an upsert needs one to detect replays"
            )
        self._keys_checked.add(wanted)

    def refuse_null_keys(
        self, rows: Sequence[Mapping[str, Any]], conflict_columns: Sequence[str]
    ) -> None:
        """Refuse an upsert row whose conflict column is None or left out, before
        anything is sent.

        NULLs are never equal in a unique key, on any database: such a row can
        never be matched, so each redelivery of it would add one more row (the
        idempotent sink silently would not be).

        Raises:
            OutputValueError: names the row and the column.
        """
        for index, row in enumerate(rows):
            for column in conflict_columns:
                if row.get(column) is None:
                    # Left out, the database fills it (NULL, or a new AUTO_INCREMENT /
                    # identity value on each write): no upsert matches it either.
                    what = "no value (None) in" if column in row else "no"
                    raise OutputValueError(
                        f"row {index} to upsert into {self.name} has {what} "
                        f"conflict column {column!r}: an upsert can never match it (NULLs "
                        "are never equal in a unique key, and a value the database fills "
                        "in may be new on every write), so each redelivery would add "
                        f"the row again; give every row a value for "
                        f"({', '.join(conflict_columns)})",
                        table=self.name,
                        column=column,
                        value_type="NoneType",
                        row=index,
                    )

    def _refused_value(
        self,
        exc: SQLAlchemyError,
        conn: Connection,
        table: sa.Table,
        rows: Sequence[Mapping[str, Any]],
        columns: Sequence[str],
    ) -> OutputValueError | None:
        """The value a failed write could not send, when it was one (None: the
        database's failure, a lost connection, a constraint): one the column type
        refused (SQLAlchemy raises before the statement runs), or one the driver
        cannot adapt (its message quotes the value's type, or the value)."""
        if isinstance(exc, sa.exc.StatementError) and not isinstance(exc, sa.exc.DBAPIError):
            for column in columns:
                # The dialect's own type converts (a reflected DATETIME is SQLite's there).
                kind = table.c[column].type.dialect_impl(conn.dialect)
                process = kind.bind_processor(conn.dialect)
                if process is None:
                    continue
                for index, row in enumerate(rows):
                    try:
                        process(row.get(column))
                    except (TypeError, ValueError) as refused:
                        first = (str(refused).splitlines() or [""])[0][:200]
                        column_type = table.c[column].type
                        return self._unwritable(index, column, row.get(column), column_type, first)
        text = str(getattr(exc, "orig", None) or exc)
        for index, row in enumerate(rows):
            for column in columns:
                value = row.get(column)
                if value is None or isinstance(value, _SCALARS):
                    continue
                try:
                    shown = str(value)
                except Exception:  # noqa: BLE001 - an object that cannot say itself
                    shown = ""
                quoted = f"'{type(value).__name__}'" in text or (
                    len(shown) >= 3 and f"'{shown}'" in text
                )
                if quoted:
                    column_type = table.c[column].type
                    return self._unwritable(
                        index, column, value, column_type, "the driver cannot send it"
                    )
        return None

    def _unwritable(
        self, index: int, column: str, value: Any, column_type: Any, why: str
    ) -> OutputValueError:
        kind = type(value).__name__
        return OutputValueError(
            f"cannot write row {index} to {self.name}: column {column!r} "
            f"({type_text(column_type)}) cannot "
            f"store a {kind} value" + (f" ({why})" if why else "") + ". Writing it again "
            "cannot help: convert the value first (json.dumps(...) for a dict or a list, "
            "str(...) or a number for an object) or give the column a type that holds it "
            "(JSON)",
            table=self.name,
            column=column,
            value_type=kind,
            row=index,
        )


def _failing_row(
    conn: Connection, statement: Any, rows: Sequence[Mapping[str, Any]], failure: BaseException
) -> int | None:
    """The first of ``rows`` that fails the statement alone as it failed the whole,
    written one by one under a savepoint that is then rolled back (None: not found).

    MariaDB/MySQL only: their multi-row statement failed as a whole, so the
    transaction holds none of its rows and is still usable. (PostgreSQL aborts
    the transaction; SQLite runs the rows one by one, and the rows before the
    failing one stay written, so each would seem to fail on itself.) Used where
    the server does not say which row: the upsert guard, a CHECK, a foreign key.
    A row counts only when its error reads as the statement's did.
    """
    if conn.dialect.name not in ("mysql", "mariadb"):
        return None
    wanted = _error_text(failure)
    try:
        savepoint = conn.begin_nested()
    except SQLAlchemyError:
        return None
    try:
        for index, row in enumerate(rows):
            try:
                conn.execute(statement, [dict(row)])
            except SQLAlchemyError as exc:
                return index if _error_text(exc) == wanted else None
        return None
    finally:
        with contextlib.suppress(SQLAlchemyError):
            savepoint.rollback()


def _error_text(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return re.sub(r" at row \d+", "", str(orig))


def upsert_statement(
    dialect: str, table: sa.Table, columns: Sequence[str], conflict_columns: Sequence[str]
) -> Any:
    """``INSERT ... ON CONFLICT (keys) DO UPDATE`` (PostgreSQL, SQLite) or ``INSERT ...
    ON DUPLICATE KEY UPDATE`` (MariaDB/MySQL) of ``columns``, keyed on ``conflict_columns``."""
    updates = [c for c in columns if c not in conflict_columns]
    if dialect in ("postgresql", "sqlite"):
        # Both spell it INSERT ... ON CONFLICT (keys) DO UPDATE / DO NOTHING.
        from sqlalchemy.dialects import postgresql, sqlite  # noqa: PLC0415

        stmt: postgresql.Insert | sqlite.Insert = (
            postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
        )
        keys = list(conflict_columns)
        if not updates:
            return stmt.on_conflict_do_nothing(index_elements=keys)
        return stmt.on_conflict_do_update(
            index_elements=keys, set_={c: stmt.excluded[c] for c in updates}
        )
    if dialect not in UPSERT_DIALECTS:
        raise ConfigurationError(
            f"upsert is not available on {dialect}: supported are "
            f"{', '.join(sorted(UPSERT_DIALECTS))}"
        )
    from sqlalchemy.dialects.mysql import insert as mysql_insert  # noqa: PLC0415

    my_stmt = mysql_insert(table)
    # ON DUPLICATE KEY UPDATE fires on a duplicate of *any* unique key. A row that
    # hits another row on a different unique column would update that other row
    # (with this row's values) and never be written itself, silently. So the first
    # assignment keeps the key where the row found is the one the conflict columns
    # name, and otherwise fails the statement (a scalar subquery of two rows: an
    # error in every sql_mode), as PostgreSQL and SQLite fail it. Assignments run
    # in order, so this one sees the row as found.
    first = conflict_columns[0]
    same = sa.and_(
        *(table.c[c].is_not_distinct_from(my_stmt.inserted[c]) for c in conflict_columns)
    )
    one: sa.Select[Any] = sa.select(sa.literal_column("1"))  # constants: no bound value
    refuse = one.union_all(sa.select(sa.literal_column("2"))).scalar_subquery()
    guard = (first, sa.case((same, table.c[first]), else_=refuse))
    return my_stmt.on_duplicate_key_update([guard, *((c, my_stmt.inserted[c]) for c in updates)])


__all__ = ["UPSERT_DIALECTS", "WRITE_ATTEMPTS", "TableHandle", "upsert_statement"]
