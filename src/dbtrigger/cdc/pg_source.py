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
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from dbtrigger import options as opt
from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_published as published
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.assembly import SchemaGuard
from dbtrigger.cdc.buffer import TransactionBuffer
from dbtrigger.cdc.log_source import SNAPSHOTS, LogReader, LogSource, log
from dbtrigger.cdc.pg_admin import PgAdmin
from dbtrigger.cdc.pg_connection import connect, translated
from dbtrigger.cdc.pg_health import SlotReporter, self_check
from dbtrigger.cdc.pg_poll import PollReader
from dbtrigger.cdc.pg_reader import Decoder, materialise
from dbtrigger.cdc.pg_snapshot import SnapshotWriter
from dbtrigger.cdc.pg_stream import StreamReader
from dbtrigger.cdc.pgoutput import lsn_text, parse_lsn
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cdc.snapshots import Snapshot
from dbtrigger.errors import ConfigurationError, SlotLostError, SourceDefinitionError
from dbtrigger.names import validate_sql_identifier
from dbtrigger.sources.base import SourceFinding

MODES = ("poll", "stream")
#: Statement timeout while setting up (catalog reads, creating slot and publication).
SETUP_TIMEOUT = 60.0


def _oid(type_oid: int) -> str:
    return f"OID {type_oid}"


class PgLogicalSource(LogSource):
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

    KIND = "pg_logical"
    OWN = "and slot"
    NAME_FIELDS = ("slot", "publication")
    materialise = staticmethod(materialise)

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
        super().__init__(
            url, "a PostgreSQL URL", snapshot, create, read_timeout_seconds, read_ahead,
            heartbeat_interval_seconds, snapshot_chunk_size, snapshot_lock_timeout_seconds,
        )  # fmt: skip
        self.backlog_step = opt.whole("backlog_step_mb", backlog_step_mb) * 1024 * 1024
        self.stream_wait = opt.seconds(  # 0: a fetch that found nothing returns at once
            "stream_wait_seconds", stream_wait_seconds, inclusive=True
        )
        self.tables = setup.parse_tables(tables)
        self._slot = setup.validate_slot_name(slot) if slot is not None else None
        self._publication = (
            setup.validate_slot_name(publication, "publication")
            if publication is not None
            else None
        )
        self.mode = mode
        self.control_schema = validate_sql_identifier(control_schema, "control_schema")
        self.failover = failover
        self.infos: Mapping[str, setup.TableInfo] = {}
        self.guard: SchemaGuard[int] = SchemaGuard({}, _oid)
        self._decoder: Decoder | None = None
        self.confirmed: int | None = None
        #: The furthest LSN the slot was let advance to, as recorded in the control row
        #: (None: not known, no check; see :mod:`dbtrigger.cdc.pg_control`).
        self.bound: int | None = None
        #: The control table has ``released_lsn`` (False: made by an earlier version).
        self.bounded = False
        self.snapshots = SnapshotWriter(self)
        self.health = SlotReporter(self)

    # --- identity ---------------------------------------------------------------------

    @property
    def slot(self) -> str:
        return self.poller_named(self._slot, "replication slot (slot=)", setup.default_name)

    @property
    def publication(self) -> str:
        if self._publication is not None:
            return self._publication
        if self._slot is not None and self.poller is None:
            return self._slot
        return self.slot

    @property
    def name(self) -> str:
        return "postgresql:" + ",".join(t.qualified for t in self.tables) + "+logical"

    def table_names(self) -> list[str]:
        return [t.qualified for t in self.tables]

    def identity(self) -> dict[str, Any]:
        """The slot and publication (not the mode: poll and stream read the same positions)."""
        return {"slot": self.slot, "publication": self.publication}

    def describe_names(self) -> dict[str, Any]:
        return {"slot": self.slot, "publication": self.publication}

    def describe_settings(self) -> dict[str, Any]:
        return {"mode": self.mode}

    # --- the connection and first use ---------------------------------------------------

    def open_connection(self) -> psycopg.Connection[Any]:
        conn = connect(self.url)
        self.set_timeout(conn, self.standing_timeout)
        return conn

    @property
    def standing_timeout(self) -> float:
        """The statement timeout of everything but the slot read itself.

        ``read_timeout_seconds`` bounds the decoding read, which is what a
        backlog makes slow; a short one (tuned to step through a backlog early)
        must not also cancel the quick catalog and heartbeat statements around
        it, which would fail the tick with an error that names neither.
        """
        return max(self.read_timeout, SETUP_TIMEOUT)

    def usable(self, conn: psycopg.Connection[Any]) -> bool:
        return not (conn.closed or conn.broken)

    @staticmethod
    def set_timeout(conn: psycopg.Connection[Any], seconds: float) -> None:
        with translated("setting the statement timeout"):
            conn.execute(f"SET statement_timeout = {int(seconds * 1000)}")

    def set_up(self, after: LogPosition | None) -> None:
        """Check the server, find (or create) publication, slot and control row.

        Raises:
            SlotLostError: the slot is gone while a checkpoint exists, or invalidated.
        """
        conn = self.connection()
        # Setting up is quick but must not fail under a read timeout tuned for peeks.
        self.set_timeout(conn, self.standing_timeout)
        # One worker of a poller at a time: two that both found no slot would both create
        # publication and slot, and the second one's "already exists" stopped it.
        key = f"dbtrigger_cdc:{self.slot}"
        with translated("waiting for another worker of this poller to set up"):
            conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (key,))
        try:
            self._set_up(conn, after)
        finally:
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (key,))

    def _set_up(self, conn: psycopg.Connection[Any], after: LogPosition | None) -> None:
        facts = setup.server_facts(conn)
        setup.check_server(facts, stream=self.mode == "stream")
        self.infos = setup.table_infos(conn, self.tables)
        state = setup.slot_state(conn, self.slot)
        if state is None and after is not None:
            raise SlotLostError(
                f"replication slot {self.slot} does not exist, but poller "
                f"{self.poller or '(this source)'} has a checkpoint at {after}: the changes "
                "since then can no longer be read. Recreate the slot and read the tables "
                "again: dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
                poller=self.poller,
            )
        if state is None and control.read_installed(conn, self.control_schema, self.slot):
            raise SlotLostError(  # created earlier (its control row says so), then dropped
                f"replication slot {self.slot} does not exist, but it was created for this "
                f"poller ({self.control_schema}.{control.TABLE} has its row) and may have held "
                "changes not yet delivered. Recreate it and read the tables again: "
                "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes (or, to start afresh, "
                "dbtrigger cdc drop MODULE:TRIGGER --yes)",
                poller=self.poller,
            )
        if state is not None:
            setup.check_slot_plugin(state, self.url.database)
            self.check_not_lost(state)
        self.bound, self.bounded = None, False
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
        row = self.read_control(conn)
        if state is None:
            created = setup.create_slot(conn, self.slot, failover=self.failover)
            row = self.new_control_row(created)
            self.write_control(conn, row)
            log.info(
                "created replication slot %s at %s (publication %s%s)",
                self.slot,
                lsn_text(created),
                self.publication,
                ", snapshot queued" if self.snapshot == "initial" else "",
                extra={"event": "cdc_slot_created", "slot": self.slot, "poller": self.poller},
            )
        else:
            if row is not None:  # a table the slot was publishing must still be published
                known = [t for t in self.tables if t.qualified in row.tables]
                published.check_still_published(conn, self.publication, known, poller=self.poller)
            setup.ensure_publication(conn, self.publication, self.tables, create=self.create)
            if row is None:
                # No row: a slot made elsewhere, or ours from a first start that failed
                # before writing it. Without a checkpoint nothing was read from it yet, so
                # the initial snapshot is still owed (duplicates at worst, never the backlog
                # left out).
                row = self.new_control_row(state.confirmed_flush, snapshots=after is None)
                row.created_lsn = None  # not created by this source: where it was is unknown
                self.write_control(conn, row)
        assert row is not None  # noqa: S101 - written just above when missing
        self.accept(row.columns)
        self.confirmed = None if state is None else state.confirmed_flush
        self.adopt_bound(conn, row)

    def adopt_bound(self, conn: psycopg.Connection[Any], row: control.ControlRow) -> None:
        """Take the control row's release bound and check the slot against it; a row
        without one (written by an earlier version) is given the slot's position now."""
        self.bounded = row.bounded
        if not row.bounded:
            log.warning(
                "%s.%s has no released_lsn column (made by an earlier dbtrigger): a slot "
                "created again by hand under the name %s would not be noticed. Run "
                "dbtrigger cdc install MODULE:TRIGGER --yes (or: %s)",
                self.control_schema,
                control.TABLE,
                self.slot,
                control.add_bound_sql(self.control_schema).as_string(conn),
                extra={"event": "cdc_bound_unrecorded", "poller": self.poller},
            )
            return
        if row.released_lsn is not None:
            self.bound = parse_lsn(row.released_lsn)
            self.check_identity(conn, self.confirmed)
        elif self.confirmed is not None:
            self.raise_bound(conn, self.confirmed)

    def raise_bound(self, conn: psycopg.Connection[Any], lsn: int) -> None:
        """Record, before the slot is advanced to ``lsn``, that it may be (see
        :mod:`dbtrigger.cdc.pg_control`); nothing to write when the bound is there already."""
        if not self.bounded or (self.bound is not None and lsn <= self.bound):
            return
        if control.save_bound(conn, self.control_schema, self.slot, lsn_text(lsn)):
            self.bound = lsn

    def check_identity(self, conn: psycopg.Connection[Any], confirmed: int | None) -> None:
        """Refuse a slot whose confirmed position is past every position this poller let it
        advance to: it is not the slot the poller was reading (see the module docstring of
        :mod:`dbtrigger.cdc.pg_control`).

        Raises:
            SlotLostError: the slot was dropped and created again (or moved on by hand).
        """
        if self.bound is None or confirmed is None or confirmed <= self.bound:
            return
        row = self.read_control(conn)  # another worker of this poller may have moved it on
        if row is not None and row.released_lsn is not None:
            self.bound = max(self.bound, parse_lsn(row.released_lsn))
        if confirmed <= self.bound:
            return
        raise SlotLostError(
            f"replication slot {self.slot} starts at {lsn_text(confirmed)}, past "
            f"{lsn_text(self.bound)}, the furthest poller {self.poller or '(this source)'} "
            "ever let it advance: it was dropped and created again by hand (or advanced by "
            "something else), and the changes committed in between were never in it. "
            "Recreate it and read the tables again: dbtrigger cdc recreate MODULE:TRIGGER "
            "--snapshot --yes",
            poller=self.poller,
        )

    def accept(self, columns: dict[str, dict[str, int]]) -> None:
        """Read on with these accepted columns (a new decoder, which checks against them)."""
        self.guard = SchemaGuard(columns, _oid)
        self._decoder = Decoder(self.infos, self.guard, slot=self.slot)

    def new_control_row(self, created: int | None, *, snapshots: bool = True) -> control.ControlRow:
        columns = {
            q: {name: oid for name, (oid, _) in info.columns.items()}
            for q, info in self.infos.items()
        }
        return control.ControlRow(
            self.slot,
            self.poller,
            [t.qualified for t in self.tables],
            None if created is None else lsn_text(created),
            columns,
            self.initial_requests(self.table_names(), snapshots=snapshots),
            None if created is None else lsn_text(created),
        )

    def read_control(
        self, conn: psycopg.Connection[Any], *, lock: bool = False
    ) -> control.ControlRow | None:
        """The slot's control row (``lock``: FOR UPDATE, in the caller's transaction)."""
        return control.read(conn, self.control_schema, self.slot, lock=lock)

    def write_control(self, conn: psycopg.Connection[Any], row: control.ControlRow) -> None:
        """Insert or replace the slot's control row."""
        control.write(conn, self.control_schema, row)

    def save_snapshots(self, conn: psycopg.Connection[Any], snapshots: list[Snapshot]) -> None:
        control.save_snapshots(conn, self.control_schema, self.slot, snapshots)

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

    def lost_slot(self) -> SlotLostError | None:
        """After a read failed: the error to raise if the slot is why (dropped or invalidated
        while this poller ran), else None (also when the server cannot tell now)."""
        try:
            state = setup.slot_state(self.connection(), self.slot)
        except Exception:  # noqa: BLE001 - the read's own error is raised instead
            return None
        if state is None:
            return SlotLostError(
                f"replication slot {self.slot} was dropped while poller "
                f"{self.poller or '(this source)'} read it: the changes it held after the "
                "checkpoint can no longer be read. Recreate it and read the tables again: "
                "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
                poller=self.poller,
            )
        try:
            self.check_not_lost(state)
        except SlotLostError as exc:
            return exc
        return None

    def check_published(self, conn: psycopg.Connection[Any]) -> None:
        """Before each read: every watched table is still in the publication (else refused,
        and set up again at the next read: a table created again has new columns; the
        snapshot the error asks for is looked for at once)."""
        try:
            published.check_still_published(
                conn,
                self.publication,
                self.tables,
                poller=self.poller,
                oids={q: info.oid for q, info in self.infos.items()},
                unfinished=lambda: {
                    r.table for r in getattr(self.read_control(conn), "snapshots", []) if not r.done
                },
            )
        except SourceDefinitionError:
            self._ready = False
            self.drop_reader()
            self.snapshots.poke()
            raise

    @property
    def decoder(self) -> Decoder:
        assert self._decoder is not None  # noqa: S101 - set by prepare()
        return self._decoder

    # --- reading ------------------------------------------------------------------------

    def new_reader(self) -> LogReader:
        return PollReader(self) if self.mode == "poll" else StreamReader(self)

    def schema_break_seen(
        self, after: LogPosition | None, limit: int, changes: list[Any]
    ) -> list[Any]:
        """Nothing left before the type change: was it accepted meanwhile in another process
        (``dbtrigger cdc accept-schema``)? Then read the log again with the new columns."""
        if changes:
            return changes
        row = self.read_control(self.connection())
        if row is None or row.columns == self.guard.accepted:
            return changes
        self.accept(row.columns)
        self.drop_reader()
        self.buffer = TransactionBuffer(materialise)
        self.schema_break = None
        self.log_reader().fill(after, limit)
        return self.buffer.take(after, limit)

    def save_columns(self, accepted: dict[str, dict[str, Any]]) -> None:
        control.save_columns(self.connection(), self.control_schema, self.slot, accepted)

    def release_failed(self, acked: LogPosition | None, exc: Exception) -> None:
        log.warning(
            "could not release the log of slot %s up to %s: %s (retried after the next commit; "
            "meanwhile the server keeps that WAL)",
            self.slot,
            acked,
            exc,
            extra={"event": "cdc_release_failed", "poller": self.poller},
        )

    def admin(self) -> PgAdmin:
        """What ``dbtrigger cdc`` uses to install, inspect and repair this source."""
        return PgAdmin(self)

    def self_check(self) -> list[SourceFinding]:
        """Server settings, tables, publication and slot, as ``dbtrigger check`` findings."""
        return self_check(self)


__all__ = ["MODES", "SNAPSHOTS", "PgLogicalSource"]
