"""A source reflects its table from four catalogue reads (``reflect_table(keys_only=True)``):
columns, primary key, indexes, unique constraints. What it reads of the table must be
what a full reflection gives (#26: the other four reads were half of a cold start's
reflection)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger._engine import reflect_table
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, SourceDefinitionError
from dbtrigger.sources.column_checks import unique_keys
from tests.databases import TestDatabase

_DDL = {
    "sqlite": [
        "CREATE TABLE parent (id integer PRIMARY KEY)",
        "CREATE TABLE t (tenant integer NOT NULL, id bigint NOT NULL, "
        "updated_at timestamp, code varchar(20) DEFAULT 'x', owner integer "
        "REFERENCES parent(id), price numeric(10, 2) CHECK (price >= 0), "
        "PRIMARY KEY (tenant, id), CONSTRAINT t_code UNIQUE (code))",
        "CREATE UNIQUE INDEX t_upd ON t (updated_at, id)",
        "CREATE UNIQUE INDEX t_partial ON t (owner) WHERE owner > 0",
    ],
    "postgresql": [
        "CREATE TABLE {s}.parent (id integer PRIMARY KEY)",
        "CREATE TABLE {s}.t (tenant integer NOT NULL, id bigint NOT NULL, "
        "updated_at timestamptz, code varchar(20) DEFAULT 'x', owner integer "
        "REFERENCES {s}.parent(id), price numeric(10, 2) CHECK (price >= 0), "
        "tags text[], doc jsonb, PRIMARY KEY (tenant, id), CONSTRAINT t_code UNIQUE (code))",
        "COMMENT ON TABLE {s}.t IS 'the table'",
        "COMMENT ON COLUMN {s}.t.updated_at IS 'set by the app'",
        "CREATE UNIQUE INDEX t_upd ON {s}.t (updated_at, id)",
        "CREATE UNIQUE INDEX t_partial ON {s}.t (owner) WHERE owner > 0",
        "CREATE INDEX t_lower ON {s}.t (lower(code))",
    ],
    "mariadb": [
        "CREATE TABLE {s}.parent (id integer PRIMARY KEY)",
        "CREATE TABLE {s}.t (tenant integer NOT NULL, id bigint NOT NULL, "
        "updated_at datetime(6) COMMENT 'set by the app', code varchar(20) DEFAULT 'x', "
        "owner integer, price numeric(10, 2) CHECK (price >= 0), "
        "PRIMARY KEY (tenant, id), CONSTRAINT t_code UNIQUE (code), "
        "FOREIGN KEY (owner) REFERENCES {s}.parent(id)) COMMENT 'the table'",
        "CREATE UNIQUE INDEX t_upd ON {s}.t (updated_at, id)",
        "CREATE INDEX t_code_prefix ON {s}.t (code(5))",
    ],
}


def _described(table: sa.Table) -> dict[str, Any]:
    """Everything a source reads of a reflected table."""
    return {
        "columns": [
            (
                c.name,
                repr(c.type),
                c.nullable,
                c.comment,
                c.primary_key,
                str(c.server_default.arg) if c.server_default is not None else None,  # type: ignore[attr-defined]
            )
            for c in table.c
        ],
        "primary_key": (table.primary_key.name, list(table.primary_key.columns.keys())),
        "unique": sorted(
            (str(c.name), tuple(c.columns.keys()))
            for c in table.constraints
            if isinstance(c, sa.UniqueConstraint)
        ),
        "indexes": sorted(
            (
                str(i.name),
                i.unique,
                tuple(str(e) for e in i.expressions),
                sorted((k, str(v)) for k, v in i.dialect_kwargs.items()),
            )
            for i in table.indexes
        ),
        "unique_keys": sorted(unique_keys(table)),
    }


def test_keys_only_reads_what_a_full_reflection_gives(db: TestDatabase) -> None:
    for sql in _DDL[db.kind]:
        db.execute(sql.format(s=db.schema))
    statements: list[str] = []

    def seen(*args: Any) -> None:
        statements.append(args[2])

    with db.engine.connect() as conn:
        full = reflect_table(conn, "t", db.schema)
        sa.event.listen(db.engine, "before_cursor_execute", seen)
        try:
            lean = reflect_table(conn, "t", db.schema, keys_only=True)
        finally:
            sa.event.remove(db.engine, "before_cursor_execute", seen)
        counted = len(statements)
        statements.clear()
        sa.event.listen(db.engine, "before_cursor_execute", seen)
        try:
            reflect_table(conn, "t", db.schema)
        finally:
            sa.event.remove(db.engine, "before_cursor_execute", seen)
    assert _described(lean) == _described(full)
    assert len(full.columns) >= 6
    assert lean.foreign_keys == set()  # not read: a source never looks at them
    if db.kind != "sqlite":
        # (SQLite reads its catalogue through per-table PRAGMAs, cheap either way)
        assert counted < len(statements), (counted, statements)


def test_keys_only_names_a_missing_table(db: TestDatabase) -> None:
    with db.engine.connect() as conn, pytest.raises(ConfigurationError, match="does not exist"):
        reflect_table(conn, "nope", db.schema, shown="x:nope", keys_only=True)


def test_a_source_over_a_lean_reflection_reads_and_checks_as_before(db: TestDatabase) -> None:
    """The source's own use: a key the table does not declare unique is still refused,
    a declared one still accepted."""
    for sql in _DDL[db.kind]:
        db.execute(sql.format(s=db.schema))
    db.execute(f"INSERT INTO {db.qualified('t')} (tenant, id, code) VALUES (1, 7, 'a')")
    # (owner's unique index is partial on PostgreSQL and SQLite: no proof)
    loose = SqlAlchemySource(
        url=db.url, table="t", schema=db.schema, cursor_column="updated_at", pk_columns=["owner"]
    )
    try:
        with pytest.raises(SourceDefinitionError, match="not proven unique"):
            loose.fetch(Position(), 10)
    finally:
        loose.close()
    keyed = SqlAlchemySource(
        url=db.url, table="t", schema=db.schema, cursor_column="id", pk_columns=["tenant"]
    )
    try:
        rows = keyed.fetch(Position(), 10)
        assert [(r["tenant"], r["id"], r["code"]) for r in rows] == [(1, 7, "a")]
    finally:
        keyed.close()
