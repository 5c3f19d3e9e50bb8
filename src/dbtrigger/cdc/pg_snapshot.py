"""Snapshots in chunks, written into the log so they arrive in commit order.

``snapshot="initial"`` (and ``dbtrigger cdc snapshot --table t [--where ...]``
later) asks for a table's existing rows. They are read one chunk at a time, in
key order, and each chunk is written into the WAL as one transactional logical
message, in a transaction that also moves the request forward in
``dbtrigger_cdc_slots`` (:mod:`dbtrigger.cdc.pg_control`). The reader
(:mod:`dbtrigger.cdc.pg_reader`) turns the message back into rows, delivered
as ``upsert`` events with ``metadata["snapshot"]``, at the position of the
chunk's commit in the log, between the changes committed before and after it.

Why this never leaves a gap and never goes back in time for a key:

* The chunk transaction takes a brief ``SHARE`` lock on the table before it
  reads (``snapshot_lock_timeout_seconds``, default 2 s; a chunk that cannot
  get it is tried at the next read). No writer of the table can then be in
  flight: every change committed before the lock is in the chunk's read *and*
  earlier in the log, every change after it commits after the chunk. So a
  chunk row is never older than a change delivered before it, and never newer
  than one delivered after it (the problem DBLog's watermarks solve without
  a lock, at the cost of more bookkeeping).
* The request and the chunk commit together: an interrupted snapshot resumes
  at the next chunk, never from zero and never skipping one. The rows in the
  log are delivered at least once like any change.

Cost: one chunk per read while the poller is caught up, a ``SHARE`` lock held
for one keyset read of ``snapshot_chunk_size`` rows (writers of that table wait
that long), and the chunk's bytes written once more into the WAL.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.adapt import Loader

from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc.pg_connection import translated
from dbtrigger.cdc.pg_reader import SNAPSHOT_PREFIX
from dbtrigger.errors import SourceDefinitionError

if TYPE_CHECKING:
    from dbtrigger.cdc.pg_setup import TableInfo
    from dbtrigger.cdc.pg_source import PgLogicalSource

log = logging.getLogger("dbtrigger.cdc")

#: How often a running source looks for new snapshot requests (``cdc snapshot``).
RECHECK_SECONDS = 5.0


class _RawText(Loader):
    """Load a column as the bytes of its type's text output (what pgoutput sends)."""

    def load(self, data: Any) -> bytes:
        return bytes(data)


class SnapshotWriter:
    """Writes the next chunk of the oldest pending request into the log."""

    def __init__(self, source: PgLogicalSource) -> None:
        self.source = source
        self._next_check = 0.0
        self._pending = True

    def poke(self) -> None:
        """Look for requests at the next read (a request was just added)."""
        self._next_check = 0.0
        self._pending = True

    def emit(self, conn: psycopg.Connection[Any]) -> bool:
        """Write one chunk if a request is pending; True when one was written."""
        now = time.monotonic()
        if not self._pending and now < self._next_check:
            return False
        self._next_check = now + RECHECK_SECONDS
        s = self.source
        row = control.read(conn, s.control_schema, s.slot)
        pending = row.pending_snapshots if row is not None else []
        self._pending = bool(pending)
        if not pending or row is None:
            return False
        request = pending[0]
        info = s.infos.get(request.table)
        if info is None:
            log.warning(
                "snapshot of %s skipped: it is not one of this source's tables",
                request.table,
                extra={"event": "cdc_snapshot_skipped", "poller": s.poller},
            )
            request.done = True
            control.save_snapshots(conn, s.control_schema, s.slot, row.snapshots)
            return False
        try:
            written = self._chunk(conn, row, request, info)
        except pg_errors.LockNotAvailable:
            log.info(
                "snapshot chunk of %s waits: the table's SHARE lock was not granted within "
                "%gs (a long writer); tried again at the next read",
                request.table,
                s.snapshot_lock_timeout,
                extra={"event": "cdc_snapshot_lock_wait", "poller": s.poller},
            )
            self._pending = True
            return False
        return written

    def _chunk(
        self,
        conn: psycopg.Connection[Any],
        row: control.ControlRow,
        request: control.Snapshot,
        info: TableInfo,
    ) -> bool:
        s = self.source
        keys = info.key_columns
        if not keys:
            raise SourceDefinitionError(
                f"cannot snapshot {info.table.qualified}: it has no primary key (or replica "
                "identity index) to read it in chunks by; add one, or use snapshot='never'"
            )
        columns = list(info.columns)
        types = [info.columns[c][0] for c in columns]
        condition: sql.Composable = sql.SQL("TRUE")
        params: list[Any] = []
        if request.last_key is not None:
            condition = sql.SQL("({}) > ({})").format(
                sql.SQL(", ").join(sql.Identifier(k) for k in keys),
                sql.SQL(", ").join(
                    sql.SQL("%s::{}").format(sql.SQL(info.columns[k][1])) for k in keys
                ),
            )
            params.extend(request.last_key)
        if request.where:
            where = sql.SQL(request.where)  # the operator's own SQL (cdc snapshot --where)
            condition = sql.SQL("{} AND ({})").format(condition, where)
        query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in columns),
            info.table.identifier(),
            condition,
            sql.SQL(", ").join(sql.Identifier(k) for k in keys),
            sql.Literal(s.snapshot_chunk_size),
        )
        with translated(f"reading a snapshot chunk of {info.table.qualified}"), conn.transaction():
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{int(s.snapshot_lock_timeout * 1000)}ms")
                )
            )
            conn.execute("SET LOCAL statement_timeout = '60s'")
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(info.table.identifier()))
            cursor = conn.cursor()
            for oid in set(types):
                cursor.adapters.register_loader(oid, _RawText)
            rows = cursor.execute(query, params).fetchall()
            texts = [[None if v is None else v.decode() for v in r] for r in rows]
            payload = {
                "table": info.table.qualified,
                "columns": columns,
                "types": types,
                "rows": texts,
            }
            if texts:
                conn.execute(
                    "SELECT pg_logical_emit_message(true, %s, %s)",
                    (SNAPSHOT_PREFIX + s.slot, json.dumps(payload)),
                )
                index = {c: i for i, c in enumerate(columns)}
                request.last_key = [texts[-1][index[k]] for k in keys]
            request.chunks += 1
            request.rows += len(texts)
            request.done = len(texts) < s.snapshot_chunk_size
            if request.requested_at is None:
                request.requested_at = dt.datetime.now(dt.timezone.utc).isoformat()
            control.save_snapshots(conn, s.control_schema, s.slot, row.snapshots)
        if request.done:
            log.info(
                "snapshot of %s complete: %d rows in %d chunks",
                request.table,
                request.rows,
                request.chunks,
                extra={"event": "cdc_snapshot_done", "poller": s.poller, "table": request.table},
            )
        return bool(texts)


__all__ = ["SnapshotWriter"]
