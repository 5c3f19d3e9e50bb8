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

A request records where the log ended when it was made (:func:`log_position`),
which says exactly whether it came after a statement of the log
(:func:`asked_after`): the reader's way on past a table put under a watched name.

Cost: the chunk's rows are written to the log once more (twice from the
second chunk on: an update of the reader's chunk row carries the previous
chunk as its before image under ``binlog_row_image=FULL``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pymysql

from dbtrigger._lock_wait import MYSQL_BOUND_SET_BACK, mysql_bound_for_now
from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_context import BinlogSourceParts
from dbtrigger.cdc.binlog_reader import Where, commit_token
from dbtrigger.cdc.binlog_setup import current_position, file_index, table_infos, translated
from dbtrigger.cdc.binlog_values import decode_value, encode_value
from dbtrigger.cdc.snapshots import ChunkWriter, Snapshot, still_pending
from dbtrigger.errors import CorruptStateError, DbTriggerError, SourceDefinitionError

if TYPE_CHECKING:
    from dbtrigger.cdc.binlog_setup import TableInfo

#: MySQL/MariaDB: lock wait timeout exceeded.
ER_LOCK_WAIT_TIMEOUT = 1205


class SnapshotWriter(ChunkWriter[BinlogSourceParts, control.ControlRow, "TableInfo"]):
    """Writes the next chunk of the oldest pending request into the log."""

    LOCKS = "its row locks were"

    def waits(self, exc: Exception, table: str) -> bool:
        if not isinstance(exc, pymysql.MySQLError):
            return False
        with contextlib.suppress(Exception):  # the error below is the one to see
            self.source.connection().rollback()
        if exc.args and exc.args[0] == ER_LOCK_WAIT_TIMEOUT:
            return True
        with translated(f"reading a snapshot chunk of {table}"):
            raise exc

    def chunk(self, row: control.ControlRow, request: Snapshot, info: TableInfo) -> bool:
        s = self.source
        conn = s.connection()
        with conn.cursor() as cur, _chunk_lock_waits(cur, s.snapshot_lock_timeout):
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.begin()
            fresh = s.read_control(conn, lock=True)  # held until the chunk commits
            mine = still_pending(fresh, request)
            if fresh is None or mine is None:
                conn.rollback()
                return False  # changed meanwhile (cdc recreate): the next read reads it again
            try:
                info = _now(cur, info)
                query, params = _chunk_query(info, request, s.snapshot_chunk_size)
            except DbTriggerError:
                conn.rollback()  # the control row's lock with it
                raise
            columns, keys = list(info.names), list(info.key_columns)
            cur.execute(query, params)
            rows = cur.fetchall()
            encoded = [[encode_value(v) for v in r] for r in rows]
            if encoded:
                payload = json.dumps(
                    {"table": info.table.qualified, "columns": columns, "keys": keys}
                    | {"rows": encoded}
                )
                cur.execute(
                    f"INSERT INTO `{s.control_database}`.`{control.CHUNKS}` (reader, seq, payload) "  # noqa: S608
                    "VALUES (%s, %s, %s) ON DUPLICATE KEY UPDATE seq = VALUES(seq), "
                    "payload = VALUES(payload)",
                    (s.reader, request.chunks + 1, payload),
                )
            index = {c: i for i, c in enumerate(columns)}
            last_key = [encode_value(rows[-1][index[k]]) for k in keys] if rows else None
            for advanced in (mine, request):
                advanced.advance(len(rows), last_key, s.snapshot_chunk_size)
            s.save_snapshots(conn, fresh.snapshots)
            conn.commit()
        return bool(rows)


def _now(cur: Any, info: TableInfo) -> TableInfo:
    """``info``'s table as the catalog describes it now, in the chunk's transaction.

    What the source read when it started is stale after an ``ALTER TABLE``: a chunk
    that selected a dropped column failed (``Unknown column``) in every worker started
    before the statement, until it was restarted, and the snapshot the reader asks for
    after such a statement could not be taken. The table is touched first, so its
    metadata lock (held until the chunk commits) keeps a later ``ALTER`` out between
    the catalog read and the chunk's ``SELECT``.
    """
    # Not translated: a lock wait here is the chunk's to wait out (SnapshotWriter.waits).
    cur.execute(f"SELECT 1 FROM {info.table.quoted} LIMIT 0")  # noqa: S608 - validated
    cur.fetchall()
    return table_infos(cur.connection, [info.table])[info.table.qualified]


def _chunk_query(info: TableInfo, request: Snapshot, size: int) -> tuple[str, list[Any]]:
    """The ``SELECT`` of ``request``'s next chunk of at most ``size`` rows of ``info``."""
    keys = list(info.key_columns)
    if not keys:
        raise SourceDefinitionError(
            f"cannot snapshot {info.table.qualified}: it has no primary key to read it in "
            "chunks by; add one, or use snapshot='never'"
        )
    condition = "TRUE"
    params: list[Any] = []
    if request.last_key is not None:
        condition = "({}) > ({})".format(
            ", ".join(f"`{k}`" for k in keys), ", ".join(["%s"] * len(keys))
        )
        types = dict(info.columns)
        for key, encoded in zip(keys, request.last_key, strict=True):
            value = decode_value(encoded)
            if types.get(key) == "bit" and isinstance(value, bytes):
                value = int.from_bytes(value, "big")  # compared as bytes it re-read rows
            params.append(value)
    if request.where:
        condition = f"{condition} AND ({request.where})"  # the operator's own SQL
    query = (
        f"SELECT {', '.join(f'`{c}`' for c in info.names)} FROM {info.table.quoted} "  # noqa: S608
        f"WHERE {condition} ORDER BY {', '.join(f'`{k}`' for k in keys)} "
        f"LIMIT {int(size)} LOCK IN SHARE MODE"
    )
    return query, params


def log_position(conn: pymysql.connections.Connection[Any], row: control.ControlRow) -> str:
    """Where the server writes its next transaction now, as a commit token of the
    reader ``row`` (its generation): a snapshot request's ``log_position``, read in
    the request's transaction, so every chunk of it is read after what the log held
    then (the server writes a statement to the log once it is done, and a request
    seen from the next write's place was made after every write before it).

    Raises:
        ConfigurationError / SourcePermissionError: the server reports no position.
    """
    with translated("reading the binary log position"):
        name, offset = current_position(conn, ())
    return commit_token(file_index(name), offset, None, row.generation)


def asked_after(snapshots: Iterable[Snapshot], table: str, commit: str) -> bool:
    """Was a snapshot of the whole of ``table`` asked for after the statement whose
    transaction begins at commit token ``commit`` was written to the log?

    Decided by the log's positions alone: the request's ``log_position`` (where the
    log ended when it was made) past the statement's start. Never by clocks: the
    log's times are the server's, in whole seconds, and ``requested_at`` the
    client's, so a request made before a statement of the same second, or on a
    client whose clock runs ahead, would count, and its chunks may have read the
    table that left the name. A request of some rows (``--where``), of another
    reader generation (``cdc recreate``), or with no position (one made by an
    earlier version; a reader's first snapshot, which is before every statement it
    reads) does not count.
    """
    statement = Where.parse(commit)
    for request in snapshots:
        if request.table != table or request.where or request.log_position is None:
            continue
        try:
            asked = Where.parse(request.log_position)
        except CorruptStateError:
            continue  # edited by hand: not known to be after
        if asked.generation == statement.generation and (asked.file_index, asked.offset) > (
            statement.file_index,
            statement.offset,
        ):
            return True
    return False


@contextlib.contextmanager
def _chunk_lock_waits(cur: Any, seconds: float) -> Iterator[None]:
    """The chunk's statements wait at most ``seconds`` for a row lock and for the
    table's metadata lock, then fail with ER_LOCK_WAIT_TIMEOUT (the chunk waits for
    the next read); the session's own bounds are set back after it.

    The metadata lock matters as much as the rows: behind another session holding
    the table (``LOCK TABLES ... WRITE``, or an ``ALTER TABLE`` waiting for a long
    transaction, which queues every later statement on the table behind it) the
    chunk's ``SELECT`` waited ``lock_wait_timeout``, a day by default, in the tick."""
    cur.execute(mysql_bound_for_now(seconds))
    try:
        yield
    finally:
        with contextlib.suppress(pymysql.MySQLError, OSError):  # a lost session keeps nothing
            cur.execute(MYSQL_BOUND_SET_BACK)


__all__ = ["SnapshotWriter", "asked_after", "log_position"]
