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

``priority=True`` (``queue install --priority``) adds ``dbt_priority`` and
puts the index ``(dbt_priority, dbt_visible_at)``, which prioritised claims
scan (see :meth:`~dbtrigger.queue.schema.DialectTime.priority_index`), in
place of the ``dbt_visible_at`` one: with both, the planner may walk the
``dbt_visible_at`` index past every due row of the lower priorities to find
those of the one it wants, which is the O(backlog) claim priority must not
cost (and every claim and settlement would maintain two indexes). A table
that has ``dbt_priority`` keeps that layout when install runs again.

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

from dbtrigger.errors import ConfigurationError
from dbtrigger.queue.schema import (
    CLAIM_COLUMNS,
    DONE,
    DONE_AT,
    PRIORITY,
    STATUS,
    VISIBLE_AT,
    DialectTime,
    index_name,
)

_SQLITE_EPOCH = "'1970-01-01 00:00:00.000'"


def _columns_for(time: DialectTime, *, priority: bool = False) -> list[sa.Column[Any]]:
    columns = time.claim_columns() + ([time.priority_column()] if priority else [])
    if time.dialect == "sqlite":
        for column in columns:
            if column.name == VISIBLE_AT:
                column.server_default = sa.schema.DefaultClause(sa.text(_SQLITE_EPOCH))
    return columns


def _table_ref(dialect: Dialect, table: sa.Table) -> str:
    return dialect.identifier_preparer.format_table(table)


def install_columns(
    conn: Connection, table: sa.Table, *, existing: str = "ready", priority: bool = False
) -> list[str]:
    """Statements adding the missing claim columns and the claim index to ``table``
    (with ``priority``, ``dbt_priority`` and its index too).

    ``table`` is the reflected user table; columns and an index already there
    are left alone, so running install twice is harmless, and running it again
    with ``priority`` adds only what priority needs.
    """
    dialect = conn.dialect
    time = DialectTime(dialect.name)
    ref = _table_ref(dialect, table)
    priority = priority or PRIORITY in table.c
    missing = [c for c in _columns_for(time, priority=priority) if c.name not in table.c]
    fresh = any(c.name == STATUS for c in missing)
    statements: list[str] = []
    if missing:
        specs = [str(CreateColumn(c).compile(dialect=dialect)) for c in missing]
        if time.dialect == "sqlite":
            statements += ["ALTER TABLE " + ref + " ADD COLUMN " + spec for spec in specs]
        else:
            statements.append(
                "ALTER TABLE " + ref + " " + ", ".join("ADD COLUMN " + spec for spec in specs)
            )
    shadow = _with_claim_columns(table, time, priority=priority)
    name = index_name(table.name)
    existing_claim_index = [index for index in table.indexes if index.name == name]
    if not priority and not existing_claim_index:
        _refuse_taken(conn, table, name)
        statements.append(
            str(CreateIndex(time.claimable_index(shadow, name)).compile(dialect=dialect))
        )
    ranked = index_name(table.name, "priority")
    if priority and not any(index.name == ranked for index in table.indexes):
        _refuse_taken(conn, table, ranked)
        statements.append(
            str(CreateIndex(time.priority_index(shadow, ranked)).compile(dialect=dialect))
        )
    if priority:
        statements += [str(DropIndex(i).compile(dialect=dialect)) for i in existing_claim_index]
    if fresh and existing == DONE:
        update = sa.update(shadow).values(
            {STATUS: DONE, DONE_AT: time.now(), VISIBLE_AT: time.far_future()}
        )
        statements.append(
            str(update.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        )
    return statements


def _refuse_taken(conn: Connection, table: sa.Table, name: str) -> None:
    """Refuse, before anything runs, an index name another table's index holds.

    PostgreSQL and SQLite want index names unique in the schema, and a table
    renamed keeps its indexes' names: after ``jobs`` became ``jobs_old`` and a new
    ``jobs`` was made, install added the claim columns to it and then failed on
    ``CREATE INDEX ix_jobs_dbt_claimable`` in the driver's words, on every run,
    leaving a queue without its claim index. MariaDB/MySQL name indexes per table.
    """
    dialect = conn.dialect.name
    if dialect == "postgresql":
        found = conn.execute(
            sa.text(
                "SELECT t.relname FROM pg_class i "
                "JOIN pg_namespace n ON n.oid = i.relnamespace "
                "LEFT JOIN pg_index x ON x.indexrelid = i.oid "
                "LEFT JOIN pg_class t ON t.oid = x.indrelid "
                "WHERE i.relname = :name AND n.nspname = coalesce(:schema, current_schema())"
            ),
            {"name": name, "schema": table.schema},
        ).first()
        rename = f"ALTER INDEX {_qualified(table.schema, name)} RENAME TO <another name>"
    elif dialect == "sqlite" and table.schema is None:
        found = conn.execute(
            sa.text("SELECT tbl_name FROM sqlite_master WHERE name = :name"), {"name": name}
        ).first()
        rename = f"DROP INDEX {name} and create it again under another name"
    else:
        return
    if found is None or found[0] == table.name:
        return
    holder = f"an index of table {found[0]}" if found[0] else "another object"
    raise ConfigurationError(
        f"cannot install the queue on {table.name}: the claim index's name {name} is "
        f"taken by {holder} in the same schema (a queue table renamed keeps its indexes' "
        f"names, and this database wants them unique in the schema); nothing was changed. "
        f"Free the name ({rename}), or drop {found[0] or 'that object'}, then run "
        "install again"
    )


def _qualified(schema: str | None, name: str) -> str:
    return f"{schema}.{name}" if schema else name


def uninstall_columns(conn: Connection, table: sa.Table) -> list[str]:
    """Statements removing the claim index and columns from ``table``."""
    dialect = conn.dialect
    time = DialectTime(dialect.name)
    ref = _table_ref(dialect, table)
    statements: list[str] = []
    names = {index_name(table.name), index_name(table.name, "priority")}
    for index in table.indexes:
        if index.name in names:
            statements.append(str(DropIndex(index).compile(dialect=dialect)))
    present = [c for c in (*CLAIM_COLUMNS, PRIORITY) if c in table.c]
    quote = dialect.identifier_preparer.quote
    if time.dialect == "sqlite":
        statements += ["ALTER TABLE " + ref + " DROP COLUMN " + quote(c) for c in present]
    elif present:
        statements.append(
            "ALTER TABLE " + ref + " " + ", ".join("DROP COLUMN " + quote(c) for c in present)
        )
    return statements


def _with_claim_columns(table: sa.Table, time: DialectTime, *, priority: bool) -> sa.Table:
    """A stand-in of ``table`` that certainly has the claim columns (for rendering)."""
    shadow = sa.Table(table.name, sa.MetaData(), schema=table.schema)
    for column in table.c:
        shadow.append_column(sa.Column(column.name, column.type))
    for column in _columns_for(time, priority=priority):
        if column.name not in shadow.c:
            shadow.append_column(column)
    return shadow


def apply(conn: Connection, statements: Sequence[str]) -> None:
    """Run rendered DDL statements in order (the caller owns the transaction)."""
    for statement in statements:
        conn.exec_driver_sql(statement)
