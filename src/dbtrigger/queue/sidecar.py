"""Sidecar mode: a claims table next to a user table that stays untouched.

For the seed's "complications" - a table with ids but no status column, a
sequence instead of ids, rows that are hard-deleted - the claim state cannot
live on the row. Instead:

* a :class:`SidecarFeeder` (a keyset :class:`~dbtrigger.PollTrigger` with its
  own lease and state document, exactly one active instance) follows the
  user table by ``cursor_column`` and inserts ``(queue, key, cursor)`` for
  each new or changed row into the claims table
  (:mod:`dbtrigger.queue.sidecar_table`). The insert ignores rows already
  there, so a redelivered batch changes nothing, and the poller advances its
  checkpoint only after the handler - that insert - committed: a row is never
  passed over before its job exists;
* workers (:class:`~dbtrigger.QueueTrigger` over a ``mode="sidecar"``
  :class:`~dbtrigger.ClaimSource`) claim from the claims table with the same
  statements as columns mode, and read the user rows by key for the handler.
  A row deleted since it was fed is delivered with ``op="delete"`` and
  ``after=None``.

The feeder's insert is bounded like every write of ``db.output``
(:mod:`dbtrigger._lock_wait`: 30 s, at most a quarter of its lease) and fails
with the same typed errors: ``OutputLockTimeoutError`` when it gave up waiting
for another transaction's lock, ``OutputConstraintError`` when a rule of the
claims table refused a row (:mod:`dbtrigger._write_refusals`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger._driver_errors import short_error
from dbtrigger._lock_wait import (
    DEFAULT_WRITE_LOCK_TIMEOUT,
    check_lock_timeout,
    gave_up_waiting,
    lock_timed_out,
    lock_wait_bounded,
)
from dbtrigger._write_refusals import refusal, refusal_error
from dbtrigger.cursor import encoded_json
from dbtrigger.errors import ConfigurationError, OutputLockTimeoutError, OutputWriteError
from dbtrigger.events import RowChange
from dbtrigger.queue.sidecar_table import ITEM_TEXT_LIMIT, item_key
from dbtrigger.queue.source import ClaimSource
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore


class SidecarFeeder:
    """Copies ``(key, cursor)`` of new and changed rows into the claims table.

    Args:
        name: the feeder's poller name (its state document).
        source: the ``mode="sidecar"`` :class:`ClaimSource` (its ``cursor_column``
            is followed; its ``where`` filters the user table).
        checkpoint_store: where the feeder's state document lives.
        batch_size / poll_options: as for :class:`~dbtrigger.PollTrigger`.
        lock_timeout_seconds: how long the insert waits for a lock another
            transaction holds on the claims table (default 30 s, lowered to a
            quarter of ``lease_ttl_seconds``; a value given must fit it).

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
        lock_timeout_seconds: float | None = None,
        **poll_options: Any,
    ) -> None:
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
        limit = self.poll.lease_ttl.total_seconds() / 4
        if lock_timeout_seconds is None:
            self.lock_timeout = min(DEFAULT_WRITE_LOCK_TIMEOUT, limit)
        else:
            self.lock_timeout = check_lock_timeout(lock_timeout_seconds)
            if self.lock_timeout > limit:
                raise ConfigurationError(
                    f"SidecarFeeder: lock_timeout_seconds={self.lock_timeout:g} does not fit "
                    f"the lease; use at most {limit:g} (a quarter of lease_ttl_seconds)"
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
        what = f"feeding {len(rows)} row(s) into {table.name}"
        try:
            with self._bounded() as conn:
                conn.execute(_insert_ignoring(conn, table), rows)
        except SQLAlchemyError as exc:
            engine = self.source.engine
            if lock_timed_out(exc):
                text, holders = gave_up_waiting(
                    engine,
                    table.name,
                    table.schema,
                    self.lock_timeout,
                    exc,
                    "nothing was fed, the feeder's batch comes again. End the transaction "
                    "left open there",
                )
                raise OutputLockTimeoutError(
                    f"{what} {text}",
                    table=table.name,
                    rows=len(rows),
                    seconds=self.lock_timeout,
                    holders=holders or None,
                ) from exc
            found = refusal(exc, table, rows)
            if found is not None:
                where = f"{engine.dialect.name}:{table.name}"
                raise refusal_error(found, where, table, rows) from exc
            raise OutputWriteError(f"{what} failed: {short_error(exc)}") from exc

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[Connection]:
        """A write transaction on the queue's engine whose lock waits are bounded: READ
        COMMITTED on PostgreSQL (the queue's engine is in autocommit, where ``SET
        LOCAL`` would last one statement) and MariaDB/MySQL; on SQLite the busy
        timeout is set before ``BEGIN IMMEDIATE``, which takes the write lock."""
        with self.source.engine.connect() as conn:
            raw: Any = None
            previous = 0
            if conn.dialect.name == "sqlite":
                raw = conn.connection.dbapi_connection
                previous = int(raw.execute("PRAGMA busy_timeout").fetchone()[0])
                raw.execute(f"PRAGMA busy_timeout = {max(1, math.ceil(self.lock_timeout * 1000))}")
            else:
                conn.execution_options(isolation_level="READ COMMITTED")
            try:
                with conn.begin(), lock_wait_bounded(conn, self.lock_timeout):
                    yield conn
            finally:
                if raw is not None:
                    with contextlib.suppress(Exception):  # a lost connection keeps nothing
                        raw.execute(f"PRAGMA busy_timeout = {previous}")

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


__all__ = ["SidecarFeeder"]
