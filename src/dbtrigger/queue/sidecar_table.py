"""Sidecar mode's claims table: a claims row per row version, next to an untouched table.

For the seed's "complications" - a table with ids but no status column, a
sequence instead of ids, rows that are hard-deleted - the claim state cannot
live on the row. It lives here instead, one claims row per ``(queue,
item_key, item_cursor)``: :func:`claims_table` is its shape, installed and
uninstalled by ``dbtrigger queue install|uninstall --mode sidecar``, and
:class:`SidecarLayout` is the claim source's strategy for it (the claim
statements see only this queue's rows; a claimed row is read from the user
table by key). The feeder that fills it is :mod:`dbtrigger.queue.sidecar`.

One claims row is one *row version* (key and cursor): a row updated after its
job finished gets a new job. ``item_key`` and ``item_cursor`` hold the key
and cursor in the state document's canonical JSON encoding, so they decode to
the exact values (a timestamp stays a timestamp).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateIndex, CreateTable, DropTable

from dbtrigger._engine import reflect_table
from dbtrigger.cursor import decode_value, pk_json
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue.layout import ClaimedRow, QueueTable
from dbtrigger.queue.schema import (
    ATTEMPTS,
    CLAIMED,
    READY,
    STATUS,
    DialectTime,
    check_claim_columns,
    index_name,
)
from dbtrigger.queue.statements import ClaimBatch, ClaimTable

#: Widths of the claims table's key columns.
QUEUE_NAME_LIMIT = 128
ITEM_TEXT_LIMIT = 255
KEY = ("queue", "item_key", "item_cursor")


def claims_table(name: str, schema: str | None, time: DialectTime) -> sa.Table:
    """The claims table: one row per ``(queue, item_key, item_cursor)`` plus the claim columns."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("queue", sa.String(QUEUE_NAME_LIMIT), primary_key=True),
        sa.Column("item_key", sa.String(ITEM_TEXT_LIMIT), primary_key=True),
        sa.Column("item_cursor", sa.String(ITEM_TEXT_LIMIT), primary_key=True),
        *time.claim_columns(),
        schema=schema,
    )


def install_claims_table(conn: Connection, name: str, schema: str | None) -> list[str]:
    """Statements creating the claims table and its claim index (none when it exists)."""
    dialect = conn.dialect
    time = DialectTime(dialect.name)
    if sa.inspect(conn).has_table(name, schema=schema):
        return []
    table = claims_table(name, schema, time)
    index = time.claimable_index(table, index_name(name))
    return [
        str(CreateTable(table).compile(dialect=dialect)).strip(),
        str(CreateIndex(index).compile(dialect=dialect)),
    ]


@dataclass(frozen=True)
class SidecarUninstall:
    """What ``dbtrigger queue uninstall --mode sidecar`` would do, and what it would lose.

    ``statements`` delete this queue's claims rows and, when no other queue has
    rows in the claims table, drop the table (its index goes with it).
    ``by_status`` counts this queue's rows; ``ready``/``claimed`` ones are work
    not done yet, which the command refuses to discard unless told to.
    """

    statements: list[str]
    by_status: Mapping[str, int]
    other_queues: int

    @property
    def pending(self) -> int:
        return int(self.by_status.get(READY, 0)) + int(self.by_status.get(CLAIMED, 0))


def uninstall_claims(
    conn: Connection, name: str, schema: str | None, queue: str
) -> SidecarUninstall | None:
    """The statements removing ``queue`` from claims table ``name`` (None: no such table).

    The user table is never touched (sidecar mode never changed it). The
    statements are rendered with literal values (``queue`` is a validated
    identifier) so the dry run prints exactly what ``--yes`` runs.
    """
    dialect = conn.dialect
    if not sa.inspect(conn).has_table(name, schema=schema):
        return None
    table = claims_table(name, schema, DialectTime(dialect.name))
    by_status = {
        str(status): int(n)
        for status, n in conn.execute(
            sa.select(table.c[STATUS], sa.func.count())
            .where(table.c.queue == queue)
            .group_by(table.c[STATUS])
        )
    }
    others = int(
        conn.execute(
            sa.select(sa.func.count(sa.distinct(table.c.queue))).where(table.c.queue != queue)
        ).scalar_one()
    )
    statements = []
    if by_status:
        delete = sa.delete(table).where(table.c.queue == queue)
        statements.append(
            str(delete.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        )
    if not others:
        statements.append(str(DropTable(table).compile(dialect=dialect)).strip())
    return SidecarUninstall(statements, by_status, others)


def item_key(pk: Mapping[str, Any]) -> str:
    return pk_json(pk)


def decode_key(text: str) -> dict[str, Any]:
    return {name: decode_value(kind, value) for name, (kind, value) in json.loads(text).items()}


def decode_cursor(text: str) -> Any:
    kind, value = json.loads(text)
    return decode_value(kind, value)


class SidecarLayout:
    """The claim columns in a claims table beside the user's table (``mode="sidecar"``).

    One claims row per ``(queue, item_key, item_cursor)``: the statements see
    only this queue's rows, and a claimed row is read from the user table by
    key (``values=None`` for a row deleted since it was fed).
    """

    mode = "sidecar"

    def __init__(self, claims_table: str, *, schema: str | None, queue_name: str) -> None:
        self.claims_table: str | None = claims_table
        self.table_name = claims_table
        self.schema = schema
        self.queue_name = queue_name

    def target(self, conn: Connection, queue: QueueTable) -> ClaimTable:
        name, schema = self.table_name, self.schema
        try:
            found = reflect_table(conn, name, schema)
        except ConfigurationError:
            raise ConfigurationError(
                f"the claims table {name} does not exist: create it with\n"
                f"  {queue.install_hint} --yes\n"
                "(without --yes it prints the DDL it would run)"
            ) from None
        check_claim_columns(found, queue.time, conn.dialect)
        table = claims_table(name, schema, queue.time)
        return ClaimTable(table, KEY, queue.time, table.c.queue == self.queue_name)

    def install(
        self, conn: Connection, user: sa.Table, *, existing: str, priority: bool
    ) -> list[str]:
        del user, existing  # the user table is never changed; the feeder fills the claims
        if priority:
            raise ConfigurationError(
                "--priority adds dbt_priority to the table's claim columns; a sidecar queue "
                "keeps them in its claims table, filled by the feeder: use mode columns for "
                "priorities"
            )
        return install_claims_table(conn, self.table_name, self.schema)

    def match_user_keys(
        self, table: ClaimTable, pks: Sequence[Mapping[str, Any]], pk_columns: Sequence[str]
    ) -> sa.ColumnElement[bool]:
        del pk_columns  # the encoded key names its columns
        return table.table.c.item_key.in_([item_key(pk) for pk in pks])

    def user_key_columns(self, table: ClaimTable) -> list[sa.ColumnElement[Any]]:
        return [table.table.c.item_key]

    def user_pk(self, values: Sequence[Any], pk_columns: Sequence[str]) -> dict[str, Any]:
        del pk_columns
        return decode_key(str(values[0]))

    def rows(self, conn: Connection, batch: ClaimBatch, queue: QueueTable) -> list[ClaimedRow]:
        """The user rows behind the claimed items (``values=None`` for rows deleted since)."""
        claimed = batch.rows
        if not claimed:
            return []
        pk_columns = queue.pk_columns
        cols = [queue.user.c[c] for c in pk_columns]
        pks = [decode_key(str(r["item_key"])) for r in claimed]
        wanted = [tuple(pk[c] for c in pk_columns) for pk in pks]
        match = (
            cols[0].in_([w[0] for w in wanted]) if len(cols) == 1 else sa.tuple_(*cols).in_(wanted)
        )
        found = {
            item_key({c: row[c] for c in pk_columns}): dict(row)
            for row in conn.execute(sa.select(queue.user).where(match)).mappings()
        }
        return [
            ClaimedRow(
                key=(row["queue"], row["item_key"], row["item_cursor"]),
                pk=pk,
                values=found.get(str(row["item_key"])),
                attempt=int(row[ATTEMPTS]),
                cursor=decode_cursor(str(row["item_cursor"])),
                isolated=batch.isolated,
            )
            for row, pk in zip(claimed, pks, strict=True)
        ]


__all__ = [
    "ITEM_TEXT_LIMIT",
    "KEY",
    "QUEUE_NAME_LIMIT",
    "SidecarLayout",
    "SidecarUninstall",
    "claims_table",
    "decode_cursor",
    "decode_key",
    "install_claims_table",
    "item_key",
    "uninstall_claims",
]
