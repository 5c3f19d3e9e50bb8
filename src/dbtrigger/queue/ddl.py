"""The DDL that makes a table a queue, and the DDL that undoes it.

``dbtrigger queue install`` prints these statements (a dry run) and runs them
with ``--yes``. Each is rendered by SQLAlchemy for the target dialect from
column and index objects (identifiers validated and quoted), so what is
printed is exactly what runs.

Columns mode adds the claim columns (:mod:`dbtrigger.queue.schema`) to the
user's table and one index for the claim:

* PostgreSQL and SQLite: a *partial* index on ``dbt_visible_at`` over rows in
  a claimable status. It holds the backlog only, so it stays small however
  many finished rows the table keeps, and a claim is an index range scan.
* MariaDB/MySQL have no partial indexes: a plain index on ``dbt_visible_at``.
  Finished rows get a far-future ``dbt_visible_at``, so they sit at the end of
  the index, outside the ``<= now`` range every claim reads.

Existing rows: the new columns default to ``ready`` / visible now, so rows that
are already in the table when the queue is installed are delivered too.
``existing="done"`` marks them done instead (a table that already holds
processed history).

SQLite cannot add a column whose default is an expression, so there
``dbt_visible_at`` defaults to the epoch (claimable at once; among rows with
that value the claim takes them in insertion order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.schema import CreateColumn, CreateIndex, DropIndex

from dbtrigger.queue.schema import (
    CLAIM_COLUMNS,
    DONE,
    DONE_AT,
    STATUS,
    VISIBLE_AT,
    DialectTime,
    index_name,
)

_SQLITE_EPOCH = "'1970-01-01 00:00:00.000'"


def _columns_for(time: DialectTime) -> list[sa.Column[Any]]:
    columns = time.claim_columns()
    if time.dialect == "sqlite":
        for column in columns:
            if column.name == VISIBLE_AT:
                column.server_default = sa.schema.DefaultClause(sa.text(_SQLITE_EPOCH))
    return columns


def _table_ref(dialect: Dialect, table: sa.Table) -> str:
    return dialect.identifier_preparer.format_table(table)


def install_columns(conn: Connection, table: sa.Table, *, existing: str = "ready") -> list[str]:
    """Statements adding the missing claim columns and the claim index to ``table``.

    ``table`` is the reflected user table; columns and an index already there
    are left alone, so running install twice is harmless.
    """
    dialect = conn.dialect
    time = DialectTime(dialect.name)
    ref = _table_ref(dialect, table)
    missing = [c for c in _columns_for(time) if c.name not in table.c]
    statements: list[str] = []
    if missing:
        specs = [str(CreateColumn(c).compile(dialect=dialect)) for c in missing]
        if time.dialect == "sqlite":
            statements += ["ALTER TABLE " + ref + " ADD COLUMN " + spec for spec in specs]
        else:
            statements.append(
                "ALTER TABLE " + ref + " " + ", ".join("ADD COLUMN " + spec for spec in specs)
            )
    shadow = _with_claim_columns(table, time)
    name = index_name(table.name)
    if not any(index.name == name for index in table.indexes):
        statements.append(
            str(CreateIndex(time.claimable_index(shadow, name)).compile(dialect=dialect))
        )
    if missing and existing == DONE:
        update = sa.update(shadow).values(
            {STATUS: DONE, DONE_AT: time.now(), VISIBLE_AT: time.far_future()}
        )
        statements.append(
            str(update.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        )
    return statements


def uninstall_columns(conn: Connection, table: sa.Table) -> list[str]:
    """Statements removing the claim index and columns from ``table``."""
    dialect = conn.dialect
    time = DialectTime(dialect.name)
    ref = _table_ref(dialect, table)
    statements: list[str] = []
    name = index_name(table.name)
    for index in table.indexes:
        if index.name == name:
            statements.append(str(DropIndex(index).compile(dialect=dialect)))
    present = [c for c in CLAIM_COLUMNS if c in table.c]
    quote = dialect.identifier_preparer.quote
    if time.dialect == "sqlite":
        statements += ["ALTER TABLE " + ref + " DROP COLUMN " + quote(c) for c in present]
    elif present:
        statements.append(
            "ALTER TABLE " + ref + " " + ", ".join("DROP COLUMN " + quote(c) for c in present)
        )
    return statements


def _with_claim_columns(table: sa.Table, time: DialectTime) -> sa.Table:
    """A stand-in of ``table`` that certainly has the claim columns (for rendering)."""
    shadow = sa.Table(table.name, sa.MetaData(), schema=table.schema)
    for column in table.c:
        shadow.append_column(sa.Column(column.name, column.type))
    for column in _columns_for(time):
        if column.name not in shadow.c:
            shadow.append_column(column)
    return shadow


def apply(conn: Connection, statements: Sequence[str]) -> None:
    """Run rendered DDL statements in order (the caller owns the transaction)."""
    for statement in statements:
        conn.exec_driver_sql(statement)
