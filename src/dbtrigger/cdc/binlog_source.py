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
type; ``dbtrigger cdc accept-schema``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pymysql
from sqlalchemy.engine import URL

from dbtrigger import options as opt
from dbtrigger._engine import parse_database_url
from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc import binlog_setup as setup
from dbtrigger.cdc.binlog_reader import Assembler, SchemaBreak, SchemaGuard, materialise
from dbtrigger.cdc.buffer import TransactionBuffer
from dbtrigger.cdc.changes import to_events
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import Position, canonical_json
from dbtrigger.errors import (
    ConfigurationError,
    CorruptStateError,
    SchemaChangedError,
)
from dbtrigger.events import RowChange
from dbtrigger.metrics import MetricsCollector
from dbtrigger.redaction import safe_url_text
from dbtrigger.sources.base import SourceFinding
from dbtrigger.sources.fingerprint import identity_url
from dbtrigger.sources.lag import LagReading, column_basis

if TYPE_CHECKING:
    from dbtrigger.cdc.binlog_admin import BinlogAdmin
    from dbtrigger.cdc.binlog_poll import BinlogPoller

log = logging.getLogger("dbtrigger.cdc")

SNAPSHOTS = ("initial", "never")
LAG_BASIS = column_basis("commit_time")


class BinlogSource:
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
            follow (a transaction larger than this is read in parts).
        heartbeat_interval_seconds: at most this often, how far the log was
            read with nothing for this poller is written to the control row
            (after a durable checkpoint), so a restart of a quiet table's
            poller resumes there (0: after every checkpoint).
        snapshot_chunk_size / snapshot_lock_timeout_seconds: rows per snapshot
            chunk, and how long a chunk waits for its row locks.
        reader: the reader's name in the control table (default: the poller's).
    """

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
        read_ahead: int = 50_000,
        heartbeat_interval_seconds: float = 30.0,
        snapshot_chunk_size: int = 1000,
        snapshot_lock_timeout_seconds: float = 2.0,
        reader: str | None = None,
    ) -> None:
        if snapshot not in SNAPSHOTS:
            raise ConfigurationError(f"snapshot must be one of {SNAPSHOTS}, got {snapshot!r}")
        read_timeout_seconds = opt.seconds("read_timeout_seconds", read_timeout_seconds)
        read_ahead = opt.whole("read_ahead", read_ahead)
        heartbeat_interval_seconds = opt.seconds(
            "heartbeat_interval_seconds", heartbeat_interval_seconds, inclusive=True
        )
        snapshot_chunk_size = opt.whole("snapshot_chunk_size", snapshot_chunk_size)
        snapshot_lock_timeout_seconds = opt.seconds(
            "snapshot_lock_timeout_seconds", snapshot_lock_timeout_seconds
        )
        if not isinstance(url, str) or not url:
            raise ConfigurationError("BinlogSource needs url= (a MariaDB/MySQL URL)")
        self._url_text = url
        self._url: URL | None = None
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
        self.snapshot = snapshot
        self.create = create
        if control_database is not None:
            setup.TableName.parse(f"{control_database}.x", None)  # validates the name
        self._control_database = control_database
        self.read_timeout = read_timeout_seconds
        self.read_ahead = read_ahead
        self.heartbeat_interval = heartbeat_interval_seconds
        self.snapshot_chunk_size = snapshot_chunk_size
        self.snapshot_lock_timeout = snapshot_lock_timeout_seconds
        self.poller: str | None = None
        self.metrics: MetricsCollector | None = None
        self._lock = threading.RLock()
        self._conn: pymysql.connections.Connection[Any] | None = None
        self._ready = False
        self.facts: setup.ServerFacts = setup.ServerFacts("", False, "", "", None, 0, None, None)
        self.infos: dict[str, setup.TableInfo] = {}
        self.control_row: control.ControlRow | None = None
        self.guard = SchemaGuard({})
        self._assembler: Assembler | None = None
        self.buffer: TransactionBuffer[Any] = TransactionBuffer(materialise)
        self.acked: LogPosition | None = None
        self.schema_break: SchemaBreak | None = None
        self._poller_impl: BinlogPoller | None = None
        from dbtrigger.cdc.binlog_health import HealthReporter  # noqa: PLC0415
        from dbtrigger.cdc.binlog_snapshot import SnapshotWriter  # noqa: PLC0415

        self.snapshots = SnapshotWriter(self)
        self.health = HealthReporter(self)

    # --- identity ---------------------------------------------------------------------

    def bind_poller(self, name: str, metrics: MetricsCollector | None = None) -> None:
        """Named after the poller it serves (reader name and default server_id)."""
        if self.poller is not None and self.poller != name:
            raise ConfigurationError(
                f"this BinlogSource already serves poller {self.poller!r}; poller {name!r} "
                "needs a source (and server_id) of its own"
            )
        self.poller = name
        self.metrics = metrics

    @property
    def url(self) -> URL:
        if self._url is None:
            self._url = parse_database_url(self._url_text, "BinlogSource url")
        return self._url

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
        if self._reader is not None:
            return self._reader
        if self.poller is None:
            raise ConfigurationError(
                "BinlogSource: name the reader (reader=) or give the source to a PollTrigger, "
                "whose name it then takes"
            )
        return setup.default_reader_name(self.poller)

    @property
    def server_id(self) -> int:
        if self._server_id is not None:
            return self._server_id
        return setup.default_server_id(self.reader)

    @property
    def name(self) -> str:
        return "mysql:" + ",".join(t.qualified for t in self.tables) + "+binlog"

    def fingerprint(self) -> str:
        """What a stored position means: this server's log, these tables, this reader.

        Not ``server_id`` (a new id reads the same log), nor how the server is reached.
        """
        definition = {
            "fingerprint_version": 1,
            "kind": "binlog",
            "source": identity_url(self.url),
            "tables": sorted(t.qualified for t in self.tables),
            "reader": self.reader,
        }
        return "sha256:" + hashlib.sha256(canonical_json(definition).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        url: str | None = None
        try:
            url = safe_url_text(self.url)
        except ConfigurationError:
            url = self._url_text if self._url_text.startswith("%") else None
        reader: str | None = None
        server_id: int | None = None
        with contextlib.suppress(ConfigurationError):  # no poller yet: no names yet
            reader, server_id = self.reader, self.server_id
        return {
            "name": self.name,
            "kind": "binlog",
            "url": url,
            "tables": [t.qualified for t in self.tables],
            "reader": reader,
            "server_id": server_id,
            "snapshot": self.snapshot,
            "read_timeout_seconds": self.read_timeout,
            "read_ahead": self.read_ahead,
        }

    def facts_expire_text(self) -> str:
        seconds = self.facts.expire_seconds
        return "0 (kept until purged by hand)" if not seconds else f"{seconds:g}"

    # --- the connection and first use ---------------------------------------------------

    def connection(self) -> pymysql.connections.Connection[Any]:
        """The source's session (opened on first use, reopened after a failure)."""
        conn = self._conn
        if conn is None or not conn.open:
            conn = setup.connect(self.url, database=False)
            self._conn = conn
        return conn

    def drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def prepare(self, after: LogPosition | None) -> None:
        """Check the server and tables, find (or create) the control row. Once per process.

        Raises:
            ServerSettingError / SourcePermissionError / SlotLostError: see the module docstring.
        """
        if self._ready:
            return
        try:
            self._prepare(after)
        except Exception:
            self.drop_connection()
            raise

    def _prepare(self, after: LogPosition | None) -> None:
        conn = self.connection()
        facts = setup.server_facts(conn)
        setup.check_server(facts)
        if facts.server_id == self.server_id:
            raise ConfigurationError(
                f"server_id {self.server_id} is the server's own server_id: give BinlogSource "
                "another one (server_id=)"
            )
        self.facts = facts
        files = setup.binary_logs(conn)  # REPLICATION CLIENT, checked before anything else
        self.infos = setup.table_infos(conn, self.tables)
        if self.create:
            control.ensure(conn, self.control_database)
        elif not control.exists(conn, self.control_database):
            raise ConfigurationError(
                f"the control tables of reader {self.reader} do not exist and create=False: run "
                "dbtrigger cdc install MODULE:TRIGGER --yes first"
            )
        row = control.read(conn, self.control_database, self.reader)
        if row is None:
            if not self.create:
                raise ConfigurationError(
                    f"reader {self.reader} is not installed and create=False: run dbtrigger "
                    "cdc install MODULE:TRIGGER --yes first"
                )
            row = self.new_control_row(current_position(conn, files), snapshots=after is None)
            control.write(conn, self.control_database, row)
            log.info(
                "binlog reader %s created at %s:%s (server_id %d%s)",
                self.reader,
                row.created_file,
                row.created_pos,
                self.server_id,
                ", snapshot queued" if row.snapshots else "",
                extra={"event": "cdc_reader_created", "poller": self.poller},
            )
        self.control_row = row
        self.guard = SchemaGuard(row.columns)
        self._assembler = Assembler(
            self.infos,
            self.guard,
            chunks_table=f"{self.control_database}.{control.CHUNKS}",
            reader=self.reader,
            names_from_log=facts.names_from_log,
            on_truncate=self.truncated,
        )
        self._ready = True
        self.health.retention_warning(after, files)

    def new_control_row(
        self, position: tuple[str, int], *, snapshots: bool = True
    ) -> control.ControlRow:
        requests = (
            [control.Snapshot(t.qualified) for t in self.tables]
            if snapshots and self.snapshot == "initial"
            else []
        )
        return control.ControlRow(
            self.reader,
            self.poller,
            self.server_id,
            [t.qualified for t in self.tables],
            position[0],
            position[1],
            {},
            requests,
        )

    def truncated(self, table: str, commit: str) -> None:
        log.warning(
            "TRUNCATE of %s at %s: its rows are gone without a delete event each; "
            "consumers holding copies must be told another way",
            table,
            commit,
            extra={"event": "cdc_truncate", "table": table, "poller": self.poller},
        )

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def assembler(self) -> Assembler:
        assert self._assembler is not None  # noqa: S101 - set by prepare()
        return self._assembler

    def save_added_columns(self) -> None:
        """Persist columns first seen in the log (best effort: re-learnt if lost)."""
        if not self.guard.added:
            return
        self.guard.added = False
        try:
            control.update(
                self.connection(), self.control_database, self.reader, columns=self.guard.accepted
            )
        except Exception as exc:  # noqa: BLE001 - a column list re-learnt next time
            log.warning("could not save the accepted columns: %s", exc)

    # --- the port ---------------------------------------------------------------------

    def _reader_impl(self) -> BinlogPoller:
        if self._poller_impl is None:
            from dbtrigger.cdc.binlog_poll import BinlogPoller  # noqa: PLC0415

            self._poller_impl = BinlogPoller(self)
        return self._poller_impl

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        """Up to ``limit`` changes after ``after``, in commit order (see the module docstring)."""
        if limit < 1:
            raise ConfigurationError(f"limit must be at least 1, got {limit}")
        position = LogPosition.of(after)
        with self._lock:
            self.prepare(position)
            if not self.buffer.covers(position) or self.buffer.pending(position) < limit:
                self._reader_impl().fill(position, limit)
            changes = self.buffer.take(position, limit)
            self.save_added_columns()
            self.health.maybe_report(position)
            brk = self.schema_break
            if brk is not None:
                self.record_break(brk)
            if not changes and brk is not None:
                raise SchemaChangedError(
                    f"{brk.problem} (in the transaction at {brk.commit}); events of the new "
                    "shape are held back. Check the consumers, then accept it: dbtrigger cdc "
                    "accept-schema MODULE:TRIGGER --yes",
                    poller=self.poller,
                )
            return changes

    def record_break(self, brk: SchemaBreak) -> None:
        """Keep the type change in the control row for ``cdc status`` / ``accept-schema``."""
        row = self.control_row
        if row is None or row.schema_break == brk.problem:
            return
        try:
            control.update(
                self.connection(), self.control_database, self.reader, schema_break=brk.problem
            )
            row.schema_break = brk.problem
        except Exception as exc:  # noqa: BLE001 - the error raised next says it anyway
            log.warning("could not record the schema change: %s", exc)

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        return to_events(rows, poller=poller, batch_id=batch_id, source=self.name)

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """``lag_seconds``: the age of the oldest change read but not delivered past ``after``."""
        try:
            position = LogPosition.of(after)
        except CorruptStateError:
            return None
        with self._lock:
            buffer = self.buffer
            if not buffer.covers(position):
                return None
            pending = buffer.take(position, 1)
            if not pending:
                return LagReading(0.0, LAG_BASIS) if buffer.complete else None
            return self.row_age(pending[0], now)

    def row_age(self, row: Mapping[str, Any], now: dt.datetime) -> LagReading:
        """How long ago a change was committed (its event time in the log, whole seconds)."""
        committed = row.get("commit_time")
        if not isinstance(committed, dt.datetime):
            return LagReading(None, LAG_BASIS)
        return LagReading(max(0.0, (now - committed).total_seconds()), LAG_BASIS)

    def acknowledge(self, position: Position) -> None:
        """``position`` is durably checkpointed: forget what it passed (never raises)."""
        acked = LogPosition.of(position)
        with self._lock:
            if not self._ready:
                return
            if acked is not None and (self.acked is None or acked > self.acked):
                self.acked = acked
            try:
                self._reader_impl().release(acked)
            except Exception as exc:  # noqa: BLE001 - the checkpoint stands; retried next commit
                log.warning(
                    "could not record how far reader %s read the binary log: %s (retried "
                    "after the next commit)",
                    self.reader,
                    exc,
                    extra={"event": "cdc_release_failed", "poller": self.poller},
                )
                self.drop_connection()

    def admin(self) -> BinlogAdmin:
        """What ``dbtrigger cdc`` uses to install, inspect and repair this source."""
        from dbtrigger.cdc.binlog_admin import BinlogAdmin  # noqa: PLC0415

        return BinlogAdmin(self)

    def self_check(self) -> list[SourceFinding]:
        """Server settings, privileges, tables and position, as ``dbtrigger check`` findings."""
        from dbtrigger.cdc.binlog_health import self_check  # noqa: PLC0415

        return self_check(self)

    def close(self) -> None:
        with self._lock:
            self._poller_impl = None
            self.drop_connection()
            self._ready = False
            self.buffer = TransactionBuffer(materialise)
            self.schema_break = None
            self.control_row = None
            self.snapshots.poke()


def current_position(
    conn: pymysql.connections.Connection[Any], files: Sequence[tuple[str, int]]
) -> tuple[str, int]:
    """Where the server writes its next transaction (``SHOW MASTER STATUS``)."""
    for statement in ("SHOW MASTER STATUS", "SHOW BINARY LOG STATUS"):
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
                row = cur.fetchone()
        except pymysql.MySQLError:
            continue
        if row:
            return str(row[0]), int(row[1])
    if files:
        return files[-1]
    raise ConfigurationError("the server reports no binary log position (is log_bin on?)")


__all__ = ["SNAPSHOTS", "BinlogSource", "current_position"]
