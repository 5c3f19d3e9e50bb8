"""One table of one database, as the function bindings write and read it (internal).

``db.output``'s :class:`~dbtrigger.output.OutputTarget` and the reader and
writer of :mod:`dbtrigger.dbio` share what a binding needs of its table:

* :class:`TableHandle`: the URL (``%SETTING%`` references read at the first
  use), the engine made once at the first use or shared (``engine=``), and the
  table reflected once, under a lock, with the errors a missing table or column
  is (:class:`~dbtrigger.errors.ConfigurationError`, naming it);
* :func:`upsert_statement`: ``INSERT ... ON CONFLICT`` / ``ON DUPLICATE KEY
  UPDATE`` per dialect.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import NoSuchTableError

from dbtrigger._database_url import DatabaseUrl
from dbtrigger._engine import LazyEngine
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier

#: Dialects with a native upsert statement we know how to build.
UPSERT_DIALECTS = frozenset({"postgresql", "sqlite", "mysql", "mariadb"})


class TableHandle:
    """One database (and optionally one table): the lazily made engine, the reflected
    table. Shared by every invocation of a binding; safe to use from several threads.

    Args:
        what: how errors name the owner (``"db.output"``: "db.output needs url= or
            engine=", "db.output url").
        noun: how errors name the table (``"output table"``).
        check: called with the URL once it is known (a dialect the owner refuses).
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
    ) -> None:
        if url is None and engine is None:
            raise ConfigurationError(f"{what} needs url= or engine=")
        self.what = what
        self.noun = noun
        self.table_name = validate_sql_identifier(table, "table") if table else None
        self.schema = validate_sql_identifier(schema, "schema") if schema else None
        self._db_url = DatabaseUrl(url, engine, f"{what} url", check)
        self._engines = LazyEngine(lambda: self._db_url.value, engine_kwargs, engine)
        self._table: sa.Table | None = None
        self._lock = threading.Lock()

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
                    try:
                        self._table = sa.Table(
                            self.table_name, sa.MetaData(), schema=self.schema, autoload_with=conn
                        )
                    except NoSuchTableError:
                        raise ConfigurationError(
                            f"{self.noun} {self.name} does not exist (or is not visible to "
                            "this user)"
                        ) from None
        return self._table

    def columns(self, conn: Connection, names: Sequence[str]) -> sa.Table:
        """The table, after checking that it has every column of ``names``."""
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


__all__ = ["UPSERT_DIALECTS", "TableHandle", "upsert_statement"]
