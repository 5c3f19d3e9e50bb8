"""The change log's DDL: one log table and row triggers, per dialect.

A keyset poller sees the *current* state of a row, so it cannot see a hard
delete and collapses several updates into the latest state. A change log
written by ``AFTER INSERT/UPDATE/DELETE`` row triggers records every change, in
the writing transaction, with the row before and after it. Polling the log by
its sequence number then gives one event per change.

Layout of the log of table ``orders`` (``dbt_changelog_orders``)::

    dbt_seq         bigint, assigned by the database, primary key: the cursor
    dbt_op          'insert' | 'update' | 'delete' | 'upsert' (snapshot) | 'truncate'
    <pk columns>    copies of the table's primary key (its own names and types);
                    NULL only when a trigger could not read the key (see below)
    dbt_before      the row before the change, JSON text (NULL for an insert)
    dbt_after       the row after the change, JSON text (NULL for a delete)
    dbt_txid        the writing transaction's id (PostgreSQL; NULL elsewhere)
    dbt_changed_at  when the change was written (database clock)

Why the sequence, not the transaction id, is the cursor: two transactions that
change the same row are serialised by its row lock, so the later change takes
the later sequence number; the transaction id of the later change can be the
smaller one. Sequence order is therefore the order of changes *per key*, which
is the order the events must arrive in. Rows that commit out of sequence order
are the ordinary late-commit problem, handled by the source's visibility guard.

The triggers must never make an application write fail, whatever DDL the
table goes through after install (:mod:`dbtrigger.changelog.triggers` says how
per dialect); what the DDL does to the log is then found by
:mod:`dbtrigger.changelog.drift` and repaired by installing again.

Every generated trigger carries :data:`MARKER` and a description of the table
it was generated for (:func:`marker_text`); install refuses to replace a
trigger of the same name without the marker (someone else's trigger), and
uninstall only drops triggers that carry it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from dbtrigger._engine import reflect_table as reflect_sa_table
from dbtrigger.changelog.readers import readers_ddl, readers_table_name
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import quoted_name, shortened, validate_sql_identifier

#: What every trigger the change log writes says about itself (with its version).
MARKER_PREFIX = "dbtrigger-changelog v"

#: The current trigger version. v1 named every column in its row images and
#: broke application writes after a DROP/RENAME COLUMN; v2 never fails a write;
#: v3 logs a PostgreSQL ``TRUNCATE`` (a statement trigger), and is the first
#: version number given to the SQLite triggers that hex-encode bytes in any
#: column and the MariaDB/MySQL triggers that catch error 4038 (both written
#: under v2 by later releases, so a v2 install may lack either).
VERSION = 3

#: What each older version lacks, as ``changelog check`` reports it.
OLDER_VERSIONS = {
    1: "its triggers break the application's writes after a DROP or RENAME COLUMN and log a "
    "key change as one update",
    2: "a TRUNCATE is not logged on PostgreSQL, and its triggers may predate two fixes: on "
    "SQLite bytes in a column of a non-binary type fail the application's write; on "
    "MariaDB/MySQL a column JSON cannot render fails it (error 4038)",
}

#: ``dbt_op`` is as wide as the longest operation, ``truncate`` (v2 logs: 6).
OP_WIDTH = 8

#: Written into every trigger (body comment) the change log installs.
MARKER = f"{MARKER_PREFIX}{VERSION}"

#: The log's own columns; the table's key columns sit between op and before.
LOG_COLUMNS = ("dbt_seq", "dbt_op", "dbt_before", "dbt_after", "dbt_txid", "dbt_changed_at")

SUPPORTED_DIALECTS = ("postgresql", "mysql", "mariadb", "sqlite")

#: MariaDB/MySQL limit identifiers to 64 characters, PostgreSQL to 63 bytes.
MAX_IDENTIFIER = 63


def log_table_name(table: str) -> str:
    """``dbt_changelog_<table>``, shortened with a hash when too long."""
    return shortened(f"dbt_changelog_{table}")


@dataclass(frozen=True)
class ColumnInfo:
    """What the DDL needs of one column of the watched table."""

    name: str
    sql_type: str
    binary: bool = False
    #: MariaDB/MySQL BIT: JSON_OBJECT writes its raw bytes, which are not JSON;
    #: the row triggers log it as its number instead.
    bit: bool = False


@dataclass(frozen=True)
class TableInfo:
    """The watched table as reflected at install time."""

    dialect: str
    table: str
    schema: str | None
    pk: tuple[ColumnInfo, ...]
    columns: tuple[ColumnInfo, ...]
    #: MariaDB (not MySQL): ``CREATE OR REPLACE TRIGGER`` swaps a trigger atomically.
    mariadb: bool = False

    @property
    def log_table(self) -> str:
        return log_table_name(self.table)

    @property
    def row_triggers(self) -> bool:
        """MariaDB/MySQL and SQLite: one trigger per operation, naming the columns."""
        return self.dialect != "postgresql"

    def trigger_names(self) -> tuple[str, ...]:
        """PostgreSQL: one row trigger for all three operations and one statement trigger
        for ``TRUNCATE``; elsewhere one row trigger each."""
        base = f"dbt_cl_{self.table}"
        if self.dialect == "postgresql":
            return (shortened(base), shortened(f"{base}_trunc"))
        return tuple(shortened(f"{base}_{op}") for op in ("ins", "upd", "del"))

    @property
    def function_name(self) -> str:
        return shortened(f"dbt_cl_{self.table}_fn")

    def spec(self) -> dict[str, Any]:
        """What a trigger was generated from, written into its marker comment.

        PostgreSQL's trigger names no column of the table (row images are
        ``to_jsonb``), only the key it copies; the row triggers elsewhere name
        every column, and hex-encode the binary ones.
        """
        out: dict[str, Any] = {"key": [c.name for c in self.pk]}
        if self.row_triggers:
            out["columns"] = [c.name for c in self.columns]
            out["binary"] = [c.name for c in self.columns if c.binary]
            bits = [c.name for c in self.columns if c.bit]
            if bits:  # (absent when none: the markers of other tables stay as they were)
                out["bit"] = bits
        return out


def marker_text(info: TableInfo) -> str:
    """``dbtrigger-changelog v2 {"key": [...], ...}``: the marker and the trigger's spec."""
    return f"{MARKER} {json.dumps(info.spec(), separators=(',', ':'))}"


_MARKER_RE = re.compile(re.escape(MARKER_PREFIX) + r"(\d+)(?: (\{[^}]*\}))?")


def read_marker(text: str) -> tuple[int, dict[str, Any] | None] | None:
    """(version, spec) from a trigger's text; None when the change log did not write it."""
    match = _MARKER_RE.search(text)
    if match is None:
        return None
    spec: dict[str, Any] | None = None
    if match.group(2):
        try:
            loaded = json.loads(match.group(2))
        except ValueError:
            loaded = None
        spec = loaded if isinstance(loaded, dict) else None
    return int(match.group(1)), spec


def reflect_table(conn: sa.Connection, table: str, schema: str | None) -> TableInfo:
    """Read the table's key and columns; refuse tables the log cannot describe."""
    dialect = conn.dialect.name
    if dialect not in SUPPORTED_DIALECTS:
        raise ConfigurationError(
            f"the change log supports {', '.join(SUPPORTED_DIALECTS)}, not {dialect!r}"
        )
    validate_sql_identifier(table, "table")
    if schema is not None:
        validate_sql_identifier(schema, "schema")
    if dialect == "sqlite" and schema not in (None, "main"):
        raise ConfigurationError("on SQLite the change log supports the main schema only")
    if len(table) > MAX_IDENTIFIER - len("dbt_cl_") - 4:
        raise ConfigurationError(f"table name {table!r} is too long for the change log's names")
    reflected = reflect_sa_table(conn, table, schema)
    if not reflected.primary_key.columns:
        raise ConfigurationError(
            f"table {table!r} has no primary key: the change log keys every change by it"
        )
    compiler = conn.dialect.type_compiler_instance
    spatial = _spatial_columns(conn, table, schema) if dialect in ("mysql", "mariadb") else set()

    def info(column: sa.Column[Any]) -> ColumnInfo:
        validate_sql_identifier(column.name, "column")
        try:
            sql_type = compiler.process(column.type)
        except sa.exc.CompileError:
            # A type SQLAlchemy does not know (xml, PostGIS, MariaDB's POINT): only a
            # key column's type is ever written out (the log's copy of the key).
            if column.primary_key:
                raise ConfigurationError(
                    f"key column {column.name!r} of {table!r} has a type SQLAlchemy does not "
                    "know, and the change log copies the key into a column of the same type: "
                    "use a key of a standard type"
                ) from None
            sql_type = ""
        return ColumnInfo(
            name=column.name,
            sql_type=sql_type,
            binary=isinstance(column.type, sa.LargeBinary | sa.types._Binary)
            or column.name in spatial,
            bit=isinstance(column.type, mysql.BIT),
        )

    for column in reflected.primary_key.columns:
        # Key columns are copied into the log, next to its own dbt_ columns;
        # other columns only appear in the row images, where any name is fine.
        if column.name.startswith("dbt_"):
            raise ConfigurationError(
                f"key column {column.name!r} of {table!r} uses the change log's reserved "
                "prefix dbt_"
            )
    return TableInfo(
        dialect=dialect,
        table=table,
        schema=schema if dialect != "sqlite" else None,
        pk=tuple(info(c) for c in reflected.primary_key.columns),
        columns=tuple(info(c) for c in reflected.columns),
        mariadb=dialect == "mariadb" or bool(getattr(conn.dialect, "is_mariadb", False)),
    )


#: MariaDB/MySQL spatial types: bytes (SRID and WKB) that SQLAlchemy reflects as
#: an unknown type, and JSON_OBJECT would write as text, one character per byte.
_SPATIAL_TYPES = (
    "geometry",
    "point",
    "linestring",
    "polygon",
    "multipoint",
    "multilinestring",
    "multipolygon",
    "geometrycollection",
)


def _spatial_columns(conn: sa.Connection, table: str, schema: str | None) -> set[str]:
    """The columns of ``table`` of a spatial type: the row images hold them as hex."""
    rows = conn.execute(
        sa.text(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = coalesce(:schema, DATABASE()) AND TABLE_NAME = :table "
            "AND LOWER(DATA_TYPE) IN :types"
        ).bindparams(sa.bindparam("types", expanding=True)),
        {"schema": schema, "table": table, "types": list(_SPATIAL_TYPES)},
    )
    return {str(name) for (name,) in rows}


Quote = Callable[[str], str]


#: Per dialect, the types of the log's own columns: ``dbt_seq``, the row images, ``dbt_changed_at``.
_LOG_TYPES = {
    "postgresql": (
        "BIGSERIAL PRIMARY KEY",
        "TEXT",
        "TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()",
    ),
    "sqlite": (
        "INTEGER PRIMARY KEY AUTOINCREMENT",
        "TEXT",
        "TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))",
    ),
    "mysql": (
        "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
        "LONGTEXT",
        "DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)",
    ),
}


def log_ddl(info: TableInfo, quote: Quote) -> list[str]:
    """The log table first, then its index (and comment), then the readers' registry
    (:mod:`dbtrigger.changelog.readers`); idempotent."""
    log = qualified_name(info, info.log_table, quote)
    seq, text, changed_at = _LOG_TYPES.get(info.dialect, _LOG_TYPES["mysql"])
    table = _log_table_ddl(info, quote, seq=seq, text=text, changed_at=changed_at)
    registry = readers_ddl(info.table, qualified_name(info, readers_table_name(info.table), quote))
    if info.dialect == "postgresql":
        comment = f"COMMENT ON TABLE {log} IS '{MARKER}: changes of {info.table}'"
        return [table, _index_ddl(info, quote), comment, registry]
    if info.dialect == "sqlite":
        return [table, _index_ddl(info, quote), registry]
    return [
        table + f" COMMENT='{MARKER}: changes of {info.table}'",
        _index_ddl(info, quote),
        registry,
    ]


def uninstall_ddl(info: TableInfo, quote: Quote, *, drop_log: bool) -> list[str]:
    """Drop the triggers (and the function); the log table only with ``drop_log``."""
    target = qualified_name(info, info.table, quote)
    statements: list[str] = []
    for trigger in info.trigger_names():
        if info.dialect == "postgresql":
            statements.append(f"DROP TRIGGER IF EXISTS {quote(trigger)} ON {target}")
        else:
            statements.append(f"DROP TRIGGER IF EXISTS {qualified_name(info, trigger, quote)}")
    if info.dialect == "postgresql":
        statements.append(
            f"DROP FUNCTION IF EXISTS {qualified_name(info, info.function_name, quote)}()"
        )
    if drop_log:
        statements.append(f"DROP TABLE IF EXISTS {qualified_name(info, info.log_table, quote)}")
        registry = qualified_name(info, readers_table_name(info.table), quote)
        statements.append(f"DROP TABLE IF EXISTS {registry}")
    return statements


def qualified_name(info: TableInfo, name: str, quote: Quote) -> str:
    """``name`` in the schema of ``info``'s table, quoted (:func:`names.quoted_name`)."""
    return quoted_name(quote, name, info.schema)


def keys_nullable(info: TableInfo) -> bool:
    """Whether the log's key columns take NULL: where a trigger may not read the key.

    On PostgreSQL and MariaDB/MySQL a trigger that cannot read or store the key
    (the key column renamed, dropped, or retyped beyond the log's column) still
    logs the change, with a NULL key, rather than fail the write. SQLite
    rewrites a trigger when a column it names is renamed and refuses to drop
    one, so its triggers always read the key.
    """
    return info.dialect != "sqlite"


def _log_table_ddl(info: TableInfo, quote: Quote, seq: str, text: str, changed_at: str) -> str:
    log = qualified_name(info, info.log_table, quote)
    # NULL everywhere: a ``truncate`` row has no key (SQLite logs before v3: NOT NULL).
    null = "NULL"
    keys = ",\n  ".join(f"{quote(c.name)} {c.sql_type} {null}" for c in info.pk)
    return (
        f"CREATE TABLE IF NOT EXISTS {log} (\n"
        f"  dbt_seq {seq},\n"
        f"  dbt_op VARCHAR({OP_WIDTH}) NOT NULL,\n"
        f"  {keys},\n"
        f"  dbt_before {text},\n"
        f"  dbt_after {text},\n"
        "  dbt_txid BIGINT,\n"
        f"  dbt_changed_at {changed_at}\n"
        ")"
    )


def _index_ddl(info: TableInfo, quote: Quote) -> str:
    """``(dbt_seq, pk...)``: the keyset the source compares and orders by.

    MySQL has no ``CREATE INDEX IF NOT EXISTS``; install adds it there only when
    :func:`has_index` says it is missing.
    """
    name = quote(index_name(info))
    columns = ", ".join(["dbt_seq", *(quote(c.name) for c in info.pk)])
    log = qualified_name(info, info.log_table, quote)
    if info.dialect in ("mysql", "mariadb"):
        return f"CREATE INDEX {name} ON {log} ({columns})"
    return f"CREATE INDEX IF NOT EXISTS {name} ON {log} ({columns})"


def index_name(info: TableInfo) -> str:
    return shortened(f"ix_{info.log_table}_seq")


def existing_triggers(conn: sa.Connection, info: TableInfo) -> dict[str, str]:
    """Trigger name -> definition text, for the names the change log would use."""
    return triggers_named(conn, info.dialect, info.schema, info.trigger_names())


#: Per dialect, the query for trigger name -> definition text (PostgreSQL: with its
#: function's body); any other dialect reads SQLite's catalog, which has no schema.
_TRIGGERS_NAMED = {
    "postgresql": sa.text(
        "SELECT t.tgname, pg_get_triggerdef(t.oid) || ' ' || coalesce(p.prosrc, '') "
        "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_proc p ON p.oid = t.tgfoid "
        "WHERE NOT t.tgisinternal AND t.tgname = ANY(:names) "
        "AND n.nspname = coalesce(:schema, current_schema())"
    ),
    "mysql": sa.text(
        "SELECT TRIGGER_NAME, ACTION_STATEMENT FROM information_schema.TRIGGERS "
        "WHERE TRIGGER_SCHEMA = coalesce(:schema, DATABASE()) "
        "AND TRIGGER_NAME IN :names"
    ).bindparams(sa.bindparam("names", expanding=True)),
    "sqlite": sa.text(
        "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND name IN :names"
    ).bindparams(sa.bindparam("names", expanding=True)),
}
_TRIGGERS_NAMED["mariadb"] = _TRIGGERS_NAMED["mysql"]


def triggers_named(
    conn: sa.Connection, dialect: str, schema: str | None, names: Sequence[str]
) -> dict[str, str]:
    """Trigger name -> definition text (PostgreSQL: with its function's body)."""
    query = _TRIGGERS_NAMED.get(dialect, _TRIGGERS_NAMED["sqlite"])
    rows = conn.execute(query, {"names": list(names), "schema": schema})  # (SQLite: unused)
    return {str(name): str(text or "") for name, text in rows}


def ours(text: str) -> bool:
    """Whether a trigger's text carries the change log's marker (any version)."""
    return MARKER_PREFIX in text


def foreign_triggers(conn: sa.Connection, info: TableInfo) -> list[str]:
    """Names the change log would use that are taken by triggers it did not write."""
    return sorted(name for name, text in existing_triggers(conn, info).items() if not ours(text))


def has_index(conn: sa.Connection, info: TableInfo) -> bool:
    inspector = sa.inspect(conn)
    if not inspector.has_table(info.log_table, schema=info.schema):
        return False
    wanted = index_name(info)
    return any(ix["name"] == wanted for ix in inspector.get_indexes(info.log_table, info.schema))


def pk_names(info: TableInfo) -> Sequence[str]:
    return [c.name for c in info.pk]


def log_key_columns(names: Sequence[str]) -> list[str]:
    """The key columns of a log table: every column that is not one of the log's own."""
    return [n for n in names if n not in LOG_COLUMNS]
