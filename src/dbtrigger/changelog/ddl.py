"""The change log's DDL: one log table and row triggers, per dialect.

A keyset poller sees the *current* state of a row, so it cannot see a hard
delete and collapses several updates into the latest state. A change log
written by ``AFTER INSERT/UPDATE/DELETE`` row triggers records every change, in
the writing transaction, with the row before and after it. Polling the log by
its sequence number then gives one event per change.

Layout of the log of table ``orders`` (``dbt_changelog_orders``)::

    dbt_seq         bigint, assigned by the database, primary key: the cursor
    dbt_op          'insert' | 'update' | 'delete'
    <pk columns>    copies of the table's primary key (its own names and types)
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

Every generated trigger carries :data:`MARKER`; install refuses to replace a
trigger of the same name without it (someone else's trigger), and uninstall
only drops triggers that carry it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier

#: Written into every trigger (body comment) the change log installs.
MARKER = "dbtrigger-changelog v1"

#: The log's own columns; the table's key columns sit between op and before.
LOG_COLUMNS = ("dbt_seq", "dbt_op", "dbt_before", "dbt_after", "dbt_txid", "dbt_changed_at")

SUPPORTED_DIALECTS = ("postgresql", "mysql", "mariadb", "sqlite")

#: MariaDB/MySQL limit identifiers to 64 characters, PostgreSQL to 63 bytes.
MAX_IDENTIFIER = 63


def log_table_name(table: str) -> str:
    """``dbt_changelog_<table>``, shortened with a hash when too long."""
    return _short(f"dbt_changelog_{table}")


def _short(name: str) -> str:
    if len(name) <= MAX_IDENTIFIER:
        return name
    return name[:54] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class ColumnInfo:
    """What the DDL needs of one column of the watched table."""

    name: str
    sql_type: str
    binary: bool = False


@dataclass(frozen=True)
class TableInfo:
    """The watched table as reflected at install time."""

    dialect: str
    table: str
    schema: str | None
    pk: tuple[ColumnInfo, ...]
    columns: tuple[ColumnInfo, ...]

    @property
    def log_table(self) -> str:
        return log_table_name(self.table)

    def trigger_names(self) -> tuple[str, ...]:
        """PostgreSQL: one trigger for all three operations; elsewhere one each."""
        base = f"dbt_cl_{self.table}"
        if self.dialect == "postgresql":
            return (_short(base),)
        return tuple(_short(f"{base}_{op}") for op in ("ins", "upd", "del"))

    @property
    def function_name(self) -> str:
        return _short(f"dbt_cl_{self.table}_fn")


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
    try:
        reflected = sa.Table(table, sa.MetaData(), schema=schema, autoload_with=conn)
    except sa.exc.NoSuchTableError:
        where = f"{schema}.{table}" if schema else table
        raise ConfigurationError(f"table {where} does not exist (or is not visible)") from None
    if not reflected.primary_key.columns:
        raise ConfigurationError(
            f"table {table!r} has no primary key: the change log keys every change by it"
        )
    compiler = conn.dialect.type_compiler_instance

    def info(column: sa.Column[object]) -> ColumnInfo:
        validate_sql_identifier(column.name, "column")
        if column.name.startswith("dbt_"):
            raise ConfigurationError(
                f"column {column.name!r} of {table!r} uses the change log's reserved prefix dbt_"
            )
        return ColumnInfo(
            name=column.name,
            sql_type=compiler.process(column.type),
            binary=isinstance(column.type, sa.LargeBinary | sa.types._Binary),
        )

    return TableInfo(
        dialect=dialect,
        table=table,
        schema=schema if dialect != "sqlite" else None,
        pk=tuple(info(c) for c in reflected.primary_key.columns),
        columns=tuple(info(c) for c in reflected.columns),
    )


Quote = Callable[[str], str]


def install_ddl(info: TableInfo, quote: Quote) -> list[str]:
    """Statements that create the log table, its index and the triggers.

    The table and index statements are idempotent; triggers are (re)created, so
    run :func:`foreign_triggers` first (``install`` does) to make sure no
    trigger of the same name belongs to someone else.
    """
    if info.dialect == "postgresql":
        return _postgresql(info, quote)
    return _with_row_triggers(info, quote)


def uninstall_ddl(info: TableInfo, quote: Quote, *, drop_log: bool) -> list[str]:
    """Drop the triggers (and the function); the log table only with ``drop_log``."""
    target = _qualified(info, info.table, quote)
    statements: list[str] = []
    for trigger in info.trigger_names():
        if info.dialect == "postgresql":
            statements.append(f"DROP TRIGGER IF EXISTS {quote(trigger)} ON {target}")
        else:
            statements.append(f"DROP TRIGGER IF EXISTS {_qualified(info, trigger, quote)}")
    if info.dialect == "postgresql":
        statements.append(
            f"DROP FUNCTION IF EXISTS {_qualified(info, info.function_name, quote)}()"
        )
    if drop_log:
        statements.append(f"DROP TABLE IF EXISTS {_qualified(info, info.log_table, quote)}")
    return statements


def _qualified(info: TableInfo, name: str, quote: Quote) -> str:
    return f"{quote(info.schema)}.{quote(name)}" if info.schema else quote(name)


def _log_table_ddl(info: TableInfo, quote: Quote, seq: str, text: str, changed_at: str) -> str:
    log = _qualified(info, info.log_table, quote)
    keys = ",\n  ".join(f"{quote(c.name)} {c.sql_type} NOT NULL" for c in info.pk)
    return (
        f"CREATE TABLE IF NOT EXISTS {log} (\n"
        f"  dbt_seq {seq},\n"
        "  dbt_op VARCHAR(6) NOT NULL,\n"
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
    log = _qualified(info, info.log_table, quote)
    if info.dialect in ("mysql", "mariadb"):
        return f"CREATE INDEX {name} ON {log} ({columns})"
    return f"CREATE INDEX IF NOT EXISTS {name} ON {log} ({columns})"


def index_name(info: TableInfo) -> str:
    return _short(f"ix_{info.log_table}_seq")


def _postgresql(info: TableInfo, quote: Quote) -> list[str]:
    target = _qualified(info, info.table, quote)
    log = _qualified(info, info.log_table, quote)
    function = _qualified(info, info.function_name, quote)
    (trigger,) = info.trigger_names()
    key_names = ", ".join(quote(c.name) for c in info.pk)

    def keys(record: str) -> str:
        return ", ".join(f"{record}.{quote(c.name)}" for c in info.pk)

    def insert(op: str, record: str, before: str, after: str) -> str:
        return (
            # Trigger body text: identifiers validated and quoted, no values from input.
            f"INSERT INTO {log} (dbt_op, {key_names}, dbt_before, dbt_after, dbt_txid)\n"  # noqa: S608
            f"      VALUES ('{op}', {keys(record)}, {before}, {after}, "
            "pg_current_xact_id()::text::bigint);"
        )

    body = (
        f"-- {MARKER}: one log row per changed row, written in the writing transaction\n"
        "BEGIN\n"
        "  IF TG_OP = 'DELETE' THEN\n"
        f"    {insert('delete', 'OLD', 'to_jsonb(OLD)::text', 'NULL')}\n"
        "    RETURN OLD;\n"
        "  ELSIF TG_OP = 'UPDATE' THEN\n"
        f"    {insert('update', 'NEW', 'to_jsonb(OLD)::text', 'to_jsonb(NEW)::text')}\n"
        "  ELSE\n"
        f"    {insert('insert', 'NEW', 'NULL', 'to_jsonb(NEW)::text')}\n"
        "  END IF;\n"
        "  RETURN NEW;\n"
        "END"
    )
    return [
        _log_table_ddl(
            info,
            quote,
            seq="BIGSERIAL PRIMARY KEY",
            text="TEXT",
            changed_at="TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()",
        ),
        _index_ddl(info, quote),
        f"COMMENT ON TABLE {log} IS '{MARKER}: changes of {info.table}'",
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $f$\n"
        f"{body}\n$f$",
        f"DROP TRIGGER IF EXISTS {quote(trigger)} ON {target}",
        f"CREATE TRIGGER {quote(trigger)} AFTER INSERT OR UPDATE OR DELETE ON {target} "
        f"FOR EACH ROW EXECUTE FUNCTION {function}()",
    ]


def _image(info: TableInfo, record: str, quote: Quote, json_object: str, hex_fn: str) -> str:
    """``JSON_OBJECT('col', NEW.col, ...)``; binary columns as hex text (JSON has no bytes)."""
    parts = []
    for column in info.columns:
        value = f"{record}.{quote(column.name)}"
        if column.binary:
            value = f"{hex_fn}({value})"
        parts.append(f"'{column.name}', {value}")
    return f"{json_object}({', '.join(parts)})"


def _row_triggers(
    info: TableInfo, quote: Quote, *, json_object: str, hex_fn: str, wrap: Callable[[str], str]
) -> list[str]:
    target = _qualified(info, info.table, quote)
    log = _qualified(info, info.log_table, quote)
    key_names = ", ".join(quote(c.name) for c in info.pk)
    ins, upd, dele = info.trigger_names()

    def keys(record: str) -> str:
        return ", ".join(f"{record}.{quote(c.name)}" for c in info.pk)

    def image(record: str) -> str:
        return _image(info, record, quote, json_object, hex_fn)

    def statement(op: str, record: str, before: str, after: str) -> str:
        return (
            f"INSERT INTO {log} (dbt_op, {key_names}, dbt_before, dbt_after) "  # noqa: S608
            f"VALUES ('{op}', {keys(record)}, {before}, {after});"
        )

    out = []
    for name, event, body in (
        (ins, "INSERT", statement("insert", "NEW", "NULL", image("NEW"))),
        (upd, "UPDATE", statement("update", "NEW", image("OLD"), image("NEW"))),
        (dele, "DELETE", statement("delete", "OLD", image("OLD"), "NULL")),
    ):
        out.append(f"DROP TRIGGER IF EXISTS {_qualified(info, name, quote)}")
        out.append(
            f"CREATE TRIGGER {_qualified(info, name, quote)} AFTER {event} ON {target} "
            f"FOR EACH ROW {wrap(body)}"
        )
    return out


@dataclass(frozen=True)
class _RowTriggerDialect:
    """What differs between the dialects that need one trigger per operation."""

    seq: str
    text: str
    changed_at: str
    json_object: str
    hex_fn: str
    table_comment: bool


_ROW_TRIGGER_DIALECTS = {
    "mysql": _RowTriggerDialect(
        seq="BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
        text="LONGTEXT",
        changed_at="DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)",
        json_object="JSON_OBJECT",
        hex_fn="HEX",
        table_comment=True,
    ),
    "sqlite": _RowTriggerDialect(
        seq="INTEGER PRIMARY KEY AUTOINCREMENT",
        text="TEXT",
        changed_at="TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        json_object="json_object",
        hex_fn="hex",
        table_comment=False,
    ),
}


def _with_row_triggers(info: TableInfo, quote: Quote) -> list[str]:
    """MariaDB/MySQL and SQLite: the log table, its index, three row triggers."""
    spec = _ROW_TRIGGER_DIALECTS["sqlite" if info.dialect == "sqlite" else "mysql"]
    table = _log_table_ddl(info, quote, seq=spec.seq, text=spec.text, changed_at=spec.changed_at)
    if spec.table_comment:
        table += f" COMMENT='{MARKER}: changes of {info.table}'"
    return [
        table,
        _index_ddl(info, quote),
        *_row_triggers(
            info,
            quote,
            json_object=spec.json_object,
            hex_fn=spec.hex_fn,
            wrap=lambda body: f"BEGIN\n  /* {MARKER} */\n  {body}\nEND",
        ),
    ]


def existing_triggers(conn: sa.Connection, info: TableInfo) -> dict[str, str]:
    """Trigger name -> definition text, for the names the change log would use."""
    names = list(info.trigger_names())
    if info.dialect == "postgresql":
        rows = conn.execute(
            sa.text(
                "SELECT t.tgname, pg_get_triggerdef(t.oid) || ' ' || coalesce(p.prosrc, '') "
                "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "LEFT JOIN pg_proc p ON p.oid = t.tgfoid "
                "WHERE NOT t.tgisinternal AND t.tgname = ANY(:names) "
                "AND n.nspname = coalesce(:schema, current_schema())"
            ),
            {"names": names, "schema": info.schema},
        )
    elif info.dialect in ("mysql", "mariadb"):
        rows = conn.execute(
            sa.text(
                "SELECT TRIGGER_NAME, ACTION_STATEMENT FROM information_schema.TRIGGERS "
                "WHERE TRIGGER_SCHEMA = coalesce(:schema, DATABASE()) "
                "AND TRIGGER_NAME IN :names"
            ).bindparams(sa.bindparam("names", expanding=True)),
            {"names": names, "schema": info.schema},
        )
    else:
        rows = conn.execute(
            sa.text(
                "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND name IN :names"
            ).bindparams(sa.bindparam("names", expanding=True)),
            {"names": names},
        )
    return {str(name): str(text or "") for name, text in rows}


def foreign_triggers(conn: sa.Connection, info: TableInfo) -> list[str]:
    """Names the change log would use that are taken by triggers it did not write."""
    return sorted(
        name for name, text in existing_triggers(conn, info).items() if MARKER not in text
    )


def has_index(conn: sa.Connection, info: TableInfo) -> bool:
    inspector = sa.inspect(conn)
    if not inspector.has_table(info.log_table, schema=info.schema):
        return False
    wanted = index_name(info)
    return any(ix["name"] == wanted for ix in inspector.get_indexes(info.log_table, info.schema))


def pk_names(info: TableInfo) -> Sequence[str]:
    return [c.name for c in info.pk]
