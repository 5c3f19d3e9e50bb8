"""The SQL dead-letter sink's table (:class:`~dbtrigger.quarantine.SqlQuarantineSink`)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from dbtrigger.names import validate_sql_identifier

#: JSON text columns. MySQL/MariaDB ``TEXT`` stops at 64 KB, and poison rows are
#: often the big ones: a row that cannot be recorded can never be set aside.
_JSON_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


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
        schema=validate_sql_identifier(schema, "schema") if schema else None,
    )


__all__ = ["quarantine_table"]
