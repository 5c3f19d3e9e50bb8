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
key a row happens to hit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import NoSuchTableError, SQLAlchemyError

from dbtrigger._database_url import DatabaseUrl
from dbtrigger._driver_errors import short_error
from dbtrigger._engine import LazyEngine
from dbtrigger.errors import ConfigurationError, OutputWriteError
from dbtrigger.names import validate_sql_identifier
from dbtrigger.redaction import safe_url_text

Action = Literal["insert", "upsert"]

#: Dialects with a native upsert statement we know how to build.
UPSERT_DIALECTS = frozenset({"postgresql", "sqlite", "mysql", "mariadb"})

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
        if url is None and engine is None:
            raise ConfigurationError("db.output needs url= or engine=")
        # A dialect without upserts is refused as soon as the URL is known.
        self._db_url = DatabaseUrl(url, engine, "db.output url", self._check_dialect)
        self._engines = LazyEngine(lambda: self._db_url.value, engine_kwargs, engine)
        self._table: sa.Table | None = None

    def _check_dialect(self, url: URL) -> None:
        dialect = url.get_backend_name()
        if self.action == "upsert" and dialect not in UPSERT_DIALECTS:
            raise ConfigurationError(
                f"upsert is not available on {dialect}: supported are "
                f"{', '.join(sorted(UPSERT_DIALECTS))}; use action='insert'"
            )

    @property
    def dialect(self) -> str:
        return self._db_url.value.get_backend_name()

    @property
    def name(self) -> str:
        target = f"{self.schema}.{self.table_name}" if self.schema else self.table_name
        return f"{self.dialect}:{target}"

    def describe(self) -> dict[str, Any]:
        return {
            "url": safe_url_text(self._db_url.value),
            "table": self.table_name,
            "schema": self.schema,
            "action": self.action,
            "conflict_columns": list(self.conflict_columns),
        }

    @property
    def engine(self) -> Engine:
        return self._engines.engine

    def close(self) -> None:
        """Dispose of the connection pool if this target created the engine."""
        self._engines.dispose()

    def _reflect(self, conn: sa.Connection) -> sa.Table:
        if self._table is not None:
            return self._table
        try:
            table = sa.Table(self.table_name, sa.MetaData(), schema=self.schema, autoload_with=conn)
        except NoSuchTableError:
            raise ConfigurationError(
                f"output table {self.name} does not exist (or is not visible to this user)"
            ) from None
        if self.action == "upsert":
            self._check_conflict_key(conn, table)
        self._table = table
        return table

    def _check_conflict_key(self, conn: sa.Connection, table: sa.Table) -> None:
        missing = [c for c in self.conflict_columns if c not in table.c]
        if missing:
            raise ConfigurationError(
                f"output table {self.name} has no column(s) {', '.join(missing)}"
            )
        inspector = sa.inspect(conn)
        keys: list[set[str]] = [{c.name for c in table.primary_key.columns}]
        keys += [
            {c for c in u["column_names"] if c}
            for u in inspector.get_unique_constraints(self.table_name, schema=self.schema)
        ]
        keys += [
            {c for c in i["column_names"] if c}
            for i in inspector.get_indexes(self.table_name, schema=self.schema)
            if i.get("unique")
        ]
        if set(self.conflict_columns) not in keys:
            raise ConfigurationError(
                f"output table {self.name} has no primary key or unique constraint on exactly "
                f"({', '.join(self.conflict_columns)}); an upsert needs one to detect replays"
            )

    def _statement(self, table: sa.Table, columns: Sequence[str]) -> Any:
        if self.action == "insert":
            return sa.insert(table)
        return upsert_statement(self.dialect, table, columns, self.conflict_columns)

    def write(self, rows: Sequence[Row]) -> int:
        """Write ``rows`` in one transaction; returns how many were sent.

        Raises:
            ConfigurationError: the table or a column does not exist, or the
                conflict columns are not a key of the table.
            OutputWriteError: the database refused or failed the write (the
                message names the driver error, never the row values).
        """
        if not rows:
            return 0
        columns = list(rows[0])
        try:
            with self.engine.begin() as conn:
                table = self._reflect(conn)
                unknown = [c for c in columns if c not in table.c]
                if unknown:
                    raise ConfigurationError(
                        f"output table {self.name} has no column(s) {', '.join(unknown)}"
                    )
                conn.execute(self._statement(table, columns), list(rows))
        except ConfigurationError:
            raise
        except SQLAlchemyError as exc:
            raise OutputWriteError(
                f"writing {len(rows)} row(s) to {self.name} failed: {short_error(exc)}",
                table=self.name,
                rows=len(rows),
            ) from exc
        return len(rows)


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
    if not updates:
        # "Update" a key column to itself: a no-op that still swallows the duplicate.
        first = conflict_columns[0]
        return my_stmt.on_duplicate_key_update({first: table.c[first]})
    return my_stmt.on_duplicate_key_update({c: my_stmt.inserted[c] for c in updates})


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
            TypeError: ``value`` is not a mapping or a list of mappings.
            ValueError: the rows do not all have the same columns, or a column
                name is not a plain SQL identifier.
        """
        if value is None:
            rows: list[Row] = []
        elif isinstance(value, Mapping):
            rows = [dict(value)]
        elif isinstance(value, (list, tuple)):
            rows = []
            for index, item in enumerate(value):
                if not isinstance(item, Mapping):
                    raise TypeError(
                        f"out.set(): item {index} is {type(item).__name__}, expected a dict"
                    )
                rows.append(dict(item))
        else:
            raise TypeError(
                f"out.set() takes a dict or a list of dicts, got {type(value).__name__}"
            )
        if rows:
            columns = set(rows[0])
            if not columns:
                raise ValueError("out.set(): a row has no columns")
            for name in columns:
                if not isinstance(name, str):
                    raise TypeError(f"out.set(): column names must be strings, got {name!r}")
                validate_sql_identifier(name, "output column")
            for index, row in enumerate(rows[1:], start=1):
                if set(row) != columns:
                    raise ValueError(
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
