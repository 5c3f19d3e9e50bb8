"""Who reads a change log, and how far: the registry that keeps pruning from losing rows.

A reader's checkpoint lives in its own state store, which ``changelog prune``
cannot see unless told where (``--passed-by ... --store``). An age-based prune
(``--older-than``) would then delete rows a slow or stopped reader has not
read yet, and that reader would skip them without a word. So every
:class:`~dbtrigger.changelog.ChangeLogSource` that serves a poller records its
position next to the log, in ``dbt_clreaders_<table>``::

    reader      the poller's name (primary key)
    dbt_seq     the log sequence it has committed past (0: none yet)
    seen_at     when it last recorded it (UTC, ISO 8601 text)
    lost_seq    the highest sequence an operator pruned before it read it (NULL: none)

A recorded position is never ahead of the reader's durable checkpoint: it is
written at the first fetch (the checkpoint just loaded) and after the runtime
acknowledged a stored checkpoint. It may lag behind, which only keeps rows a
little longer. :func:`dbtrigger.changelog.prune` deletes no row above the
lowest recorded position, unless the operator names the readers that are to
lose rows (``--drop-unread-of``); their ``lost_seq`` then says so, and the
reader logs it at its next fetch.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from dbtrigger._driver_errors import short_error
from dbtrigger._lock_wait import gave_up_waiting, lock_timed_out
from dbtrigger.names import shortened
from dbtrigger.redaction import redact

log = logging.getLogger("dbtrigger.changelog")

#: Longest reader (poller) name the registry keeps.
READER_NAME_WIDTH = 200


def readers_table_name(table: str) -> str:
    """``dbt_clreaders_<table>``, shortened with a hash when too long."""
    return shortened(f"dbt_clreaders_{table}")


def readers_ddl(table: str, qualified: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the registry (``qualified``: its quoted name)."""
    del table
    return (
        f"CREATE TABLE IF NOT EXISTS {qualified} (\n"
        f"  reader VARCHAR({READER_NAME_WIDTH}) NOT NULL PRIMARY KEY,\n"
        "  dbt_seq BIGINT NOT NULL,\n"
        "  seen_at VARCHAR(40) NOT NULL,\n"
        "  lost_seq BIGINT\n"
        ")"
    )


def _registry(table: str, schema: str | None) -> sa.TableClause:
    return sa.table(
        readers_table_name(table),
        sa.column("reader", sa.String()),
        sa.column("dbt_seq", sa.BigInteger()),
        sa.column("seen_at", sa.String()),
        sa.column("lost_seq", sa.BigInteger()),
        schema=schema,
    )


@dataclass(frozen=True)
class Reader:
    """One registered reader of a change log."""

    name: str
    seq: int
    seen_at: str
    lost_seq: int | None = None


def has_registry(conn: sa.Connection, table: str, schema: str | None) -> bool:
    return sa.inspect(conn).has_table(readers_table_name(table), schema=schema)


def registered(conn: sa.Connection, table: str, schema: str | None) -> list[Reader] | None:
    """Every registered reader, slowest first; None when the registry does not exist."""
    if not has_registry(conn, table, schema):
        return None
    reg = _registry(table, schema)
    rows = conn.execute(
        sa.select(reg.c.reader, reg.c.dbt_seq, reg.c.seen_at, reg.c.lost_seq).order_by(
            reg.c.dbt_seq, reg.c.reader
        )
    )
    return [
        Reader(str(r), int(s), str(t), None if lost is None else int(lost))
        for r, s, t, lost in rows
    ]


def now_text() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def record(conn: sa.Connection, table: str, schema: str | None, reader: str, seq: int) -> bool:
    """Set ``reader``'s position to ``seq`` (insert it when new), in the caller's
    transaction; whether it was inserted (it was not registered)."""
    reg = _registry(table, schema)
    values = {"dbt_seq": seq, "seen_at": now_text()}
    updated = conn.execute(
        sa.update(reg)
        .where(reg.c.reader == reader)
        .values(values)
        .execution_options(preserve_rowcount=True)
    ).rowcount
    if not updated:
        conn.execute(sa.insert(reg).values(reader=reader, **values))
    return not updated


def say_forgotten(reader: str, table: str, seq: int) -> None:
    """Log that ``reader``, registered earlier by this process, was missing from the
    registry and was registered again: it was forgotten (``--forget``) while it ran.

    Until now a prune (``--older-than``) could take rows above its position, and
    nothing marks them lost: the operator is the one who can tell whether a prune ran.
    """
    log.warning(
        "poller %s was removed from the reader registry of %s's change log while it ran "
        "(`dbtrigger changelog readers --forget`) and has registered again at sequence %d. "
        "If a prune ran in between, it may have deleted changes after that sequence that "
        "this poller had not read: compare with `dbtrigger changelog readers` and the "
        "prune's output, and re-sync the poller's consumer if so. Forget only a reader "
        "whose poller is stopped for good",
        reader,
        table,
        seq,
        extra={"event": "changelog_reader_forgotten", "poller": reader, "seq": seq},
    )


def not_recorded(
    engine: sa.Engine, table: str, schema: str | None, seconds: float, exc: BaseException
) -> str:
    """Why :func:`record` failed, in words fit for a log line (no SQL text, no values)."""
    if lock_timed_out(exc):
        registry = readers_table_name(table)
        return gave_up_waiting(engine, registry, schema, seconds, exc, "its entry is unchanged")[0]
    return redact(short_error(exc, None))


def mark_lost(
    conn: sa.Connection, table: str, schema: str | None, readers: Sequence[str], seq: int
) -> None:
    """Record that ``readers`` lost the log rows up to ``seq`` to an operator's prune."""
    reg = _registry(table, schema)
    conn.execute(
        sa.update(reg)
        .where(reg.c.reader.in_(list(readers)))
        .where(sa.or_(reg.c.lost_seq.is_(None), reg.c.lost_seq < seq))
        .values(lost_seq=seq)
    )


def forget(conn: sa.Connection, table: str, schema: str | None, reader: str) -> bool:
    """Remove ``reader`` from the registry (it reads this log no more); whether it was there."""
    reg = _registry(table, schema)
    deleted = conn.execute(
        sa.delete(reg).where(reg.c.reader == reader).execution_options(preserve_rowcount=True)
    ).rowcount
    return bool(deleted)


__all__ = [
    "Reader",
    "forget",
    "has_registry",
    "mark_lost",
    "not_recorded",
    "readers_ddl",
    "readers_table_name",
    "record",
    "registered",
    "say_forgotten",
]
