"""``PgLogicalSource``: a PostgreSQL table's every committed change, from the server's own log.

The source reads a replication slot (``pgoutput``) and hands the runtime
changes in commit order, each at its :class:`~dbtrigger.cdc.position.LogPosition`.
The checkpoint is the runtime's, written by CAS as for any source; the slot is
only *released* (advanced) after that checkpoint is durable, through the
:class:`~dbtrigger.sources.base.AcknowledgesCheckpoints` capability. A crash at
any point therefore redelivers, never skips: the slot still holds everything
after the last durable checkpoint, and the position (commit, ordinal) finds the
exact change inside a multi-row statement or a large transaction.

``mode="poll"`` (the default) reads with ``pg_logical_slot_peek_binary_changes``,
every read bounded three ways (:mod:`dbtrigger.cdc.pg_poll`): an end LSN taken
when it starts, a change count, and a statement timeout. ``mode="stream"``
holds a replication connection open (:mod:`dbtrigger.cdc.pg_stream`) and
confirms to the server only what was checkpointed.

What a user can hit is typed: :class:`~dbtrigger.errors.ServerSettingError`
(``wal_level``, slots), :class:`~dbtrigger.errors.SourcePermissionError` (the
``REPLICATION`` attribute, table ownership for the publication),
:class:`~dbtrigger.errors.SlotLostError` (the slot was dropped or invalidated:
never replaced silently), :class:`~dbtrigger.errors.DecodeBacklogError` (a read
that ran out of time; the next ones step forward in bounded windows) and
:class:`~dbtrigger.errors.SchemaChangedError` (a column changed type).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy.engine import URL

from dbtrigger import options as opt
from dbtrigger._engine import parse_database_url
from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.buffer import TransactionBuffer
from dbtrigger.cdc.changes import to_events
from dbtrigger.cdc.pg_connection import connect, translated
from dbtrigger.cdc.pg_reader import Decoder, SchemaBreak, SchemaGuard, materialise
from dbtrigger.cdc.pgoutput import lsn_text
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import Position, canonical_json
from dbtrigger.errors import (
    ConfigurationError,
    CorruptStateError,
    SchemaChangedError,
    SlotLostError,
)
from dbtrigger.events import RowChange
from dbtrigger.metrics import MetricsCollector
from dbtrigger.redaction import safe_url_text
from dbtrigger.sources.base import SourceFinding
from dbtrigger.sources.fingerprint import identity_url
from dbtrigger.sources.lag import LagReading, column_basis

if TYPE_CHECKING:
    from dbtrigger.cdc.pg_admin import PgAdmin

log = logging.getLogger("dbtrigger.cdc")

MODES = ("poll", "stream")
#: How ``lag_seconds`` is measured: the commit time of the oldest undelivered change.
LAG_BASIS = column_basis("commit_time")
#: Statement timeout while setting up (catalog reads, creating slot and publication).
SETUP_TIMEOUT = 60.0
SNAPSHOTS = ("initial", "never")


class PgLogicalSource:
    """Every committed insert, update and delete of ``tables``, from logical decoding.

    Args:
        url: the database (SQLAlchemy form, ``postgresql://user:pw@host/db``;
            ``%SETTING%`` references are read at first use). The role needs the
            ``REPLICATION`` attribute; creating the publication needs ownership
            of the tables (or let an owner run ``dbtrigger cdc install``).
        tables: the watched tables, ``schema.table`` or ``table`` (``public``).
        slot / publication: names of the replication slot and publication;
            default ``dbtrigger_<poller>`` (the poller this source is given to).
        mode: ``poll`` (bounded peeks, the default) or ``stream`` (a
            replication connection; needs ``psycopg2``: ``pip install
            dbtrigger[cdc]``).
        snapshot: ``initial`` reads the tables' existing rows into the log
            (in chunks, resumable) when the slot is created; ``never`` starts
            with the changes made after the slot's creation.
        create: create publication, slot and control table on first use (else
            refuse until ``dbtrigger cdc install`` created them).
        control_schema: where ``dbtrigger_cdc_slots`` lives (:mod:`dbtrigger.cdc.pg_control`).
        read_timeout_seconds: statement timeout of one read; a read that needs
            longer raises :class:`~dbtrigger.errors.DecodeBacklogError` and the
            next ones step through the backlog in windows.
        read_ahead: most changes one read keeps in memory for the batches that
            follow (a transaction larger than this is read in parts).
        backlog_step_mb: the first window, in MB of WAL, when stepping.
        heartbeat_interval_seconds: a logical message is written at most this
            often, before a read, so a quiet publication on a busy server still
            has somewhere to advance to (0: never).
        snapshot_chunk_size / snapshot_lock_timeout_seconds: rows per snapshot
            chunk, and how long a chunk waits for its brief ``SHARE`` lock.
        failover: create the slot with ``failover`` (PostgreSQL 17+), so it is
            synchronised to standbys and survives a failover.
        stream_wait_seconds: stream mode: how long a fetch that found nothing
            waits for the first change to arrive (latency in milliseconds instead
            of the worker's polling interval; 0: return at once).
    """

    def __init__(
        self,
        url: str,
        tables: Sequence[str],
        *,
        slot: str | None = None,
        publication: str | None = None,
        mode: str = "poll",
        snapshot: str = "initial",
        create: bool = True,
        control_schema: str = "public",
        read_timeout_seconds: float = 30.0,
        read_ahead: int = 50_000,
        backlog_step_mb: int = 64,
        heartbeat_interval_seconds: float = 5.0,
        snapshot_chunk_size: int = 1000,
        snapshot_lock_timeout_seconds: float = 2.0,
        failover: bool = False,
        stream_wait_seconds: float = 1.0,
    ) -> None:
        if mode not in MODES:
            raise ConfigurationError(f"mode must be one of {MODES}, got {mode!r}")
        if snapshot not in SNAPSHOTS:
            raise ConfigurationError(f"snapshot must be one of {SNAPSHOTS}, got {snapshot!r}")
        read_timeout_seconds = opt.seconds("read_timeout_seconds", read_timeout_seconds)
        read_ahead = opt.whole("read_ahead", read_ahead)
        backlog_step_mb = opt.whole("backlog_step_mb", backlog_step_mb)
        heartbeat_interval_seconds = opt.seconds(  # 0: no heartbeat message
            "heartbeat_interval_seconds", heartbeat_interval_seconds, inclusive=True
        )
        snapshot_chunk_size = opt.whole("snapshot_chunk_size", snapshot_chunk_size)
        snapshot_lock_timeout_seconds = opt.seconds(
            "snapshot_lock_timeout_seconds", snapshot_lock_timeout_seconds
        )
        stream_wait_seconds = opt.seconds(  # 0: a fetch that found nothing returns at once
            "stream_wait_seconds", stream_wait_seconds, inclusive=True
        )
        if not isinstance(url, str) or not url:
            raise ConfigurationError("PgLogicalSource needs url= (a PostgreSQL URL)")
        self._url_text = url
        self._url: URL | None = None
        self.tables = setup.parse_tables(tables)
        self._slot = setup.validate_slot_name(slot) if slot is not None else None
        self._publication = (
            setup.validate_slot_name(publication, "publication")
            if publication is not None
            else None
        )
        self.mode = mode
        self.snapshot = snapshot
        self.create = create
        from dbtrigger.names import validate_sql_identifier  # noqa: PLC0415

        self.control_schema = validate_sql_identifier(control_schema, "control_schema")
        self.read_timeout = read_timeout_seconds
        self.read_ahead = read_ahead
        self.backlog_step = backlog_step_mb * 1024 * 1024
        self.heartbeat_interval = heartbeat_interval_seconds
        self.snapshot_chunk_size = snapshot_chunk_size
        self.snapshot_lock_timeout = snapshot_lock_timeout_seconds
        self.failover = failover
        self.stream_wait = stream_wait_seconds
        self.poller: str | None = None
        self.metrics: MetricsCollector | None = None
        self._lock = threading.RLock()
        self._conn: psycopg.Connection[Any] | None = None
        self._ready = False
        self._infos: dict[str, setup.TableInfo] = {}
        self._guard = SchemaGuard({})
        self._decoder: Decoder | None = None
        self.buffer: TransactionBuffer[Any] = TransactionBuffer(materialise)
        self.confirmed: int | None = None
        self.acked: LogPosition | None = None
        #: Where a column changed type (set by the reader; delivery stops there).
        self.schema_break: SchemaBreak | None = None
        self._reader: Any = None  # the mode's reader (pg_poll.PollReader / pg_stream.StreamReader)
        from dbtrigger.cdc.pg_health import HealthReporter  # noqa: PLC0415 - psycopg on use
        from dbtrigger.cdc.pg_snapshot import SnapshotWriter  # noqa: PLC0415

        self.snapshots = SnapshotWriter(self)
        self.health = HealthReporter(self)

    # --- identity ---------------------------------------------------------------------

    def bind_poller(self, name: str, metrics: MetricsCollector | None = None) -> None:
        """Named after the poller it serves (slot and publication default to its name)."""
        if self.poller is not None and self.poller != name:
            raise ConfigurationError(
                f"this PgLogicalSource already serves poller {self.poller!r}; a slot is one "
                f"position, so poller {name!r} needs a source (and slot) of its own"
            )
        self.poller = name
        self.metrics = metrics

    @property
    def slot(self) -> str:
        if self._slot is not None:
            return self._slot
        if self.poller is None:
            raise ConfigurationError(
                "PgLogicalSource: name the replication slot (slot=) or give the source to a "
                "PollTrigger, whose name it then takes"
            )
        return setup.default_name(self.poller)

    @property
    def publication(self) -> str:
        if self._publication is not None:
            return self._publication
        if self._slot is not None and self.poller is None:
            return self._slot
        return self.slot

    @property
    def url(self) -> URL:
        if self._url is None:
            self._url = parse_database_url(self._url_text, "PgLogicalSource url")
        return self._url

    @property
    def name(self) -> str:
        return "postgresql:" + ",".join(t.qualified for t in self.tables) + "+logical"

    def fingerprint(self) -> str:
        """What a stored position means: this database's log, these tables, this slot.

        Not the mode (poll and stream read the same positions), nor how the
        server is reached (see :mod:`dbtrigger.sources.fingerprint`).
        """
        definition = {
            "fingerprint_version": 1,
            "kind": "pg_logical",
            "source": identity_url(self.url),
            "tables": sorted(t.qualified for t in self.tables),
            "slot": self.slot,
            "publication": self.publication,
        }
        return "sha256:" + hashlib.sha256(canonical_json(definition).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        url: str | None = None
        try:
            url = safe_url_text(self.url)
        except ConfigurationError:
            url = self._url_text if self._url_text.startswith("%") else None
        slot: str | None = None
        publication: str | None = None
        with contextlib.suppress(ConfigurationError):  # no poller yet: no names yet
            slot, publication = self.slot, self.publication
        return {
            "name": self.name,
            "kind": "pg_logical",
            "url": url,
            "tables": [t.qualified for t in self.tables],
            "slot": slot,
            "publication": publication,
            "mode": self.mode,
            "snapshot": self.snapshot,
            "read_timeout_seconds": self.read_timeout,
            "read_ahead": self.read_ahead,
        }

    # --- the connection and first use ---------------------------------------------------

    def connection(self) -> psycopg.Connection[Any]:
        """The source's session (opened on first use, reopened after a failure)."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            conn = connect(self.url)
            self.set_timeout(conn, self.read_timeout)
            self._conn = conn
        return conn

    def drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def prepare(self, after: LogPosition | None) -> None:
        """Check the server, find (or create) publication, slot and control row.

        Runs once per process (again after :meth:`close`).

        Raises:
            SlotLostError: the slot is gone while a checkpoint exists, or invalidated.
        """
        if self._ready:
            return
        conn = self.connection()
        # Setting up is quick but must not fail under a read timeout tuned for peeks.
        self.set_timeout(conn, max(self.read_timeout, SETUP_TIMEOUT))
        try:
            self._prepare(conn, after)
        finally:
            if not conn.closed:
                self.set_timeout(conn, self.read_timeout)

    @staticmethod
    def set_timeout(conn: psycopg.Connection[Any], seconds: float) -> None:
        with translated("setting the statement timeout"):
            conn.execute(f"SET statement_timeout = {int(seconds * 1000)}")

    def _prepare(self, conn: psycopg.Connection[Any], after: LogPosition | None) -> None:
        facts = setup.server_facts(conn)
        setup.check_server(facts, stream=self.mode == "stream")
        self._infos = setup.table_infos(conn, self.tables)
        state = setup.slot_state(conn, self.slot)
        if state is None and after is not None:
            raise SlotLostError(
                f"replication slot {self.slot} does not exist, but poller "
                f"{self.poller or '(this source)'} has a checkpoint at {after}: the changes "
                "since then can no longer be read. Recreate the slot and read the tables "
                "again: dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
                poller=self.poller,
            )
        if state is not None:
            setup.check_slot_plugin(state, self.url.database)
            self.check_not_lost(state)
        if state is None and not self.create:
            raise ConfigurationError(
                f"replication slot {self.slot} does not exist and create=False: run "
                "dbtrigger cdc install MODULE:TRIGGER --yes first"
            )
        if state is None:
            setup.check_server(facts, stream=self.mode == "stream", new_slot=True)
            setup.ensure_publication(conn, self.publication, self.tables, create=True)
        if self.create:
            control.ensure(conn, self.control_schema)
        row = control.read(conn, self.control_schema, self.slot)
        if state is None:
            created = setup.create_slot(conn, self.slot, failover=self.failover)
            row = self.new_control_row(created)
            control.write(conn, self.control_schema, row)
            log.info(
                "created replication slot %s at %s (publication %s%s)",
                self.slot,
                lsn_text(created),
                self.publication,
                ", snapshot queued" if self.snapshot == "initial" else "",
                extra={"event": "cdc_slot_created", "slot": self.slot, "poller": self.poller},
            )
        else:
            setup.ensure_publication(conn, self.publication, self.tables, create=self.create)
            if row is None:
                row = self.new_control_row(None, snapshots=False)
                control.write(conn, self.control_schema, row)
        assert row is not None  # noqa: S101 - written just above when missing
        self._guard = SchemaGuard(row.columns)
        self._decoder = Decoder(
            self._infos, self._guard, slot=self.slot, on_truncate=self.truncated
        )
        self.confirmed = None if state is None else state.confirmed_flush
        self._ready = True

    def new_control_row(self, created: int | None, *, snapshots: bool = True) -> control.ControlRow:
        columns = {
            q: {name: oid for name, (oid, _) in info.columns.items()}
            for q, info in self._infos.items()
        }
        requests = (
            [control.Snapshot(t.qualified) for t in self.tables]
            if snapshots and self.snapshot == "initial"
            else []
        )
        return control.ControlRow(
            self.slot,
            self.poller,
            [t.qualified for t in self.tables],
            None if created is None else lsn_text(created),
            columns,
            requests,
        )

    def check_not_lost(self, state: setup.SlotState) -> None:
        if state.lost:
            why = state.invalidation or f"wal_status {state.wal_status}"
            raise SlotLostError(
                f"replication slot {self.slot} was invalidated ({why}): the server removed WAL "
                "it still needed (max_slot_wal_keep_size), so changes since the checkpoint are "
                "gone. Recreate it and read the tables again: dbtrigger cdc recreate "
                "MODULE:TRIGGER --snapshot --yes",
                poller=self.poller,
            )

    def truncated(self, table: str, lsn: int) -> None:
        log.warning(
            "TRUNCATE of %s at %s: its rows are gone without a delete event each; "
            "consumers holding copies must be told another way",
            table,
            lsn_text(lsn),
            extra={"event": "cdc_truncate", "table": table, "poller": self.poller},
        )

    @property
    def lock(self) -> threading.RLock:
        """Held while the buffer is read or changed (fetch, acknowledge, the stream thread)."""
        return self._lock

    @property
    def guard(self) -> SchemaGuard:
        return self._guard

    @property
    def decoder(self) -> Decoder:
        assert self._decoder is not None  # noqa: S101 - set by prepare()
        return self._decoder

    @property
    def infos(self) -> Mapping[str, setup.TableInfo]:
        return self._infos

    def reload_accepted(self) -> bool:
        """Take up columns accepted elsewhere (``dbtrigger cdc accept-schema`` in another
        process); True when they changed and the log is to be read again."""
        row = control.read(self.connection(), self.control_schema, self.slot)
        if row is None or row.columns == self._guard.accepted:
            return False
        self._guard = SchemaGuard(row.columns)
        self._decoder = Decoder(
            self._infos, self._guard, slot=self.slot, on_truncate=self.truncated
        )
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        self.buffer = TransactionBuffer(materialise)
        self.schema_break = None
        return True

    def save_added_columns(self) -> None:
        """Persist columns first seen in the log (best effort: re-learnt if lost)."""
        if not self._guard.added:
            return
        self._guard.added = False
        try:
            control.save_columns(
                self.connection(), self.control_schema, self.slot, self._guard.accepted
            )
        except Exception as exc:  # noqa: BLE001 - a column list re-learnt next time
            log.warning("could not save the accepted columns: %s", exc)

    # --- the port ---------------------------------------------------------------------

    def _mode_reader(self) -> Any:
        if self._reader is None:
            if self.mode == "poll":
                from dbtrigger.cdc.pg_poll import PollReader  # noqa: PLC0415

                self._reader = PollReader(self)
            else:
                from dbtrigger.cdc.pg_stream import StreamReader  # noqa: PLC0415

                self._reader = StreamReader(self)
        return self._reader

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        """Up to ``limit`` changes after ``after``, in commit order (see the module docstring)."""
        if limit < 1:
            raise ConfigurationError(f"limit must be at least 1, got {limit}")
        position = LogPosition.of(after)
        with self._lock:
            self.prepare(position)
            reader = self._mode_reader()
            if not self.buffer.covers(position) or self.buffer.pending(position) < limit:
                reader.fill(position, limit)
            changes = self.buffer.take(position, limit)
            if not changes and self.schema_break is not None and self.reload_accepted():
                reader = self._mode_reader()  # accepted meanwhile (dbtrigger cdc accept-schema)
                reader.fill(position, limit)
                changes = self.buffer.take(position, limit)
            self.save_added_columns()
            self.health.maybe_report()
            brk = self.schema_break
            if not changes and brk is not None:
                raise SchemaChangedError(
                    f"{brk.problem} (in the transaction committed at {brk.commit}); events of "
                    "the new shape are held back. Check the consumers, then accept it: "
                    "dbtrigger cdc accept-schema MODULE:TRIGGER --yes",
                    poller=self.poller,
                )
            return changes

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        return to_events(rows, poller=poller, batch_id=batch_id, source=self.name)

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """``lag_seconds``: the age of the oldest change read but not delivered past ``after``.

        Measured from what the last read holds (no query): 0 when it was
        complete and nothing is pending, None when it cannot tell.
        """
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
        """How long ago a change was committed (its commit time in the log)."""
        committed = row.get("commit_time")
        if not isinstance(committed, dt.datetime):
            return LagReading(None, LAG_BASIS)
        return LagReading(max(0.0, (now - committed).total_seconds()), LAG_BASIS)

    def acknowledge(self, position: Position) -> None:
        """``position`` is durably checkpointed: release the log up to it (never raises)."""
        acked = LogPosition.of(position)
        with self._lock:
            if not self._ready:
                return
            try:
                self._mode_reader().release(acked)
            except Exception as exc:  # noqa: BLE001 - the checkpoint stands; retried next commit
                log.warning(
                    "could not release the log of slot %s up to %s: %s (retried after the "
                    "next commit; meanwhile the server keeps that WAL)",
                    self.slot,
                    acked,
                    exc,
                    extra={"event": "cdc_release_failed", "poller": self.poller},
                )
                self.drop_connection()

    def admin(self) -> PgAdmin:
        """What ``dbtrigger cdc`` uses to install, inspect and repair this source."""
        from dbtrigger.cdc.pg_admin import PgAdmin  # noqa: PLC0415

        return PgAdmin(self)

    def self_check(self) -> list[SourceFinding]:
        """Server settings, tables, publication and slot, as ``dbtrigger check`` findings."""
        from dbtrigger.cdc.pg_health import self_check  # noqa: PLC0415

        return self_check(self)

    def close(self) -> None:
        with self._lock:
            reader, self._reader = self._reader, None
            if reader is not None:
                reader.close()
            self.drop_connection()
            self._ready = False
            self.buffer = TransactionBuffer(materialise)
            self.schema_break = None
            self.snapshots.poke()  # requests are looked for again at the next read


__all__ = ["MODES", "SNAPSHOTS", "PgLogicalSource"]
