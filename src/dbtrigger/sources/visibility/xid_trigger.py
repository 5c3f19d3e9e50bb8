"""The PostgreSQL transaction-id column that :class:`SnapshotHorizon` polls.

A trigger stamps ``pg_current_xact_id()`` of the writing transaction on every
inserted or updated row, so the cursor order *is* the transaction order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy.engine import Engine

from dbtrigger._lock_wait import (
    DEFAULT_WRITE_LOCK_TIMEOUT,
    bounded_transaction,
    check_lock_timeout,
    ddl_gives_up,
)
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import quoted_name, shortened, validate_sql_identifier
from dbtrigger.sources.visibility.base import XID_COLUMN_MARKER


def visibility_trigger_ddl(
    table: str,
    *,
    schema: str | None = None,
    column: str = "dbtrigger_xid",
    index_columns: Sequence[str] = (),
    quote: Callable[[str], str] | None = None,
) -> list[str]:
    """The PostgreSQL DDL :func:`install_visibility_trigger` runs, for migrations.

    Adds ``column bigint NOT NULL DEFAULT 0`` (existing rows get 0: they were
    committed long ago and sort first; no table rewrite), a function and a
    ``BEFORE INSERT OR UPDATE`` trigger that stamp ``pg_current_xact_id()`` of the
    writing transaction, the marker comment ``auto`` looks for, and an index on
    ``(column, *index_columns)`` (pass the primary key: the fetch orders by it).
    Idempotent. PostgreSQL 13+.
    """
    validate_sql_identifier(table, "table")
    validate_sql_identifier(column, "visibility column")
    if schema is not None:
        validate_sql_identifier(schema, "schema")
    for name in index_columns:
        validate_sql_identifier(name, "index column")
    q = quote or (lambda name: '"' + name + '"')
    target = quoted_name(q, table, schema)
    function = quoted_name(q, shortened(f"dbtrigger_stamp_{table}_{column}"), schema)
    trigger = q(shortened(f"dbtrigger_stamp_{column}"))
    index = q(shortened(f"ix_{table}_{column}"))
    col = q(column)
    index_list = ", ".join([col, *(q(c) for c in index_columns)])
    marker = f"{XID_COLUMN_MARKER} transaction id of the last writer, stamped by trigger {trigger}"
    return [
        "ALTER TABLE " + target + " ADD COLUMN IF NOT EXISTS " + col + " bigint NOT NULL DEFAULT 0",
        "CREATE OR REPLACE FUNCTION " + function + "() RETURNS trigger LANGUAGE plpgsql AS $f$\n"
        "BEGIN\n"
        "    NEW." + col + " := pg_current_xact_id()::text::bigint;\n"
        "    RETURN NEW;\n"
        "END\n"
        "$f$",
        "DROP TRIGGER IF EXISTS " + trigger + " ON " + target,
        "CREATE TRIGGER "
        + trigger
        + " BEFORE INSERT OR UPDATE ON "
        + target
        + " FOR EACH ROW EXECUTE FUNCTION "
        + function
        + "()",
        "COMMENT ON COLUMN " + target + "." + col + " IS '" + marker.replace("'", "''") + "'",
        "CREATE INDEX IF NOT EXISTS " + index + " ON " + target + " (" + index_list + ")",
    ]


def install_visibility_trigger(
    engine: Engine,
    table: str,
    *,
    schema: str | None = None,
    column: str = "dbtrigger_xid",
    index_columns: Sequence[str] = (),
    lock_timeout_seconds: float = DEFAULT_WRITE_LOCK_TIMEOUT,
) -> str:
    """Add and maintain a transaction-id column on a PostgreSQL table; returns its name.

    Poll it with ``SqlAlchemySource(cursor_column=column, pk_columns=[...])``;
    ``auto`` then chooses :class:`SnapshotHorizon`. Runs
    :func:`visibility_trigger_ddl` in one transaction. Needs the privilege to
    alter the table and create a function.

    ``ALTER TABLE`` waits for every transaction open on the table, and while it
    waits every later reader and writer of the table waits behind it: at most
    ``lock_timeout_seconds`` (30 s), then a
    :class:`~dbtrigger.errors.RetryableError` naming who holds locks there;
    nothing changed (the statements run in one transaction).
    """
    if engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"the transaction-id trigger is PostgreSQL-only, not {engine.dialect.name!r}"
        )
    quote = engine.dialect.identifier_preparer.quote
    statements = visibility_trigger_ddl(
        table, schema=schema, column=column, index_columns=index_columns, quote=quote
    )
    seconds = check_lock_timeout(lock_timeout_seconds)
    doing = f"adding the transaction-id column to {table}"
    with (
        ddl_gives_up(engine, table, schema, seconds, doing),
        bounded_transaction(engine, seconds) as conn,
    ):
        for statement in statements:
            conn.exec_driver_sql(statement)
    return column
