"""``BinlogSource``: a MariaDB/MySQL table's every committed change, from the binary log.

The source reads the server's binary log as a replica does (the replication
protocol of the maintained ``mysql-replication`` package, pure Python over
PyMySQL) and hands the runtime changes in commit order, each at its
:class:`~dbtrigger.cdc.position.LogPosition`: the transaction's place in the
log (binlog file, offset, GTID) and the change's ordinal within it. The
checkpoint is the runtime's, written by CAS as for any source. Nothing on the
server waits for this reader (a binlog has no slot), so a crash at any point
redelivers from the checkpoint, never skips: a multi-row ``INSERT``,
``LOAD DATA`` or a large transaction killed mid-delivery resumes at the change
after the checkpoint, inside the transaction.

Because the binlog is written at commit, in commit order, this source is
lossless under late commits by construction: a transaction that began early
and committed late is simply later in the log (no visibility window needed).

What a user can hit is typed: :class:`~dbtrigger.errors.ServerSettingError`
(``log_bin``, ``binlog_format``, ``binlog_row_image``, MySQL's
``binlog_row_metadata``), :class:`~dbtrigger.errors.SourcePermissionError`
(``REPLICATION SLAVE``, ``REPLICATION CLIENT``, ``SELECT``; each with its
GRANT), :class:`~dbtrigger.errors.SlotLostError` (the binlog file the
checkpoint needs was purged, or the log was reset: ``dbtrigger cdc recreate
--snapshot``), :class:`~dbtrigger.errors.SchemaChangedError` (a column changed
type; ``dbtrigger cdc accept-schema``),
:class:`~dbtrigger.errors.SourceDefinitionError` (a watched table renamed away
or dropped: delivery stops before the statement, see
:mod:`dbtrigger.cdc.binlog_ddl`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import pymysql

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc import binlog_lookahead as lookahead
from dbtrigger.cdc import binlog_setup as setup
from dbtrigger.cdc.assembly import SchemaGuard
from dbtrigger.cdc.binlog_admin import BinlogAdmin
from dbtrigger.cdc.binlog_health import RetentionReporter, self_check
from dbtrigger.cdc.binlog_poll import BinlogPoller, file_mark
from dbtrigger.cdc.binlog_reader import Assembler, Where, materialise, type_name
from dbtrigger.cdc.binlog_setup import current_position
from dbtrigger.cdc.binlog_snapshot import SnapshotWriter, asked_after
from dbtrigger.cdc.log_source import SNAPSHOTS, LogReader, LogSource, log
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cdc.snapshots import Snapshot
from dbtrigger.cursor import Position
from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    FetchError,
    SlotLostError,
    SourceDefinitionError,
)
from dbtrigger.sources.base import SourceFinding

#: How long a worker waits for another worker of its poller to finish setting up.
SETUP_LOCK_SECONDS = 60.0


def _require_binlog_protocol() -> None:
    """The binlog protocol's module is imported at the first read; without it
    that read (every tick's) failed with a bare ModuleNotFoundError, which the
    runner can only call unexpected. Say it when the source is built."""
    try:
        found = importlib.util.find_spec("pymysqlreplication") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigurationError(
            "BinlogSource needs mysql-replication (the binary log protocol), which is not "
            'installed: pip install "dbtrigger[binlog]"'
        )


class BinlogSource(LogSource):
    """Every committed insert, update and delete of ``tables``, from the binary log.

    Args:
        url: the server (``mysql+pymysql://user:pw@host:3306/db``; ``%SETTING%``
            references are read at first use). The user needs ``REPLICATION
            SLAVE`` and ``REPLICATION CLIENT`` on ``*.*``, ``SELECT`` on the
            tables, and for the control tables ``CREATE, INSERT, UPDATE,
            DELETE`` on ``control_database`` (or let an admin run ``dbtrigger
            cdc install``).
        tables: the watched tables, ``database.table`` or ``table`` (the URL's database).
        server_id: this reader's replica id; unique among every replica and
            reader of the server (two with one id make the server drop the
            older connection). Default: derived from the poller's name.
        snapshot: ``initial`` reads the tables' existing rows into the log (in
            chunks, resumable) when the reader is created; ``never`` starts
            with the changes committed after that.
        create: create the control tables and row on first use (else refuse
            until ``dbtrigger cdc install`` created them).
        control_database: where ``dbtrigger_cdc_binlog`` and
            ``dbtrigger_cdc_chunks`` live (default: the URL's database).
        read_timeout_seconds: a read stops at the first transaction boundary
            after this long (the next read goes on from there).
        read_ahead: most changes one read keeps in memory for the batches that
            follow (a transaction larger than this is handed out in parts, the
            read going on inside it). 10,000 by default: a binlog change waits
            as Python values, about 300 bytes (twice a PostgreSQL change), and
            going on with a read costs next to nothing.
        heartbeat_interval_seconds: at most this often, how far the log was
            read with nothing for this poller is written to the control row
            (after a durable checkpoint), so a restart of a quiet table's
            poller resumes there (0: after every checkpoint).
        snapshot_chunk_size / snapshot_lock_timeout_seconds: rows per snapshot
            chunk, and how long a chunk waits for its row locks.
        reader: the reader's name in the control table (default: the poller's).
    """

    KIND = "binlog"
    OWN = "and server_id"
    NAME_FIELDS = ("reader", "server_id")
    materialise = staticmethod(materialise)

    def __init__(
        self,
        url: str,
        tables: Sequence[str],
        *,
        server_id: int | None = None,
        snapshot: str = "initial",
        create: bool = True,
        control_database: str | None = None,
        read_timeout_seconds: float = 30.0,
        read_ahead: int = 10_000,
        heartbeat_interval_seconds: float = 30.0,
        snapshot_chunk_size: int = 1000,
        snapshot_lock_timeout_seconds: float = 2.0,
        reader: str | None = None,
    ) -> None:
        _require_binlog_protocol()
        super().__init__(
            url, "a MariaDB/MySQL URL", snapshot, create, read_timeout_seconds, read_ahead,
            heartbeat_interval_seconds, snapshot_chunk_size, snapshot_lock_timeout_seconds,
        )  # fmt: skip
        self._table_texts = list(tables) if not isinstance(tables, str) else tables
        self._tables: list[setup.TableName] | None = None
        if not url.startswith("%"):
            self._tables = setup.parse_tables(self._table_texts, self.url.database)
        elif isinstance(tables, str) or not tables:
            raise ConfigurationError("tables= must be a non-empty list of table names")
        self._server_id = None if server_id is None else setup.validate_server_id(server_id)
        if reader is not None and not 0 < len(reader) <= 64:
            raise ConfigurationError("reader= must be 1 to 64 characters")
        self._reader = reader
        if control_database is not None:
            setup.TableName.parse(f"{control_database}.x", None)  # validates the name
        self._control_database = control_database
        self.facts: setup.ServerFacts = setup.ServerFacts("", False, "", "", None, 0, None, None)
        self.infos: dict[str, setup.TableInfo] = {}
        self.control_row: control.ControlRow | None = None
        self.guard: SchemaGuard[str] = SchemaGuard({}, type_name)
        self._assembler: Assembler | None = None
        self.snapshots = SnapshotWriter(self)
        self.health: RetentionReporter = RetentionReporter(self)

    # --- identity ---------------------------------------------------------------------

    @property
    def tables(self) -> list[setup.TableName]:
        if self._tables is None:
            self._tables = setup.parse_tables(self._table_texts, self.url.database)
        return self._tables

    @property
    def schemas(self) -> list[str]:
        return sorted({t.database for t in self.tables} | {self.control_database})

    @property
    def control_database(self) -> str:
        database = self._control_database or self.url.database
        if not database:
            raise ConfigurationError(
                "BinlogSource: the URL names no database; pass control_database= (where the "
                "reader's control tables live)"
            )
        return database

    @property
    def reader(self) -> str:
        return self.poller_named(self._reader, "reader (reader=)", setup.default_reader_name)

    @property
    def server_id(self) -> int:
        if self._server_id is not None:
            return self._server_id
        return setup.default_server_id(self.reader)

    @property
    def name(self) -> str:
        return "mysql:" + ",".join(t.qualified for t in self.tables) + "+binlog"

    def table_names(self) -> list[str]:
        return [t.qualified for t in self.tables]

    def identity(self) -> dict[str, Any]:
        """The reader (not ``server_id``: a new id reads the same log)."""
        return {"reader": self.reader}

    def describe_names(self) -> dict[str, Any]:
        return {"reader": self.reader, "server_id": self.server_id}

    def describe_settings(self) -> dict[str, Any]:
        return {}

    def facts_expire_text(self) -> str:
        seconds = self.facts.expire_seconds
        return "0 (kept until purged by hand)" if not seconds else f"{seconds:g}"

    # --- the connection and first use ---------------------------------------------------

    def open_connection(self) -> pymysql.connections.Connection[Any]:
        return setup.connect(self.url, database=False)

    def usable(self, conn: pymysql.connections.Connection[Any]) -> bool:
        return bool(conn.open)

    def set_up(self, after: LogPosition | None) -> None:
        """Check the server and tables, find (or create) the control row.

        Raises:
            ServerSettingError / SourcePermissionError / SlotLostError: see the module docstring.
        """
        conn = self.connection()
        # One worker of a poller at a time: two that both found no control row each wrote
        # their own start, and each read from its own.
        key = f"dbtrigger_cdc:{self.reader}"[:64]
        waiting = "waiting for another worker of this poller to set up"
        with setup.translated(waiting), conn.cursor() as cur:
            cur.execute("SELECT GET_LOCK(%s, %s)", (key, int(SETUP_LOCK_SECONDS)))
            locked = cur.fetchone()
        if not locked or locked[0] != 1:
            raise FetchError(
                f"reader {self.reader}: another worker of this poller has been setting up for "
                f"{SETUP_LOCK_SECONDS:g}s; the next tick tries again",
                poller=self.poller,
            )
        try:
            self._set_up(conn, after)
        finally:
            with contextlib.suppress(pymysql.MySQLError), conn.cursor() as cur:
                cur.execute("SELECT RELEASE_LOCK(%s)", (key,))

    def _set_up(self, conn: pymysql.connections.Connection[Any], after: LogPosition | None) -> None:
        facts = setup.server_facts(conn)
        setup.check_server(facts)
        if facts.server_id == self.server_id:
            raise ConfigurationError(
                f"server_id {self.server_id} is the server's own server_id: give BinlogSource "
                "another one (server_id=)"
            )
        self.facts = facts
        files = setup.binary_logs(conn)  # REPLICATION CLIENT, checked before anything else
        self.infos = self._table_infos(conn, after)
        if self.create:
            control.ensure(conn, self.control_database)
        elif not control.exists(conn, self.control_database):
            raise ConfigurationError(
                f"the control tables of reader {self.reader} do not exist and create=False: run "
                "dbtrigger cdc install MODULE:TRIGGER --yes first"
            )
        elif (upgrade := control.upgrade_sql(conn, self.control_database)) is not None:
            raise ConfigurationError(
                f"the control table of reader {self.reader} was made by an earlier version and "
                f"create=False: run dbtrigger cdc install MODULE:TRIGGER --yes, or {upgrade}"
            )
        row = self.read_control(conn)
        if row is None:
            if not self.create:
                raise ConfigurationError(
                    f"reader {self.reader} is not installed and create=False: run dbtrigger "
                    "cdc install MODULE:TRIGGER --yes first"
                )
            start = current_position(conn, files) if after is None else resume_at(after, files)
            row = self.new_control_row(
                start,
                snapshots=after is None,
                mark=file_mark(self, start[0]),
                # Resumed at the checkpoint: its tokens go on as they were.
                generation=control.next_generation(None, time.time())
                if after is None
                else Where.parse(after.commit).generation,
            )
            row.created_gtid = control.gtid_at(conn, *start)
            self.write_control(conn, row)
            log.info(
                "binlog reader %s created at %s:%s (server_id %d%s)",
                self.reader,
                row.created_file,
                row.created_pos,
                self.server_id,
                ", snapshot queued" if row.snapshots else "",
                extra={"event": "cdc_reader_created", "poller": self.poller},
            )
        new_tables = [t for t in self.table_names() if t not in row.tables]
        if new_tables:  # tables= pointed at a renamed table: it reads on from the old name
            row.tables = [*row.tables, *new_tables]
            control.update(conn, self.control_database, self.reader, tables=row.tables)
        self.control_row = row
        self.guard = SchemaGuard(row.columns, type_name)
        self._assembler = Assembler(
            self.infos,
            self.guard,
            chunks_table=f"{self.control_database}.{control.CHUNKS}",
            reader=self.reader,
            names_from_log=facts.names_from_log,
            column_types=self._column_types,
            poller=self.poller,
            followed=frozenset(row.tables),
            exists=self._exists,
            acked=self._snapshot_asked,
            ahead=None if facts.names_from_log else self._lookahead(conn, files),
        )
        self.health.retention_warning(after, files)

    def _lookahead(
        self, conn: pymysql.connections.Connection[Any], files: Sequence[tuple[str, int]]
    ) -> lookahead.Lookahead:
        """Without names in the log: the readings of the catalog the reader names values
        by, the start's first (``self.infos``, read before this), and the log between
        them and the table maps (:mod:`~dbtrigger.cdc.binlog_lookahead`)."""
        end = lookahead.Mark.of(current_position(conn, files))  # after the catalog's reading
        tables = list(self.infos)
        ahead = lookahead.Lookahead(
            lookahead.Statements(
                lambda a, b: lookahead.read_statements(self.connection(), tables, a, b)
            ),
            self._reading,
        )
        for name, info in self.infos.items():
            ahead.readings[name] = [
                lookahead.Reading(info.names, dict(info.columns), end, info.key_columns)
            ]
        return ahead

    def _reading(self, table: str) -> lookahead.Reading | None:
        """``table``'s columns now, and where the log ends after they were read (None when
        they cannot be read: the reader keeps the readings it has)."""
        info = self._catalog_info(table)
        if info is None:
            return None
        with setup.translated("reading the binary log position"):
            end = current_position(self.connection(), ())
        types = dict(info.columns)
        return lookahead.Reading(tuple(types), types, lookahead.Mark.of(end), info.key_columns)

    def _table_infos(
        self, conn: pymysql.connections.Connection[Any], after: LogPosition | None
    ) -> dict[str, setup.TableInfo]:
        """The watched tables now; a missing one after a checkpoint says the way on."""
        try:
            return setup.table_infos(conn, self.tables)
        except SourceDefinitionError as exc:
            if after is None or "does not exist" not in str(exc):
                raise
            poller = self.poller or "POLLER"
            raise SourceDefinitionError(
                f"{exc}. If it was renamed or dropped after the checkpoint, nothing after the "
                "checkpoint is lost yet. Renamed: point tables= at its new name and accept the "
                f"changed source, dbtrigger reset {poller} --accept-source MODULE:TRIGGER "
                "--reason 'table renamed' --yes; the changes written before the rename are "
                "read under the new name, none skipped. Dropped: create it again (the drop is "
                "then a truncate event), or take it out of tables= and accept the changed source",
                poller=self.poller,
            ) from exc

    def replay_hint(self, position: Position) -> str | None:
        """Why a recorded range ending at ``position`` is not read again, when retention
        is not the reason: it is of an earlier reader generation (before ``cdc recreate``),
        which every read passes over."""
        where = LogPosition.of(position)
        row = self.control_row
        if where is None or row is None or row.generation is None:
            return None
        generation = Where.parse(where.commit).generation
        if generation is not None and generation >= row.generation:
            return None
        return (
            f"the reader was created again (dbtrigger cdc recreate) after this batch: its "
            f"positions are of reader generation {generation}, and reads go on from where "
            f"generation {row.generation} starts, so the batch cannot be read as it was "
            "(the history keeps its keys and image CRCs)"
        )

    def _column_types(self, table: str) -> dict[str, str] | None:
        """``table``'s column types now (None when they cannot be read: a read goes on)."""
        info = self._catalog_info(table)
        return None if info is None else dict(info.columns)

    def _catalog_info(self, table: str) -> setup.TableInfo | None:
        """``table``'s columns and primary key now (None when they cannot be read)."""
        database, _, name = table.partition(".")
        try:
            infos = setup.table_infos(self.connection(), [setup.TableName(database, name)])
        except (DbTriggerError, pymysql.MySQLError, OSError):
            return None
        return infos.get(table)

    def _exists(self, table: str) -> bool:
        """Is a table under the name ``table`` now (a watched one dropped in the log)?"""
        database, _, name = table.partition(".")
        with setup.translated(f"looking for table {table}"), self.connection().cursor() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s",
                (database, name),
            )
            found = cur.fetchone()
        return bool(found and int(found[0]))

    def _snapshot_asked(self, table: str, commit: str) -> bool:
        """Was a snapshot of ``table`` asked for (``cdc snapshot``) after the statement at
        ``commit`` was written (:func:`~dbtrigger.cdc.binlog_snapshot.asked_after`)? How a
        person chose to read a watched name on after a statement that put another table,
        or none, under it (:mod:`dbtrigger.cdc.binlog_ddl`)."""
        row = self.read_control(self.connection())
        return row is not None and asked_after(row.snapshots, table, commit)

    def new_control_row(
        self,
        position: tuple[str, int],
        *,
        snapshots: bool = True,
        mark: str | None = None,
        generation: int | None = None,
    ) -> control.ControlRow:
        """A reader's row starting at ``position``, in the binlog file whose mark is ``mark``
        (:func:`~dbtrigger.cdc.binlog_poll.file_mark`), of reader ``generation``
        (:func:`~dbtrigger.cdc.binlog_control.next_generation`)."""
        return control.ControlRow(
            self.reader,
            self.poller,
            self.server_id,
            [t.qualified for t in self.tables],
            position[0],
            position[1],
            {},
            self.initial_requests(self.table_names(), snapshots=snapshots),
            created_mark=mark,
            generation=generation,
        )

    def read_control(
        self, conn: pymysql.connections.Connection[Any], *, lock: bool = False
    ) -> control.ControlRow | None:
        """The reader's control row (``lock``: FOR UPDATE, in the caller's transaction)."""
        return control.read(conn, self.control_database, self.reader, lock=lock)

    def write_control(
        self, conn: pymysql.connections.Connection[Any], row: control.ControlRow
    ) -> None:
        """Insert or replace the reader's control row."""
        control.write(conn, self.control_database, row)

    def save_snapshots(
        self, conn: pymysql.connections.Connection[Any], snapshots: list[Snapshot]
    ) -> None:
        control.update(conn, self.control_database, self.reader, snapshots=snapshots)

    @property
    def assembler(self) -> Assembler:
        assert self._assembler is not None  # noqa: S101 - set by prepare()
        return self._assembler

    # --- reading ------------------------------------------------------------------------

    def new_reader(self) -> LogReader:
        return BinlogPoller(self)

    def schema_break_seen(
        self, after: LogPosition | None, limit: int, changes: list[Any]
    ) -> list[Any]:
        """Keep the type change in the control row for ``cdc status`` / ``accept-schema``."""
        brk, row = self.schema_break, self.control_row
        if brk is None or row is None or row.schema_break == brk.problem:
            return changes
        if brk.table_gone and changes:
            return changes  # recorded once delivery reaches it, not while it is ahead
        try:
            control.update(
                self.connection(), self.control_database, self.reader, schema_break=brk.problem
            )
            row.schema_break = brk.problem
        except Exception as exc:  # noqa: BLE001 - the error raised next says it anyway
            log.warning("could not record the schema change: %s", exc)
        return changes

    def read_on_seen(self) -> None:
        """A read found no stop: forget one at a watched table moved off its name (passed
        since: ``tables=`` pointed at the new name, the table created again, its
        snapshot asked for), so ``cdc status`` no longer shows it."""
        row = self.control_row
        if row is None or not control.is_table_gone(row.schema_break):
            return
        try:
            control.update(self.connection(), self.control_database, self.reader, schema_break=None)
            row.schema_break = None
        except Exception as exc:  # noqa: BLE001 - shown a little longer, tried again
            log.warning("could not clear the recorded stop: %s", exc)

    def save_columns(self, accepted: dict[str, dict[str, Any]]) -> None:
        control.update(self.connection(), self.control_database, self.reader, columns=accepted)

    def release_failed(self, acked: LogPosition | None, exc: Exception) -> None:
        log.warning(
            "could not record how far reader %s read the binary log: %s (retried after the "
            "next commit)",
            self.reader,
            exc,
            extra={"event": "cdc_release_failed", "poller": self.poller},
        )

    def close_parts(self) -> None:
        self.control_row = None

    def admin(self) -> BinlogAdmin:
        """What ``dbtrigger cdc`` uses to install, inspect and repair this source."""
        return BinlogAdmin(self)

    def self_check(self) -> list[SourceFinding]:
        """Server settings, privileges, tables and position, as ``dbtrigger check`` findings."""
        return self_check(self)


def resume_at(after: LogPosition, files: Sequence[tuple[str, int]]) -> tuple[str, int]:
    """Where a reader whose control row is gone (``cdc drop``, an emptied control table)
    starts again: at the checkpoint, which says where reading stopped. The server's
    position now would skip every change written since then without a word.

    Raises:
        SlotLostError: the checkpoint's binlog file is no longer on the server.
    """
    where = Where.parse(after.commit)
    by_index = {setup.file_index(name): name for name, _ in files}
    if where.file_index not in by_index:
        raise SlotLostError(
            f"the reader's control row is gone and the binary log file holding its checkpoint "
            f"{after} is no longer on the server, so the changes since then are gone. Start "
            "again from now and read the tables again: dbtrigger cdc recreate MODULE:TRIGGER "
            "--snapshot --yes"
        )
    return by_index[where.file_index], where.offset


__all__ = ["SNAPSHOTS", "BinlogSource", "current_position"]
