"""The SQL dead-letter sink's table (:class:`~dbtrigger.quarantine.SqlQuarantineSink`)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from dbtrigger._driver_errors import short_error
from dbtrigger._lock_wait import bounded_transaction
from dbtrigger.names import validate_sql_identifier

#: JSON text columns. MySQL/MariaDB ``TEXT`` stops at 64 KB, and poison rows are
#: often the big ones: a row that cannot be recorded can never be set aside.
_JSON_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


#: A record's fan-out subscribers (a JSON object; NULL without). Added after the
#: table's first release: a table created before lacks it until
#: :class:`~dbtrigger.quarantine.SqlQuarantineSink` adds it (or reads without it).
SUBSCRIBERS_COLUMN = "subscribers_json"


def quarantine_table(
    name: str = "dbtrigger_quarantine",
    schema: str | None = None,
    metadata: sa.MetaData | None = None,
) -> sa.Table:
    """The quarantine table's definition; primary key (poller, event_id)."""
    return sa.Table(
        validate_sql_identifier(name, "quarantine table"),
        metadata or sa.MetaData(),
        sa.Column("poller", sa.String(128), primary_key=True),
        sa.Column("event_id", sa.String(64), primary_key=True),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("pk_json", _JSON_TEXT, nullable=False),
        sa.Column("cursor_json", _JSON_TEXT, nullable=False),
        sa.Column("row_json", _JSON_TEXT, nullable=True),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("checkpoint_json", _JSON_TEXT, nullable=False),
        sa.Column("batch_id", sa.String(128), nullable=False),
        sa.Column("fencing_token", sa.BigInteger, nullable=False),
        sa.Column("owner_id", sa.String(255), nullable=False),
        sa.Column("quarantined_at", sa.DateTime, nullable=False),  # UTC, naive
        # Fan-out: the subscribers that did not take the event, with their reasons.
        sa.Column(SUBSCRIBERS_COLUMN, _JSON_TEXT, nullable=True),
        schema=validate_sql_identifier(schema, "schema") if schema else None,
    )


def add_column(
    engine: sa.Engine, table: sa.Table, name: str, lock_timeout: float, *, may_alter: bool
) -> tuple[bool, str]:
    """Make sure ``table`` (which exists) has its column ``name``, added later in
    dbtrigger's life: ``(True, "")`` when it has it or it was added now (nullable,
    ``ALTER TABLE ... ADD COLUMN``, only when ``may_alter``), else ``(False, the
    statement that adds it and why it was not run)``."""

    def has_it() -> bool:
        with engine.connect() as conn:
            cols = sa.inspect(conn).get_columns(table.name, schema=table.schema)
        return any(c["name"] == name for c in cols)

    if has_it():
        return True, ""
    ref = engine.dialect.identifier_preparer.format_table(table)
    kind = table.c[name].type.compile(dialect=engine.dialect)
    ddl = f"ALTER TABLE {ref} ADD COLUMN {name} {kind}"
    if not may_alter:
        return False, f"{ddl} (create_table=False: dbtrigger does not change the table)"
    try:
        with bounded_transaction(engine, lock_timeout) as conn:
            conn.exec_driver_sql(ddl)
    except sa.exc.SQLAlchemyError as exc:
        if has_it():  # another process added it meanwhile
            return True, ""
        return False, f"{ddl} (it failed: {short_error(exc, limit=300)})"
    return True, ""


__all__ = ["SUBSCRIBERS_COLUMN", "add_column", "quarantine_table"]
