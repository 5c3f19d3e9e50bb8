"""Seeding the change log with the rows a table already holds.

The change log records changes from the moment its triggers are installed: a
table's existing rows are never delivered. :func:`snapshot` writes them into
the log itself, as ``upsert`` entries (``before`` NULL, ``after`` the row as it
is now, rendered exactly as the triggers render a row), in key order, in
chunks of ``chunk`` rows. ``ChangeLogSource`` delivers them as events with
``op="upsert"`` and ``metadata["snapshot"]`` True, among the changes, in log
order.

**Why nothing is lost or out of order at the hand-over.** Each chunk is one
``INSERT INTO log ... SELECT ... FROM table`` statement that locks the rows it
reads (``FOR SHARE`` on PostgreSQL, InnoDB's shared locks of ``INSERT ...
SELECT`` on MariaDB/MySQL; SQLite runs one writer at a time). A change to a
row either committed before the chunk read it - its trigger's entry then has
a lower sequence number, and the snapshot entry carries the newer image - or
waits for the chunk's transaction and is logged after it, with a higher
number. Per key, the log stays in change order; a row inserted while the
snapshot runs is delivered by its own trigger entry (and perhaps once more by
the snapshot: a duplicate, never a loss). The triggers keep logging all the
while, so nothing needs to stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger._engine import reflect_table as reflect_sa_table
from dbtrigger._lock_wait import bounded_transaction, check_lock_timeout, ddl_gives_up
from dbtrigger.changelog import operations
from dbtrigger.changelog.ddl import LOG_COLUMNS, OP_WIDTH, reflect_table
from dbtrigger.changelog.drift import install_command, op_width
from dbtrigger.changelog.operations import log_table
from dbtrigger.changelog.triggers import current_image_sql
from dbtrigger.errors import ConfigurationError

#: Rows one snapshot statement copies (one short transaction each).
DEFAULT_SNAPSHOT_CHUNK = 1000


@dataclass(frozen=True)
class SnapshotResult:
    rows: int
    chunks: int


def _check_where(where: str | None) -> str | None:
    """An operator's filter is SQL text; refuse what would end the statement."""
    if where is None or not where.strip():
        return None
    if ";" in where or "--" in where or "/*" in where:
        raise ConfigurationError(
            "--where is one condition on the table's columns (no ';' or comments)"
        )
    return where


def snapshot(
    engine: Engine,
    table: str,
    *,
    schema: str | None = None,
    where: str | None = None,
    chunk: int = DEFAULT_SNAPSHOT_CHUNK,
    apply: bool = True,
    progress: Callable[[int], None] | None = None,
    lock_timeout_seconds: float | None = None,
) -> SnapshotResult:
    """Write the rows ``table`` holds now (matching ``where``) into its change log.

    With ``apply=False`` only counts them. Returns the rows written and chunks.
    A chunk waits at most ``lock_timeout_seconds`` (None: 30 s) for a row another
    transaction holds (its share locks would hold that table's writers behind it
    meanwhile), then gives up with a
    :class:`~dbtrigger.errors.RetryableError` naming the holders; the chunks
    written before stay in the log (a second run logs those rows again:
    duplicates, never a loss).

    Raises:
        ConfigurationError: the change log is not installed, or ``where`` is not
            one condition.
    """
    if chunk < 1:
        raise ConfigurationError(f"chunk must be >= 1, got {chunk}")
    condition = _check_where(where)
    log = log_table(engine, table, schema)
    with engine.connect() as conn:
        info = reflect_table(conn, table, schema)
        source = reflect_sa_table(conn, table, schema)
    keys = [source.c[c.name] for c in info.pk]
    filters: list[sa.ColumnElement[bool]] = (
        [sa.text(f"({condition})")] if condition else []  # type: ignore[list-item]
    )
    if not apply:
        with engine.connect() as conn:
            count = conn.execute(sa.select(sa.func.count()).select_from(source).where(*filters))
            return SnapshotResult(int(count.scalar_one()), 0)
    quote = engine.dialect.identifier_preparer.quote
    if info.dialect == "postgresql":
        image: Any = sa.literal_column(f"to_jsonb({quote(source.name)})::text")
    else:
        image = sa.literal_column(current_image_sql(info, quote))
    columns = ["dbt_op", *(c.name for c in info.pk), "dbt_before", "dbt_after"]
    values: list[Any] = [sa.literal("upsert"), *keys, sa.null(), image]
    if info.dialect == "postgresql":
        columns.append("dbt_txid")
        values.append(sa.literal_column("pg_current_xact_id()::text::bigint"))
    seconds = _seconds(lock_timeout_seconds)
    last: Sequence[Any] | None = None
    written = chunks = 0
    while True:
        # Where this chunk ends, read first on its own: a boundary, not a promise
        # (the INSERT ... SELECT below reads and locks the rows). Reading it in the
        # same transaction would, on SQLite, take a read lock that the INSERT then
        # has to upgrade while a writer waits on it: a deadlock SQLite answers
        # with "database is locked".
        with engine.connect() as conn:
            bound = conn.execute(
                _page(sa.select(*keys).select_from(source), keys, last, filters)
                .order_by(*keys)
                .offset(chunk - 1)
                .limit(1)
            ).first()
        pick = _page(sa.select(*values).select_from(source), keys, last, filters)
        if bound is not None:
            pick = pick.where(_at_most(keys, tuple(bound)))
        pick = pick.order_by(*keys)
        if info.dialect == "postgresql":
            pick = pick.with_for_update(read=True, of=source)
        elif info.dialect != "sqlite":
            pick = pick.with_for_update(read=True)
        # SQLAlchemy keeps an INSERT's row count only when asked (psycopg's is -1 else).
        statement = sa.insert(log).from_select(columns, pick)
        before = f"{written} row(s) in {chunks} chunk(s) written before stay in the log"
        with (
            ddl_gives_up(
                engine, table, schema, seconds, f"snapshotting {table}", f"{before}; {_AGAIN}"
            ),
            bounded_transaction(engine, seconds) as conn,
        ):
            inserted = conn.execute(statement.execution_options(preserve_rowcount=True)).rowcount
        written += int(inserted or 0)
        chunks += 1
        if progress is not None:
            progress(written)
        if bound is None:
            return SnapshotResult(written, chunks)
        last = tuple(bound)


def _page(
    stmt: sa.Select[Any],
    keys: Sequence[sa.ColumnElement[Any]],
    last: Sequence[Any] | None,
    filters: Sequence[sa.ColumnElement[bool]],
) -> sa.Select[Any]:
    if filters:
        stmt = stmt.where(*filters)
    if last is not None:
        stmt = stmt.where(
            keys[0] > last[0] if len(keys) == 1 else sa.tuple_(*keys) > sa.tuple_(*last)
        )
    return stmt


def _at_most(keys: Sequence[sa.ColumnElement[Any]], bound: Sequence[Any]) -> sa.ColumnElement[bool]:
    if len(keys) == 1:
        single: sa.ColumnElement[bool] = keys[0] <= bound[0]
        return single
    return sa.tuple_(*keys) <= sa.tuple_(*bound)


def resync(
    engine: Engine,
    table: str,
    *,
    schema: str | None = None,
    chunk: int = DEFAULT_SNAPSHOT_CHUNK,
    apply: bool = True,
    lock_timeout_seconds: float | None = None,
) -> SnapshotResult:
    """Record that ``table`` was emptied, then write every row it holds into its log.

    The repair for rows that left the table with no delete logged (a
    ``TRUNCATE`` on MariaDB/MySQL, see :mod:`dbtrigger.changelog.vanished`):
    readers get a ``truncate`` event (drop everything you hold), then one
    ``upsert`` per row the table holds, then the changes made meanwhile, in log
    order; the result is the table as it is. With ``apply=False`` only counts.
    Each write waits at most ``lock_timeout_seconds`` for a lock (see
    :func:`snapshot`).

    Raises:
        ConfigurationError: the change log is not installed, or its layout
            predates truncate rows (install again first).
    """
    log = log_table(engine, table, schema)
    with engine.connect() as conn:
        info = reflect_table(conn, table, schema)
        narrow = op_width(conn, info) < OP_WIDTH
    strict = [c.name for c in log.columns if c.name not in LOG_COLUMNS and not c.nullable]
    if narrow or strict:
        raise ConfigurationError(
            f"the change log of {table} was installed by an older dbtrigger and cannot hold a "
            f"truncate row; upgrade it in place first: `{install_command(table, schema)}`"
            + (
                " (on SQLite its key columns stay NOT NULL: drain the log, `changelog "
                "uninstall --drop-log --yes`, install, then `changelog snapshot`)"
                if strict
                else ""
            )
        )
    if not apply:
        return snapshot(engine, table, schema=schema, apply=False)
    seconds = _seconds(lock_timeout_seconds)
    with (
        ddl_gives_up(engine, log.name, log.schema, seconds, f"resyncing {table}", _AGAIN),
        bounded_transaction(engine, seconds) as conn,
    ):
        conn.execute(sa.insert(log).values(dbt_op="truncate"))
    return snapshot(engine, table, schema=schema, chunk=chunk, lock_timeout_seconds=seconds)


#: What a snapshot that gave up waiting for a lock says to do.
_AGAIN = "run the command again once it ends, or end it"


def _seconds(given: float | None) -> float:
    """The lock bound of a snapshot's writes (None: the commands' 30 s)."""
    return check_lock_timeout(operations.INSTALL_LOCK_TIMEOUT if given is None else given)


__all__ = ["DEFAULT_SNAPSHOT_CHUNK", "SnapshotResult", "resync", "snapshot"]
