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
* the **release bound** (``released_lsn``): the furthest LSN this source ever
  let the slot advance to, written *before* each advance. A slot keeps no
  identity of its own, so a slot dropped and created again by hand under the
  same name would start at the server's WAL position of that moment and skip
  what was committed in between; its confirmed position is then past the
  bound, and the source refuses it (:class:`~dbtrigger.errors.SlotLostError`).

The table lives in ``control_schema`` (``public`` by default), is created on
first use (or by ``dbtrigger cdc install``), and is not in the publication:
its own updates never reach a poller.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from dbtrigger.cdc.pg_connection import execute_or_explain, translated
from dbtrigger.cdc.snapshots import Snapshot

TABLE = "dbtrigger_cdc_slots"


def table_identifier(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, TABLE)


def _writing(what: str, schema: str) -> contextlib.AbstractContextManager[None]:
    """:func:`translated` for a write of the control table: a refusal names its GRANT."""
    return translated(
        what,
        refused=f"GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.{TABLE} TO this role (where "
        "PgLogicalSource keeps its slot's progress); retrying cannot help",
    )


def create_sql(schema: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} ("
        "slot text PRIMARY KEY, poller text, tables text[] NOT NULL, "
        "created_lsn pg_lsn, created_at timestamptz NOT NULL DEFAULT now(), "
        "released_lsn pg_lsn, columns jsonb NOT NULL DEFAULT '{{}}', "
        "snapshots jsonb NOT NULL DEFAULT '[]', "
        "updated_at timestamptz NOT NULL DEFAULT now())"
    ).format(table_identifier(schema))


def exists(conn: psycopg.Connection[Any], schema: str) -> bool:
    with translated("looking for the control table"):
        row = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}"."{TABLE}"',)
        ).fetchone()
    return bool(row and row[0])


def has_bound(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Does the control table have ``released_lsn`` (tables made before it was added do not)?"""
    with translated("looking at the control table's columns"):
        row = conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attname = 'released_lsn' AND NOT attisdropped",
            (f'"{schema}"."{TABLE}"',),
        ).fetchone()
    return bool(row and row[0])


def add_bound_sql(schema: str) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS released_lsn pg_lsn").format(
        table_identifier(schema)
    )


def ensure(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Create the control table if it is missing (add ``released_lsn`` to one made before
    it existed); True when it was created.

    Raises:
        SourcePermissionError: the role may not create tables in ``schema``, or
            may not alter the existing table.
    """
    if exists(conn, schema):
        if not has_bound(conn, schema):
            execute_or_explain(
                conn,
                [add_bound_sql(schema)],
                doing="adding released_lsn to the control table",
                refused=f"{schema}.{TABLE} was made by an earlier dbtrigger and lacks the column "
                "released_lsn (how far the slot was let advance)",
                advice="Have its owner run",
                tables=[table_identifier(schema).as_string(conn)],
            )
        return False
    execute_or_explain(
        conn,
        [create_sql(schema)],
        doing="creating the control table",
        refused=f"cannot create {schema}.{TABLE} (where PgLogicalSource keeps the accepted "
        "columns and snapshot progress)",
        advice=f"GRANT CREATE ON SCHEMA {schema} TO this role, pass control_schema= naming a "
        "schema it may create in, or have an admin run",
    )
    return True


@dataclass
class ControlRow:
    slot: str
    poller: str | None
    tables: list[str]
    created_lsn: str | None
    columns: dict[str, dict[str, int]] = field(default_factory=dict)
    snapshots: list[Snapshot] = field(default_factory=list)
    #: The furthest LSN the slot was let advance to (None: not recorded yet).
    released_lsn: str | None = None
    #: False when the table has no ``released_lsn`` column (made by an earlier version).
    bounded: bool = True


def read(
    conn: psycopg.Connection[Any], schema: str, slot: str, *, lock: bool = False
) -> ControlRow | None:
    bounded = has_bound(conn, schema)
    query = sql.SQL(
        "SELECT slot, poller, tables, created_lsn::text, columns, snapshots, {} FROM {} "
        "WHERE slot = %s{}"
    ).format(
        sql.SQL("released_lsn::text" if bounded else "NULL::text"),
        table_identifier(schema),
        sql.SQL(" FOR UPDATE" if lock else ""),
    )
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
        row[6],
        bounded,
    )


def read_installed(conn: psycopg.Connection[Any], schema: str, slot: str) -> ControlRow | None:
    """The slot's row; None also while the control table does not exist."""
    return read(conn, schema, slot) if exists(conn, schema) else None


def write(conn: psycopg.Connection[Any], schema: str, row: ControlRow) -> None:
    """Insert or replace the slot's row (its release bound too, where the table has it)."""
    row.bounded = has_bound(conn, schema)
    bound = row.bounded
    statement = sql.SQL(
        "INSERT INTO {} (slot, poller, tables, created_lsn, columns, snapshots{}) "
        "VALUES (%s, %s, %s, %s::pg_lsn, %s, %s{}) ON CONFLICT (slot) DO UPDATE SET "
        "poller = EXCLUDED.poller, tables = EXCLUDED.tables, created_lsn = EXCLUDED.created_lsn, "
        "columns = EXCLUDED.columns, snapshots = EXCLUDED.snapshots, {}updated_at = now()"
    ).format(
        table_identifier(schema),
        sql.SQL(", released_lsn" if bound else ""),
        sql.SQL(", %s::pg_lsn" if bound else ""),
        sql.SQL("released_lsn = EXCLUDED.released_lsn, " if bound else ""),
    )
    values: list[Any] = [
        row.slot,
        row.poller,
        row.tables,
        row.created_lsn,
        Jsonb(row.columns),
        Jsonb([s.to_json() for s in row.snapshots]),
    ]
    if bound:
        values.append(row.released_lsn)
    with _writing("writing the control table", schema):
        conn.execute(statement, values)


def save_bound(conn: psycopg.Connection[Any], schema: str, slot: str, lsn: str) -> bool:
    """Record that the slot may advance to ``lsn`` (never moves the bound back); False
    when the slot has no control row."""
    statement = sql.SQL(
        "UPDATE {} SET released_lsn = GREATEST(released_lsn, %s::pg_lsn), updated_at = now() "
        "WHERE slot = %s"
    ).format(table_identifier(schema))
    with _writing("recording how far the slot may advance", schema):
        return conn.execute(statement, (lsn, slot)).rowcount > 0


def save_columns(
    conn: psycopg.Connection[Any], schema: str, slot: str, columns: dict[str, dict[str, int]]
) -> None:
    statement = sql.SQL("UPDATE {} SET columns = %s, updated_at = now() WHERE slot = %s").format(
        table_identifier(schema)
    )
    with _writing("saving the accepted columns", schema):
        conn.execute(statement, (Jsonb(columns), slot))


def save_snapshots(
    conn: psycopg.Connection[Any], schema: str, slot: str, snapshots: list[Snapshot]
) -> None:
    statement = sql.SQL("UPDATE {} SET snapshots = %s, updated_at = now() WHERE slot = %s").format(
        table_identifier(schema)
    )
    with _writing("saving the snapshot progress", schema):
        conn.execute(statement, (Jsonb([s.to_json() for s in snapshots]), slot))


def delete(conn: psycopg.Connection[Any], schema: str, slot: str) -> None:
    if not exists(conn, schema):
        return
    with _writing("removing the slot's control row", schema):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE slot = %s").format(table_identifier(schema)), (slot,)
        )


__all__ = [
    "TABLE",
    "ControlRow",
    "add_bound_sql",
    "create_sql",
    "delete",
    "ensure",
    "exists",
    "has_bound",
    "read",
    "read_installed",
    "save_bound",
    "save_columns",
    "save_snapshots",
    "write",
]
