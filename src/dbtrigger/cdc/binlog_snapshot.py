"""Snapshots in chunks, written into the binary log so they arrive in commit order.

The design of :mod:`dbtrigger.cdc.pg_snapshot`, on a binlog: a table's rows
are read one chunk at a time, in key order, and each chunk is written into the
log as one row of ``dbtrigger_cdc_chunks`` (the rows as JSON), in the same
transaction that moves the request forward in the control row. The reader
(:mod:`dbtrigger.cdc.binlog_reader`) turns that row back into ``upsert``
events with ``metadata["snapshot"]``, at the chunk's place in the log.

Why no gap and no step back in time for a key: the chunk is read with
``SELECT ... LOCK IN SHARE MODE`` under ``REPEATABLE READ``, which locks the
rows it reads and the gaps between them (next-key locks) until the chunk
commits. A writer that changed one of those rows before holds its lock until
it committed, which puts its change in the log before the chunk; one that
comes after waits for the chunk's commit and lands after it. (The server
writes a transaction to the binary log before it releases its locks.) A chunk
whose locks are not granted within ``snapshot_lock_timeout_seconds`` is tried
again at the next read.

Cost: the chunk's rows are written to the log once more (twice from the
second chunk on: an update of the reader's chunk row carries the previous
chunk as its before image under ``binlog_row_image=FULL``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import pymysql

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_reader import decode_value, encode_value
from dbtrigger.cdc.binlog_setup import translated
from dbtrigger.errors import SourceDefinitionError

if TYPE_CHECKING:
    from dbtrigger.cdc.binlog_setup import TableInfo
    from dbtrigger.cdc.binlog_source import BinlogSource
    from dbtrigger.cdc.position import LogPosition

log = logging.getLogger("dbtrigger.cdc")

#: How often a running source looks for new snapshot requests (``cdc snapshot``).
RECHECK_SECONDS = 5.0
#: MySQL/MariaDB: lock wait timeout exceeded.
ER_LOCK_WAIT_TIMEOUT = 1205


class SnapshotWriter:
    """Writes the next chunk of the oldest pending request into the log."""

    def __init__(self, source: BinlogSource) -> None:
        self.source = source
        self._next_check = 0.0
        self._pending = True

    def poke(self) -> None:
        self._next_check = 0.0
        self._pending = True

    def emit(self, after: LogPosition | None) -> bool:
        """Write one chunk if a request is pending; True when one was written."""
        now = time.monotonic()
        if not self._pending and now < self._next_check:
            return False
        self._next_check = now + RECHECK_SECONDS
        s = self.source
        conn = s.connection()
        row = control.read(conn, s.control_database, s.reader)
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
            control.update(conn, s.control_database, s.reader, snapshots=row.snapshots)
            return False
        try:
            return self._chunk(conn, row, request, info)
        except pymysql.MySQLError as exc:
            with _quietly():
                conn.rollback()
            if exc.args and exc.args[0] == ER_LOCK_WAIT_TIMEOUT:
                log.info(
                    "snapshot chunk of %s waits: its row locks were not granted within %gs "
                    "(a long writer); tried again at the next read",
                    request.table,
                    s.snapshot_lock_timeout,
                    extra={"event": "cdc_snapshot_lock_wait", "poller": s.poller},
                )
                self._pending = True
                return False
            with translated(f"reading a snapshot chunk of {request.table}"):
                raise

    def _chunk(
        self,
        conn: pymysql.connections.Connection[Any],
        row: control.ControlRow,
        request: control.Snapshot,
        info: TableInfo,
    ) -> bool:
        s = self.source
        keys = list(info.key_columns)
        if not keys:
            raise SourceDefinitionError(
                f"cannot snapshot {info.table.qualified}: it has no primary key to read it in "
                "chunks by; add one, or use snapshot='never'"
            )
        columns = list(info.names)
        condition = "TRUE"
        params: list[Any] = []
        if request.last_key is not None:
            condition = "({}) > ({})".format(
                ", ".join(f"`{k}`" for k in keys), ", ".join(["%s"] * len(keys))
            )
            params.extend(decode_value(v) for v in request.last_key)
        if request.where:
            condition = f"{condition} AND ({request.where})"  # the operator's own SQL
        query = (
            f"SELECT {', '.join(f'`{c}`' for c in columns)} FROM {info.table.quoted} "  # noqa: S608
            f"WHERE {condition} ORDER BY {', '.join(f'`{k}`' for k in keys)} "
            f"LIMIT {int(s.snapshot_chunk_size)} LOCK IN SHARE MODE"
        )
        timeout = max(1, round(s.snapshot_lock_timeout))
        with conn.cursor() as cur:
            cur.execute(f"SET SESSION innodb_lock_wait_timeout = {timeout}")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.begin()
            cur.execute(query, params)
            rows = cur.fetchall()
            encoded = [[encode_value(v) for v in r] for r in rows]
            if encoded:
                payload = json.dumps(
                    {"table": info.table.qualified, "columns": columns, "rows": encoded}
                )
                cur.execute(
                    f"INSERT INTO `{s.control_database}`.`{control.CHUNKS}` (reader, seq, payload) "  # noqa: S608
                    "VALUES (%s, %s, %s) ON DUPLICATE KEY UPDATE seq = VALUES(seq), "
                    "payload = VALUES(payload)",
                    (s.reader, request.chunks + 1, payload),
                )
                index = {c: i for i, c in enumerate(columns)}
                request.last_key = [encode_value(rows[-1][index[k]]) for k in keys]
            request.chunks += 1
            request.rows += len(rows)
            request.done = len(rows) < s.snapshot_chunk_size
            if request.requested_at is None:
                request.requested_at = dt.datetime.now(dt.timezone.utc).isoformat()
            control.update(conn, s.control_database, s.reader, snapshots=row.snapshots)
            conn.commit()
        if request.done:
            log.info(
                "snapshot of %s complete: %d rows in %d chunks",
                request.table,
                request.rows,
                request.chunks,
                extra={"event": "cdc_snapshot_done", "poller": s.poller, "table": request.table},
            )
        return bool(rows)


class _quietly:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


__all__ = ["SnapshotWriter"]
