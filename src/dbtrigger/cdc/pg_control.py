"""The source's own bookkeeping in the database: ``dbtrigger_cdc_slots``, one row per slot.

A replication slot remembers a position and nothing else. Two things must
outlive a worker process and belong with the slot rather than with any one
poller's state document:

* the **accepted columns** of each watched table (name -> type OID). A
  Relation message that changes the type of an accepted column stops delivery
  (:class:`~dbtrigger.errors.SchemaChangedError`) until someone accepts the new
  shape (``dbtrigger cdc accept-schema``); a new column is added here and simply
  appears in events. Kept in memory only, a restart would forget what the
  consumers had been given and let a type change through unnoticed.
* the **snapshot requests**: which tables (and key ranges) still have rows to
  read into the log, and how far each got. A chunk is written into the log in
  the same transaction that moves its request forward
  (:mod:`dbtrigger.cdc.pg_snapshot`), so an interrupted snapshot resumes at the
  next chunk, never from zero and never skipping one.

The table lives in ``control_schema`` (``public`` by default), is created on
first use (or by ``dbtrigger cdc install``), and is not in the publication:
its own updates never reach a poller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from dbtrigger.cdc.pg_connection import translated
from dbtrigger.cdc.snapshots import Snapshot
from dbtrigger.errors import SourcePermissionError

TABLE = "dbtrigger_cdc_slots"


def table_identifier(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, TABLE)


def create_sql(schema: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} ("
        "slot text PRIMARY KEY, poller text, tables text[] NOT NULL, "
        "created_lsn pg_lsn, created_at timestamptz NOT NULL DEFAULT now(), "
        "columns jsonb NOT NULL DEFAULT '{{}}', snapshots jsonb NOT NULL DEFAULT '[]', "
        "updated_at timestamptz NOT NULL DEFAULT now())"
    ).format(table_identifier(schema))


def exists(conn: psycopg.Connection[Any], schema: str) -> bool:
    with translated("looking for the control table"):
        row = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}"."{TABLE}"',)
        ).fetchone()
    return bool(row and row[0])


def ensure(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Create the control table if it is missing; True when it was created.

    Raises:
        SourcePermissionError: the role may not create tables in ``schema``.
    """
    if exists(conn, schema):
        return False
    statement = create_sql(schema)
    try:
        with translated("creating the control table"):
            conn.execute(statement)
    except SourcePermissionError as exc:
        raise SourcePermissionError(
            f"cannot create {schema}.{TABLE} (where PgLogicalSource keeps the accepted columns "
            f"and snapshot progress): {exc}. GRANT CREATE ON SCHEMA {schema} TO this role, pass "
            f"control_schema= naming a schema it may create in, or have an admin run: "
            f"{statement.as_string(conn)}"
        ) from exc
    return True


@dataclass
class ControlRow:
    slot: str
    poller: str | None
    tables: list[str]
    created_lsn: str | None
    columns: dict[str, dict[str, int]] = field(default_factory=dict)
    snapshots: list[Snapshot] = field(default_factory=list)


def read(
    conn: psycopg.Connection[Any], schema: str, slot: str, *, lock: bool = False
) -> ControlRow | None:
    query = sql.SQL(
        "SELECT slot, poller, tables, created_lsn::text, columns, snapshots FROM {} "
        "WHERE slot = %s{}"
    ).format(table_identifier(schema), sql.SQL(" FOR UPDATE" if lock else ""))
    with translated("reading the control table"):
        row = conn.execute(query, (slot,)).fetchone()
    if row is None:
        return None
    columns = row[4] if isinstance(row[4], dict) else json.loads(row[4])
    snapshots = row[5] if isinstance(row[5], list) else json.loads(row[5])
    return ControlRow(
        row[0],
        row[1],
        list(row[2]),
        row[3],
        {t: {c: int(o) for c, o in cols.items()} for t, cols in columns.items()},
        [Snapshot.from_json(s) for s in snapshots],
    )


def read_installed(conn: psycopg.Connection[Any], schema: str, slot: str) -> ControlRow | None:
    """The slot's row; None also while the control table does not exist."""
    return read(conn, schema, slot) if exists(conn, schema) else None


def write(conn: psycopg.Connection[Any], schema: str, row: ControlRow) -> None:
    """Insert or replace the slot's row."""
    statement = sql.SQL(
        "INSERT INTO {} (slot, poller, tables, created_lsn, columns, snapshots) "
        "VALUES (%s, %s, %s, %s::pg_lsn, %s, %s) ON CONFLICT (slot) DO UPDATE SET "
        "poller = EXCLUDED.poller, tables = EXCLUDED.tables, created_lsn = EXCLUDED.created_lsn, "
        "columns = EXCLUDED.columns, snapshots = EXCLUDED.snapshots, updated_at = now()"
    ).format(table_identifier(schema))
    with translated("writing the control table"):
        conn.execute(
            statement,
            (
                row.slot,
                row.poller,
                row.tables,
                row.created_lsn,
                Jsonb(row.columns),
                Jsonb([s.to_json() for s in row.snapshots]),
            ),
        )


def save_columns(
    conn: psycopg.Connection[Any], schema: str, slot: str, columns: dict[str, dict[str, int]]
) -> None:
    statement = sql.SQL("UPDATE {} SET columns = %s, updated_at = now() WHERE slot = %s").format(
        table_identifier(schema)
    )
    with translated("saving the accepted columns"):
        conn.execute(statement, (Jsonb(columns), slot))


def save_snapshots(
    conn: psycopg.Connection[Any], schema: str, slot: str, snapshots: list[Snapshot]
) -> None:
    statement = sql.SQL("UPDATE {} SET snapshots = %s, updated_at = now() WHERE slot = %s").format(
        table_identifier(schema)
    )
    with translated("saving the snapshot progress"):
        conn.execute(statement, (Jsonb([s.to_json() for s in snapshots]), slot))


def delete(conn: psycopg.Connection[Any], schema: str, slot: str) -> None:
    if not exists(conn, schema):
        return
    with translated("removing the slot's control row"):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE slot = %s").format(table_identifier(schema)), (slot,)
        )


__all__ = [
    "TABLE",
    "ControlRow",
    "create_sql",
    "delete",
    "ensure",
    "exists",
    "read",
    "read_installed",
    "save_columns",
    "save_snapshots",
    "write",
]
