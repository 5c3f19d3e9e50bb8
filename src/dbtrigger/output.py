"""``@db.output``: rows the handler hands over, written in one transaction after it returns.

The binding mirrors ``azure.functions.Out``: the handler receives a
:class:`DbOut` and calls ``out.set(rows)``. Nothing touches the database while
the handler runs. When it returns, all rows are written in **one transaction**;
when it raises, they are discarded. Under ``@db.trigger`` this happens inside
the batch, before the checkpoint commit, so a failed write means the batch is
not acknowledged and is delivered again. Combined with ``action="upsert"`` on a
key such as ``(order_id, cursor)`` every redelivery collapses onto the rows
already written: the idempotent-sink pattern, with no code in the handler.

Upserts are built with SQLAlchemy Core per dialect: PostgreSQL and SQLite
``INSERT ... ON CONFLICT (...) DO UPDATE``, MySQL/MariaDB ``INSERT ... ON
DUPLICATE KEY UPDATE``. The conflict columns must be exactly the primary key
or a unique constraint of the table; this is checked when the table is first
reflected, because MySQL would otherwise silently upsert on whichever unique
key a row happens to hit; and a row that hits another unique key than that one
fails the statement there, as it does on PostgreSQL and SQLite
(:func:`~dbtrigger._tables.upsert_statement`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from dbtrigger._lock_wait import DEFAULT_WRITE_LOCK_TIMEOUT
from dbtrigger._tables import (
    UPSERT_DIALECTS,
    TableHandle,
    upsert_statement,
)
from dbtrigger.errors import ConfigurationError, OutputValueError
from dbtrigger.names import validate_sql_identifier
from dbtrigger.redaction import safe_url_text

Action = Literal["insert", "upsert"]

log = logging.getLogger("dbtrigger.output")

Row = dict[str, Any]


class OutputTarget:
    """One configured destination table; shared by every invocation of a function.

    Holds the engine (created on first write) and the reflected table. Safe to
    use from several threads.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        table: str,
        schema: str | None = None,
        action: Action = "insert",
        conflict_columns: Sequence[str] | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        engine: Engine | None = None,
        lock_timeout_seconds: float | None = None,
    ) -> None:
        if action not in ("insert", "upsert"):
            raise ConfigurationError(f"output action must be 'insert' or 'upsert', got {action!r}")
        if isinstance(conflict_columns, str):
            raise ConfigurationError("conflict_columns must be a list of column names")
        self.table_name = validate_sql_identifier(table, "table")
        self.schema = validate_sql_identifier(schema, "schema") if schema else None
        self.action: Action = action
        self.conflict_columns = tuple(
            validate_sql_identifier(c, "conflict column") for c in conflict_columns or ()
        )
        if action == "upsert" and not self.conflict_columns:
            raise ConfigurationError("action='upsert' needs conflict_columns=[...]")
        if action == "insert" and self.conflict_columns:
            raise ConfigurationError("conflict_columns only apply to action='upsert'")
        # A dialect without upserts is refused as soon as the URL is known.
        self._db = TableHandle(
            "db.output",
            url,
            table,
            schema,
            engine,
            engine_kwargs,
            noun="output table",
            check=self._check_dialect,
            lock_timeout_seconds=(
                DEFAULT_WRITE_LOCK_TIMEOUT if lock_timeout_seconds is None else lock_timeout_seconds
            ),
        )
        #: Was the lock timeout given (else the default, which a trigger may lower)?
        self._lock_timeout_given = lock_timeout_seconds is not None

    def fit_lease(self, lease_ttl_seconds: float) -> None:
        """Keep the write's lock wait to a quarter of a trigger's lease TTL, so a write
        waiting behind another transaction gives up long before the lease could lapse
        (another instance would deliver the batch again while this write might still
        land). The default is lowered to fit; a value given that does not fit is a
        ConfigurationError."""
        limit = lease_ttl_seconds / 4
        if self._db.lock_timeout <= limit:
            return
        if self._lock_timeout_given:
            raise ConfigurationError(
                f"@db.output({self.table_name!r}): lock_timeout_seconds="
                f"{self._db.lock_timeout:g} does not fit the trigger's lease "
                f"(lease_ttl_seconds={lease_ttl_seconds:g}): a write waiting that long "
                f"for a lock could outlive the lease; use at most {limit:g} (a quarter "
                "of the lease TTL) or raise lease_ttl_seconds"
            )
        self._db.lock_timeout = limit

    def _check_dialect(self, url: URL) -> None:
        dialect = url.get_backend_name()
        if self.action == "upsert" and dialect not in UPSERT_DIALECTS:
            raise ConfigurationError(
                f"upsert is not available on {dialect}: supported are "
                f"{', '.join(sorted(UPSERT_DIALECTS))}; use action='insert'"
            )

    @property
    def dialect(self) -> str:
        return self._db.dialect

    @property
    def name(self) -> str:
        return self._db.name

    def describe(self) -> dict[str, Any]:
        return {
            "url": safe_url_text(self._db.url),
            "table": self.table_name,
            "schema": self.schema,
            "action": self.action,
            "conflict_columns": list(self.conflict_columns),
            "lock_timeout_seconds": self._db.lock_timeout,
        }

    @property
    def engine(self) -> Engine:
        return self._db.engine

    @property
    def lock_timeout_seconds(self) -> float:
        """How long a write waits for another transaction's lock before it gives up."""
        return self._db.lock_timeout

    def close(self) -> None:
        """Dispose of the connection pool if this target created the engine."""
        self._db.close()

    def _table(self, conn: sa.Connection, columns: Sequence[str]) -> sa.Table:
        """The table (reflected once), its conflict key checked once, with ``columns``."""
        if self.action == "upsert":
            self._db.check_conflict_key(conn, self.conflict_columns)
        return self._db.columns(conn, columns)

    def _statement(self, table: sa.Table, columns: Sequence[str]) -> Any:
        if self.action == "insert":
            return sa.insert(table)
        return upsert_statement(self.dialect, table, columns, self.conflict_columns)

    def write(self, rows: Sequence[Row]) -> int:
        """Write ``rows`` in one transaction; returns how many were sent.

        Raises:
            ConfigurationError: the table or a column does not exist, the rows do
                not all have the same columns, or the conflict columns are not a key
                of the table.
            OutputValueError: a value its column cannot store (a dict in a text
                column, an object the driver cannot send), or an upsert row with
                None in a conflict column; nothing is written.
            OutputConstraintError: a row breaks a rule of the table (a unique key
                other than the conflict key, NOT NULL, CHECK): not retryable; the
                message names the constraint, its columns and the row's key.
            OutputReferenceError: a row's foreign key finds no row (retryable).
            OutputLockTimeoutError: the write waited ``lock_timeout_seconds`` for
                a lock another transaction holds (retryable; nothing written).
            OutputWriteError: the database refused or failed the write (the
                message names the driver error, never the row values). A
                deadlock or serialization failure is written again first, up to
                ``WRITE_ATTEMPTS`` times in all.
        """
        if not rows:
            return 0
        columns = list(rows[0])
        for index, row in enumerate(rows):
            if set(row) != set(columns):
                # A column only a later row names would be left out of the statement
                # (its values dropped, silently); one it lacks failed as a retryable error.
                raise ConfigurationError(
                    f"row {index} to write to {self.name} has columns {sorted(row)}, row 0 "
                    f"has {sorted(columns)}; give every row the same columns (None for NULL)"
                )
        if self.action == "upsert":
            self._db.refuse_null_keys(rows, self.conflict_columns)

        def work(conn: Connection) -> int:
            table = self._table(conn, columns)
            statement = self._statement(table, columns)
            self._db.write(conn, table, statement, rows, conflict_columns=self.conflict_columns)
            return len(rows)

        return self._db.transact(
            f"writing {len(rows)} row(s) to",
            len(rows),
            work,
            conflict_columns=self.conflict_columns,
        )


class DbOut:
    """The handler's handle on an output binding (like ``azure.functions.Out``).

    ``set()`` replaces what is pending, as ``Out.set`` does; the rows are
    written once the handler returns. ``set([])`` and ``set(None)`` leave
    nothing to write.
    """

    def __init__(self, target: OutputTarget) -> None:
        self._target = target
        self._rows: list[Row] = []

    @property
    def target(self) -> OutputTarget:
        return self._target

    def set(self, value: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None) -> None:
        """Rows to write after the handler returns: a dict, a list of dicts, or None.

        Raises:
            OutputValueError: ``value`` is not a mapping or a list of mappings,
                or a column name is not a string (a ``TypeError`` too).
            ConfigurationError: the rows do not all have the same columns, or a
                column name is not a plain SQL identifier (a ``ValueError`` too).
        """
        if value is None:
            rows: list[Row] = []
        elif isinstance(value, Mapping):
            rows = [dict(value)]
        elif isinstance(value, (list, tuple)):
            rows = []
            for index, item in enumerate(value):
                if not isinstance(item, Mapping):
                    raise OutputValueError(
                        f"out.set(): item {index} is {type(item).__name__}, expected a dict",
                        value_type=type(item).__name__,
                    )
                rows.append(dict(item))
        else:
            raise OutputValueError(
                f"out.set() takes a dict or a list of dicts, got {type(value).__name__}",
                value_type=type(value).__name__,
            )
        if rows:
            columns = set(rows[0])
            if not columns:
                raise ConfigurationError("out.set(): a row has no columns")
            for name in columns:
                if not isinstance(name, str):
                    raise OutputValueError(
                        f"out.set(): column names must be strings, got {type(name).__name__}",
                        value_type=type(name).__name__,
                    )
                validate_sql_identifier(name, "output column")
            for index, row in enumerate(rows[1:], start=1):
                if set(row) != columns:
                    raise ConfigurationError(
                        f"out.set(): row {index} has columns {sorted(row)}, "
                        f"row 0 has {sorted(columns)}; all rows must have the same columns"
                    )
        self._rows = rows

    def get(self) -> list[Row]:
        """The rows that will be written (a copy)."""
        return [dict(r) for r in self._rows]

    def flush(self) -> int:
        """Write the pending rows now, in one transaction; returns how many."""
        rows, self._rows = self._rows, []
        return self._target.write(rows)


__all__ = ["DbOut", "OutputTarget"]
