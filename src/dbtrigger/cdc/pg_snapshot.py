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

import json
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.adapt import Loader

from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.pg_connection import translated
from dbtrigger.cdc.pg_context import PgSourceParts
from dbtrigger.cdc.pg_reader import SNAPSHOT_PREFIX
from dbtrigger.cdc.snapshots import ChunkWriter, Snapshot, still_pending
from dbtrigger.errors import SourceDefinitionError

if TYPE_CHECKING:
    from dbtrigger.cdc.pg_setup import TableInfo


class _RawText(Loader):
    """Load a column as the bytes of its type's text output (what pgoutput sends)."""

    def load(self, data: Any) -> bytes:
        return bytes(data)


def generated_columns(conn: psycopg.Connection[Any], table_oid: int) -> set[str]:
    """The table's generated columns, which a snapshot chunk leaves out.

    pgoutput does not publish them (before PostgreSQL 18, and there only with the
    publication's ``publish_generated_columns``, which the source does not set): a
    row's snapshot event had the column, every change of it after lacked the key.
    """
    with translated("reading the table's generated columns"):
        rows = conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
            "AND NOT attisdropped AND attgenerated <> ''",
            (table_oid,),
        ).fetchall()
    return {r[0] for r in rows}


class SnapshotWriter(ChunkWriter[PgSourceParts, control.ControlRow, "TableInfo"]):
    """Writes the next chunk of the oldest pending request into the log."""

    LOCKS = "the table's SHARE lock (or its control row's lock) was"

    def waits(self, exc: Exception, table: str) -> bool:
        seen: BaseException | None = exc
        while seen is not None:  # translated() wraps the driver's error
            if isinstance(seen, pg_errors.LockNotAvailable):
                return True
            seen = seen.__cause__
        return False

    def chunk(self, row: control.ControlRow, request: Snapshot, info: TableInfo) -> bool:
        s = self.source
        conn: psycopg.Connection[Any] = s.connection()
        with translated(f"reading a snapshot chunk of {info.table.qualified}"), conn.transaction():
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{int(s.snapshot_lock_timeout * 1000)}ms")
                )
            )
            conn.execute("SET LOCAL statement_timeout = '60s'")
            fresh = s.read_control(conn, lock=True)  # held until the chunk commits
            mine = still_pending(fresh, request)
            if fresh is None or mine is None:
                return False  # changed meanwhile (cdc recreate): the next read reads it again
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(info.table.identifier()))
            # The table as it is now, under the lock (no ALTER until the chunk commits):
            # what the source read at its start selected a dropped column ("column ... does
            # not exist") in every worker started before the ALTER, until it restarted.
            info = setup.table_infos(conn, [info.table])[info.table.qualified]
            query, params, columns, types = _chunk_query(conn, info, request, s.snapshot_chunk_size)
            cursor = conn.cursor()
            # A domain column comes typed as its base type: loaded as text too, never as
            # a Python value (a numeric domain came as a Decimal and failed the chunk).
            for oid in {*types, *info.domains.values()}:
                cursor.adapters.register_loader(oid, _RawText)
            rows = cursor.execute(query, params).fetchall()
            texts = [[None if v is None else v.decode() for v in r] for r in rows]
            if texts:
                payload = {
                    "table": info.table.qualified,
                    "columns": columns,
                    "types": types,
                    "rows": texts,
                }
                conn.execute(
                    "SELECT pg_logical_emit_message(true, %s, %s)",
                    (SNAPSHOT_PREFIX + s.slot, json.dumps(payload)),
                )
            index = {c: i for i, c in enumerate(columns)}
            last_key = [texts[-1][index[k]] for k in info.key_columns] if texts else None
            for advanced in (mine, request):
                advanced.advance(len(texts), last_key, s.snapshot_chunk_size)
            s.save_snapshots(conn, fresh.snapshots)
        return bool(texts)


def _chunk_query(
    conn: psycopg.Connection[Any], info: TableInfo, request: Snapshot, size: int
) -> tuple[sql.Composed, list[Any], list[str], list[int]]:
    """The ``SELECT`` of ``request``'s next chunk of at most ``size`` rows of ``info``, its
    parameters, and the columns it reads with their type oids."""
    keys = info.key_columns
    if not keys:
        raise SourceDefinitionError(
            f"cannot snapshot {info.table.qualified}: it has no primary key (or replica "
            "identity index) to read it in chunks by; add one, or use snapshot='never'"
        )
    generated = generated_columns(conn, info.oid) - set(keys)
    columns = [c for c in info.columns if c not in generated]
    types = [info.columns[c][0] for c in columns]
    condition: sql.Composable = sql.SQL("TRUE")
    params: list[Any] = []
    if request.last_key is not None:
        condition = sql.SQL("({}) > ({})").format(
            sql.SQL(", ").join(sql.Identifier(k) for k in keys),
            sql.SQL(", ").join(sql.SQL("%s::{}").format(sql.SQL(info.columns[k][1])) for k in keys),
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
        sql.Literal(size),
    )
    return query, params, columns, types


__all__ = ["SnapshotWriter", "generated_columns"]
