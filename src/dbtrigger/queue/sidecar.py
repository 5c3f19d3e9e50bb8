"""Sidecar mode: a claims table next to a user table that stays untouched.

For the seed's "complications" - a table with ids but no status column, a
sequence instead of ids, rows that are hard-deleted - the claim state cannot
live on the row. Instead:

* a :class:`SidecarFeeder` (a keyset :class:`~dbtrigger.PollTrigger` with its
  own lease and state document, exactly one active instance) follows the
  user table by ``cursor_column`` and inserts ``(queue, key, cursor)`` for
  each new or changed row into the claims table. The insert ignores rows
  already there, so a redelivered batch changes nothing, and the poller
  advances its checkpoint only after the handler - that insert - committed:
  a row is never passed over before its job exists;
* workers (:class:`~dbtrigger.QueueTrigger` over a ``mode="sidecar"``
  :class:`~dbtrigger.ClaimSource`) claim from the claims table with the same
  statements as columns mode, and read the user rows by key for the handler.
  A row deleted since it was fed is delivered with ``op="delete"`` and
  ``after=None``.

One claims row is one *row version* (key and cursor): a row updated after its
job finished gets a new job. ``item_key`` and ``item_cursor`` hold the key
and cursor in the state document's canonical JSON encoding, so they decode to
the exact values (a timestamp stays a timestamp).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.schema import CreateIndex, CreateTable, DropTable

from dbtrigger._driver_errors import short_error
from dbtrigger.cursor import decode_value, encoded_json, pk_json
from dbtrigger.errors import ConfigurationError, OutputWriteError
from dbtrigger.events import RowChange
from dbtrigger.queue.schema import (
    ATTEMPTS,
    CLAIMED,
    READY,
    STATUS,
    DialectTime,
    check_claim_columns,
    index_name,
)
from dbtrigger.queue.statements import ClaimTable

if TYPE_CHECKING:
    from dbtrigger.queue.source import ClaimedRow, ClaimSource
    from dbtrigger.runtime.poller import PollTrigger
    from dbtrigger.sources.sqlalchemy import SqlAlchemySource
    from dbtrigger.state.stores.base import CheckpointStore

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


def claims_target(source: ClaimSource, conn: Connection) -> ClaimTable:
    """The claim statements over ``source``'s claims table, for its queue only."""
    if not sa.inspect(conn).has_table(source.claims_table, schema=source.schema):
        raise ConfigurationError(
            f"the claims table {source.claims_table} does not exist: create it with\n"
            f"  {source.install_hint()} --yes\n"
            "(without --yes it prints the DDL it would run)"
        )
    check_claim_columns(source.reflect(conn, source.claims_table), source.time, conn.dialect)
    table = claims_table(source.claims_table, source.schema, source.time)
    return ClaimTable(table, KEY, source.time, table.c.queue == source.queue_name)


def item_key(pk: Mapping[str, Any]) -> str:
    return pk_json(pk)


def decode_key(text: str) -> dict[str, Any]:
    return {name: decode_value(kind, value) for name, (kind, value) in json.loads(text).items()}


def decode_cursor(text: str) -> Any:
    kind, value = json.loads(text)
    return decode_value(kind, value)


def load_rows(
    source: ClaimSource,
    conn: Connection,
    claimed: Sequence[Mapping[str, Any]],
    *,
    isolated: bool = False,
) -> list[ClaimedRow]:
    """The user rows behind claimed items (``values=None`` for rows deleted since)."""
    from dbtrigger.queue.source import ClaimedRow  # noqa: PLC0415 - a cycle at import time

    if not claimed:
        return []
    user = source.user_table(conn)
    cols = [user.c[c] for c in source.pk_columns]
    pks = [decode_key(str(r["item_key"])) for r in claimed]
    wanted = [tuple(pk[c] for c in source.pk_columns) for pk in pks]
    match = cols[0].in_([w[0] for w in wanted]) if len(cols) == 1 else sa.tuple_(*cols).in_(wanted)
    found = {
        item_key({c: row[c] for c in source.pk_columns}): dict(row)
        for row in conn.execute(sa.select(user).where(match)).mappings()
    }
    out = []
    for row, pk in zip(claimed, pks, strict=True):
        out.append(
            ClaimedRow(
                key=(row["queue"], row["item_key"], row["item_cursor"]),
                pk=pk,
                values=found.get(str(row["item_key"])),
                attempt=int(row[ATTEMPTS]),
                cursor=decode_cursor(str(row["item_cursor"])),
                isolated=isolated,
            )
        )
    return out


class SidecarFeeder:
    """Copies ``(key, cursor)`` of new and changed rows into the claims table.

    Args:
        name: the feeder's poller name (its state document).
        source: the ``mode="sidecar"`` :class:`ClaimSource` (its ``cursor_column``
            is followed; its ``where`` filters the user table).
        checkpoint_store: where the feeder's state document lives.
        batch_size / poll_options: as for :class:`~dbtrigger.PollTrigger`.

    Run exactly one active feeder per queue (the lease makes extra instances
    wait); run as many workers as you like.
    """

    def __init__(
        self,
        *,
        name: str,
        source: ClaimSource,
        checkpoint_store: CheckpointStore,
        batch_size: int = 500,
        **poll_options: Any,
    ) -> None:
        from dbtrigger.runtime.poller import PollTrigger  # noqa: PLC0415
        from dbtrigger.sources.sqlalchemy import SqlAlchemySource  # noqa: PLC0415

        if source.mode != "sidecar" or not source.cursor_column:
            raise ConfigurationError(
                "SidecarFeeder needs a ClaimSource with mode='sidecar' and a cursor_column="
            )
        self.source = source
        self.keyset: SqlAlchemySource = SqlAlchemySource(
            url=None if source.shared_engine else source.url.render_as_string(hide_password=False),
            engine=source.shared_engine,
            table=source.table_name,
            schema=source.schema,
            cursor_column=source.cursor_column,
            pk_columns=source.pk_columns,
            where=source.where,
            parameters=source.parameters,
        )
        self.poll: PollTrigger = PollTrigger(
            name=name,
            source=self.keyset,
            checkpoint_store=checkpoint_store,
            batch_size=batch_size,
            **poll_options,
        )

    def handle(self, events: list[RowChange]) -> None:
        """Insert one claims row per event, ignoring those already there (idempotent)."""
        target = self.source.target
        table = target.table
        rows = [
            {
                "queue": self.source.queue_name,
                "item_key": item_key(e.pk),
                "item_cursor": encoded_json(e.cursor),
            }
            for e in events
        ]
        too_long = [r for r in rows if max(len(r["item_key"]), len(r["item_cursor"])) > 255]
        if too_long:
            raise ConfigurationError(
                f"key or cursor of {len(too_long)} row(s) encodes to more than "
                f"{ITEM_TEXT_LIMIT} characters, the claims table's limit: {too_long[0]}"
            )
        try:
            with self.source.transaction() as conn:
                conn.execute(_insert_ignoring(conn, table), rows)
        except SQLAlchemyError as exc:
            raise OutputWriteError(
                f"feeding {len(rows)} row(s) into {table.name} failed: {short_error(exc)}"
            ) from exc

    def tick(self) -> int:
        """One feeder tick: rows fed (and committed)."""
        return self.poll.tick(self.handle)

    def drain(self, *, max_ticks: int | None = None) -> int:
        return self.poll.drain(self.handle, max_ticks=max_ticks)

    def close(self) -> None:
        self.keyset.close()


def _insert_ignoring(conn: Connection, table: sa.Table) -> Any:
    dialect = conn.dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert  # noqa: PLC0415

        return pg_insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert  # noqa: PLC0415

        return sqlite_insert(table).on_conflict_do_nothing()
    from sqlalchemy.dialects.mysql import insert as mysql_insert  # noqa: PLC0415

    stmt = mysql_insert(table)
    return stmt.on_duplicate_key_update(queue=stmt.inserted.queue)
