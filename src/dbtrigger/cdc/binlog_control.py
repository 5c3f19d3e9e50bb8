"""A BinlogSource's own bookkeeping in the database: one row per reader, and snapshot chunks.

A binary log has no replication slot: the server keeps its files for
``binlog_expire_logs_seconds`` whoever reads them, and remembers nothing about
a reader. What must outlive a worker process, beside the poller's checkpoint,
lives in ``dbtrigger_cdc_binlog`` (one row per reader, in ``control_database``,
by default the URL's):

* where the reader was **created** (binlog file and offset): the first read of
  a poller with no checkpoint starts there, so nothing committed between
  ``install`` and the first tick is missed;
* the **accepted columns** of each table (name -> binlog type), as
  PostgreSQL's ``dbtrigger_cdc_slots`` keeps them: a new column just appears,
  a type change stops delivery until ``dbtrigger cdc accept-schema``;
* the **snapshot requests** and how far each got;
* **read-through**: after a read that found nothing for a checkpoint, how far
  the log was read (file, offset). The next process resumes there instead of
  re-reading every other table's changes since the checkpoint: the binlog's
  counterpart of advancing a slot, written only behind a durable checkpoint;
* the reader's **generation**, set by ``install`` and ``recreate``: the first
  part of every commit token it writes, so a checkpoint taken before a
  ``recreate`` is never read as a position of the log read since;
* with each of those two positions, the **mark** of the file it is in
  (``created_mark``, ``through_mark``): the server id and creation second of
  the file's format description event, which every binlog dump sends first.
  A file name and offset alone do not name a place in *this* log: after
  ``RESET MASTER``, or on a restored server or a promoted replica, a file of
  the same name holds other transactions (see :mod:`dbtrigger.cdc.binlog_poll`).

Snapshot chunks are rows of ``dbtrigger_cdc_chunks`` written in the binlog
(:mod:`dbtrigger.cdc.binlog_snapshot`); their table is read by the reader, never
delivered.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pymysql

from dbtrigger._driver_errors import short_error
from dbtrigger._lock_wait import (
    DEFAULT_STORE_LOCK_TIMEOUT,
    MYSQL_BOUND_SET_BACK,
    lock_timed_out,
    mysql_bound_for_now,
    mysql_whole_seconds,
)
from dbtrigger._mysql_holders import Run, mysql_holders_words
from dbtrigger.cdc.binlog_setup import current_user, translated
from dbtrigger.cdc.snapshots import Snapshot
from dbtrigger.errors import ConfigurationError, DbTriggerError, FetchError, SourcePermissionError

TABLE = "dbtrigger_cdc_binlog"
_NO_COLUMN = 1054  # ER_BAD_FIELD_ERROR: a control table of an earlier version
CHUNKS = "dbtrigger_cdc_chunks"

#: How long creating or altering the control tables waits for a metadata lock (a
#: transaction open on the table elsewhere, a backup's BACKUP STAGE BLOCK_DDL): the
#: server's lock_wait_timeout is a day by default, and the tick waited all of it.
DDL_LOCK_WAIT_SECONDS = DEFAULT_STORE_LOCK_TIMEOUT


@contextlib.contextmanager
def _bounded_ddl(
    conn: pymysql.connections.Connection[Any], database: str, table: str, doing: str
) -> Iterator[pymysql.cursors.Cursor]:
    """A cursor whose statements wait at most :data:`DDL_LOCK_WAIT_SECONDS` for a
    metadata lock (the session's own bounds are set back after); giving up is a
    :class:`~dbtrigger.errors.FetchError` (the next tick tries again) naming the table
    and who may hold the lock (:func:`~dbtrigger._mysql_holders.mysql_holders_words`)."""
    wait = mysql_whole_seconds(DDL_LOCK_WAIT_SECONDS)
    with conn.cursor() as cur:
        cur.execute(mysql_bound_for_now(DDL_LOCK_WAIT_SECONDS))
        try:
            yield cur
        except pymysql.MySQLError as exc:
            if not lock_timed_out(exc):
                raise
            holders = mysql_holders_words(_runner(conn), table, database)
            raise FetchError(
                f"{doing} {database}.{table} waited {wait} s for a metadata lock another "
                "session holds (a transaction left open on the table, or a backup blocking "
                "DDL) and gave up"
                + (f": {holders}" if holders else "")
                + "; nothing was changed, the next tick tries again. End that "
                f"transaction or backup ({type(exc).__name__} {exc.args[0]})",
                table=f"{database}.{table}",
                seconds=wait,
            ) from exc
        finally:
            with contextlib.suppress(pymysql.MySQLError):
                cur.execute(MYSQL_BOUND_SET_BACK)


def _runner(conn: pymysql.connections.Connection[Any]) -> Run:
    """:data:`~dbtrigger._mysql_holders.Run` on a PyMySQL connection."""

    def run(sql: str, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        with conn.cursor() as cur:
            cur.execute(sql, dict(params))
            return list(cur.fetchall())

    return run


def _execute_or_explain(
    conn: pymysql.connections.Connection[Any],
    database: str,
    statements: Sequence[tuple[str, str]],
    *,
    doing: str,
    verb: str,
    refused: str,
    privileges: str,
    or_instead: str | None = None,
) -> None:
    """Run DDL this user may lack the rights for: ``statements`` are (table, statement),
    each run under :func:`_bounded_ddl` (``verb`` names its wait), in order.

    A refusal is raised again as ``"{refused}: {the server's reason}. GRANT {privileges}
    ON database TO this user, {or_instead}, or have an admin run: {the statements}"``,
    as :func:`dbtrigger.cdc.pg_connection.execute_or_explain` words it for PostgreSQL:
    the GRANT names the account the server sees, asked for only once refused.

    Raises:
        SourcePermissionError: the user may not run them (with the GRANT and the SQL).
    """
    try:
        for table, statement in statements:
            with translated(doing), _bounded_ddl(conn, database, table, verb) as cur:
                cur.execute(statement)
    except SourcePermissionError as exc:
        instead = f"{or_instead}, " if or_instead else ""
        raise SourcePermissionError(
            f"{refused}: {short_error(exc.__cause__ or exc)}. GRANT {privileges} ON "
            f"`{database}`.* TO {current_user(conn)}, {instead}or have an admin run: "
            + "; ".join(statement for _, statement in statements),
            **exc.fields,
        ) from exc


def create_sql(database: str) -> list[str]:
    return [
        f"CREATE TABLE IF NOT EXISTS `{database}`.`{TABLE}` ("
        "reader VARCHAR(64) NOT NULL PRIMARY KEY, poller VARCHAR(255) NULL, "
        "server_id BIGINT NOT NULL, tables_json TEXT NOT NULL, "
        "created_file VARCHAR(255) NULL, created_pos BIGINT NULL, "
        "columns_json LONGTEXT NOT NULL, snapshots_json LONGTEXT NOT NULL, "
        "through_after VARCHAR(255) NULL, through_file VARCHAR(255) NULL, "
        "through_pos BIGINT NULL, schema_break TEXT NULL, "
        "created_mark VARCHAR(64) NULL, through_mark VARCHAR(64) NULL, generation BIGINT NULL, "
        "created_gtid VARCHAR(1024) NULL, through_gtid VARCHAR(1024) NULL, "
        "created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), "
        "updated_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE=InnoDB",
        f"CREATE TABLE IF NOT EXISTS `{database}`.`{CHUNKS}` ("
        "reader VARCHAR(64) NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, "
        "payload LONGTEXT NOT NULL) ENGINE=InnoDB",
    ]


def exists(conn: pymysql.connections.Connection[Any], database: str) -> bool:
    with translated("looking for the control table"), conn.cursor() as cur:
        cur.execute(
            "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
            "AND TABLE_NAME IN (%s, %s)",
            (database, TABLE, CHUNKS),
        )
        row = cur.fetchone()
    return bool(row and int(row[0]) == 2)


def ensure(conn: pymysql.connections.Connection[Any], database: str) -> bool:
    """Create the control tables if missing; True when they were created.

    Raises:
        SourcePermissionError: the user may not create them (with the GRANT to run).
    """
    if exists(conn, database):
        upgrade(conn, database)
        return False
    _execute_or_explain(
        conn,
        database,
        list(zip((TABLE, CHUNKS), create_sql(database), strict=True)),
        doing="creating the control tables",
        verb="creating",
        refused=f"cannot create {database}.{TABLE} (where BinlogSource keeps its position, "
        "accepted columns and snapshot progress)",
        privileges="CREATE, SELECT, INSERT, UPDATE, DELETE",
        or_instead="pass control_database= naming one it may use",
    )
    return True


#: Columns added to the control table after it was first made: a table an earlier
#: version created gets them in place (NULL: a mark not recorded, nothing checked).
ADDED_COLUMNS = {
    "created_mark": "VARCHAR(64) NULL",
    "through_mark": "VARCHAR(64) NULL",
    "generation": "BIGINT NULL",
    "created_gtid": "VARCHAR(1024) NULL",
    "through_gtid": "VARCHAR(1024) NULL",
}


def upgrade_sql(conn: pymysql.connections.Connection[Any], database: str) -> str | None:
    """The ``ALTER TABLE`` an existing control table needs (None: it has every column)."""
    with translated("reading the control table's columns"), conn.cursor() as cur:
        cur.execute(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s "
            "AND TABLE_NAME = %s",
            (database, TABLE),
        )
        have = {str(r[0]).lower() for r in cur.fetchall()}
    missing = [f"ADD COLUMN {c} {t}" for c, t in ADDED_COLUMNS.items() if c not in have]
    return f"ALTER TABLE `{database}`.`{TABLE}` {', '.join(missing)}" if missing else None


def upgrade(conn: pymysql.connections.Connection[Any], database: str) -> None:
    """Add the columns a control table made by an earlier version lacks.

    Raises:
        SourcePermissionError: the user may not alter it (with the statement to run).
    """
    statement = upgrade_sql(conn, database)
    if statement is None:
        return
    _execute_or_explain(
        conn,
        database,
        [(TABLE, statement)],
        doing="adding columns to the control table",
        verb="adding columns to",
        refused=f"{database}.{TABLE} was made by an earlier version and lacks columns this one "
        "keeps there",
        privileges="ALTER",
    )


class Recorded(NamedTuple):
    """A position of the log a control row records (file None: none recorded)."""

    file: str | None
    pos: int
    #: The file's mark and the GTID state there (None: not recorded, not checked).
    mark: str | None
    gtid: str | None


@dataclass
class ControlRow:
    reader: str
    poller: str | None
    server_id: int
    tables: list[str]
    created_file: str | None
    created_pos: int | None
    columns: dict[str, dict[str, str]] = field(default_factory=dict)
    snapshots: list[Snapshot] = field(default_factory=list)
    through_after: str | None = None
    through_file: str | None = None
    through_pos: int | None = None
    #: A column type change the reader stopped at, in words (until accepted), or a
    #: watched table moved off its name (:func:`is_table_gone`; until passed).
    schema_break: str | None = None
    #: The mark (:func:`~dbtrigger.cdc.binlog_poll.file_mark`) of ``created_file``.
    created_mark: str | None = None
    #: The mark of ``through_file``.
    through_mark: str | None = None
    #: The reader's generation (:func:`next_generation`; None: made before generations,
    #: its positions carry none).
    generation: int | None = None
    #: MariaDB: the GTID state of the log at ``created_pos`` / ``through_pos`` (see
    #: :func:`gtid_at`; None: not known, not checked).
    created_gtid: str | None = None
    through_gtid: str | None = None

    def last_recorded(self) -> Recorded:
        """The read-through position when one is recorded, else where the reader was
        created: how far the log is known read, with what identifies it there."""
        if self.through_file is not None:
            return Recorded(
                self.through_file, self.through_pos or 0, self.through_mark, self.through_gtid
            )
        return Recorded(
            self.created_file, self.created_pos or 0, self.created_mark, self.created_gtid
        )


def read(
    conn: pymysql.connections.Connection[Any], database: str, reader: str, *, lock: bool = False
) -> ControlRow | None:
    columns = (
        "reader, poller, server_id, tables_json, created_file, created_pos, columns_json, "
        "snapshots_json, through_after, through_file, through_pos, schema_break, created_mark, "
        "through_mark, generation, created_gtid, through_gtid"
    )
    query = f"SELECT {columns} FROM `{database}`.`{TABLE}` WHERE reader = %s"  # noqa: S608
    if lock:
        query += " FOR UPDATE"
    try:
        with translated("reading the control table"), conn.cursor() as cur:
            cur.execute(query, (reader,))
            row = cur.fetchone()
    except DbTriggerError as exc:
        cause = exc.__cause__
        if isinstance(cause, pymysql.MySQLError) and cause.args and cause.args[0] == _NO_COLUMN:
            raise ConfigurationError(
                f"{database}.{TABLE} was made by an earlier version and lacks columns this one "
                "keeps there: run dbtrigger cdc install MODULE:TRIGGER --yes (it adds them; the "
                "readers' positions are kept), or have an admin run "
                f"{upgrade_sql(conn, database)}"
            ) from exc
        raise
    if row is None:
        return None
    return ControlRow(
        str(row[0]),
        row[1],
        int(row[2]),
        list(json.loads(row[3])),
        row[4],
        None if row[5] is None else int(row[5]),
        {t: dict(c) for t, c in json.loads(row[6]).items()},
        [Snapshot.from_json(s) for s in json.loads(row[7])],
        row[8],
        row[9],
        None if row[10] is None else int(row[10]),
        row[11],
        row[12],
        row[13],
        None if row[14] is None else int(row[14]),
        row[15],
        row[16],
    )


def read_installed(
    conn: pymysql.connections.Connection[Any], database: str, reader: str
) -> ControlRow | None:
    """The reader's row; None also while the control tables do not exist."""
    return read(conn, database, reader) if exists(conn, database) else None


def write(conn: pymysql.connections.Connection[Any], database: str, row: ControlRow) -> None:
    """Insert or replace the reader's row."""
    statement = (
        f"INSERT INTO `{database}`.`{TABLE}` (reader, poller, server_id, tables_json, "  # noqa: S608
        "created_file, created_pos, columns_json, snapshots_json, through_after, through_file, "
        "through_pos, created_mark, through_mark, generation, created_gtid, through_gtid) VALUES "
        "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON DUPLICATE KEY "
        "UPDATE poller = VALUES(poller), server_id = VALUES(server_id), "
        "tables_json = VALUES(tables_json), created_file = VALUES(created_file), "
        "created_pos = VALUES(created_pos), columns_json = VALUES(columns_json), "
        "snapshots_json = VALUES(snapshots_json), through_after = VALUES(through_after), "
        "through_file = VALUES(through_file), through_pos = VALUES(through_pos), "
        "created_mark = VALUES(created_mark), through_mark = VALUES(through_mark), "
        "generation = VALUES(generation), created_gtid = VALUES(created_gtid), "
        "through_gtid = VALUES(through_gtid), updated_at = CURRENT_TIMESTAMP(6)"
    )
    with translated("writing the control table"), conn.cursor() as cur:
        cur.execute(
            statement,
            (
                row.reader,
                row.poller,
                row.server_id,
                json.dumps(row.tables),
                row.created_file,
                row.created_pos,
                json.dumps(row.columns),
                json.dumps([s.to_json() for s in row.snapshots]),
                row.through_after,
                row.through_file,
                row.through_pos,
                row.created_mark,
                row.through_mark,
                row.generation,
                row.created_gtid,
                row.through_gtid,
            ),
        )


#: What :func:`gtid_at` returns where the server cannot say (MySQL: no BINLOG_GTID_POS).
UNKNOWN = "?"


def gtid_at(conn: pymysql.connections.Connection[Any], name: str, offset: int) -> str | None:
    """MariaDB's GTID state of the binary log at ``name``:``offset`` (``BINLOG_GTID_POS``,
    which reads the file up to there); ``''`` before any GTID, None where no event starts
    there (or the file is gone), :data:`UNKNOWN` on a server without the function.

    A file's mark (server id, creation second) is all its header says, so two resets
    within one second make files with one mark; what the log held before a recorded
    offset tells them apart (compared by :func:`same_gtid`).
    """
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (name, offset))
            row = cur.fetchone()
    except pymysql.MySQLError:
        return UNKNOWN
    return None if row is None or row[0] is None else str(row[0])


def same_gtid(recorded: str | None, found: str | None) -> bool:
    """Does the log hold, at an offset, the GTID state recorded there (every GTID of
    ``recorded`` among ``found``'s)? True when either is unknown."""
    if recorded is None or UNKNOWN in (recorded, found):
        return True
    if found is None:
        return False
    have = {g for g in found.split(",") if g}
    return all(g in have for g in recorded.split(",") if g)


def next_generation(previous: ControlRow | None, now: float) -> int:
    """A reader's generation when ``install`` or ``recreate`` starts it (microseconds of
    ``now``, and always past the one it replaces).

    Every commit token the reader writes starts with it
    (:func:`~dbtrigger.cdc.binlog_reader.commit_token`), so a checkpoint taken before a
    ``cdc recreate`` (after ``RESET MASTER``, say) is told from a position of the log
    read since, whose file names, offsets and GTIDs may repeat the old ones exactly,
    and sorts before every one of them.
    """
    generation = int(now * 1_000_000)
    if previous is not None and previous.generation is not None:
        generation = max(generation, previous.generation + 1)
    return generation


#: How the stop at a watched table moved off its name begins, as kept in ``schema_break``
#: (:func:`dbtrigger.cdc.binlog_ddl.refusal`): not a type change ``accept-schema`` accepts.
GONE_PREFIX = "watched table "


def is_table_gone(held: str | None) -> bool:
    """Is the recorded stop ``held`` one at a watched table moved off its name?"""
    return bool(held) and str(held).startswith(GONE_PREFIX)


_PLAIN = (
    "through_after",
    "through_file",
    "through_pos",
    "through_mark",
    "through_gtid",
    "schema_break",
)


def update(
    conn: pymysql.connections.Connection[Any], database: str, reader: str, **values: Any
) -> None:
    """Set some columns of the reader's row (``columns``/``snapshots`` as Python objects)."""
    sets: list[str] = []
    params: list[Any] = []
    for name, value in values.items():
        if name == "columns":
            sets.append("columns_json = %s")
            params.append(json.dumps(value))
        elif name == "snapshots":
            sets.append("snapshots_json = %s")
            params.append(json.dumps([s.to_json() for s in value]))
        elif name == "tables":
            sets.append("tables_json = %s")
            params.append(json.dumps(value))
        elif name in _PLAIN:
            sets.append(f"{name} = %s")
            params.append(value)
        else:
            raise ValueError(f"not a control column: {name}")
    statement = (
        f"UPDATE `{database}`.`{TABLE}` SET {', '.join(sets)}, "  # noqa: S608
        "updated_at = CURRENT_TIMESTAMP(6) WHERE reader = %s"
    )
    with translated("updating the control table"), conn.cursor() as cur:
        cur.execute(statement, [*params, reader])


def delete(conn: pymysql.connections.Connection[Any], database: str, reader: str) -> bool:
    if not exists(conn, database):
        return False
    with translated("removing the reader's control row"), conn.cursor() as cur:
        cur.execute(f"DELETE FROM `{database}`.`{CHUNKS}` WHERE reader = %s", (reader,))  # noqa: S608
        count = cur.execute(f"DELETE FROM `{database}`.`{TABLE}` WHERE reader = %s", (reader,))  # noqa: S608
    return bool(count)


__all__ = [
    "ADDED_COLUMNS",
    "CHUNKS",
    "GONE_PREFIX",
    "TABLE",
    "UNKNOWN",
    "ControlRow",
    "create_sql",
    "delete",
    "ensure",
    "exists",
    "gtid_at",
    "is_table_gone",
    "next_generation",
    "read",
    "read_installed",
    "same_gtid",
    "update",
    "upgrade",
    "upgrade_sql",
    "write",
]
