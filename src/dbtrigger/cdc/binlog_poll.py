"""Reading the binary log in bounded reads, and remembering how far it held nothing for us.

One read (:meth:`BinlogPoller.fill`) is a non-blocking binlog dump: the server
sends what its log holds from a file and offset, then says "end of log". It is
bounded three ways, like a PostgreSQL peek: by the end of the log when it
runs, by a change count (``read_ahead``; the read stops inside a transaction
if it must, holding its dump there, and the next read goes on with the rest of
it), and by ``read_timeout_seconds``
(the read then stops at the next transaction boundary: it is still a read of
whole transactions, just a shorter one).

Where a read starts:

* the buffer (:class:`~dbtrigger.cdc.buffer.TransactionBuffer`) is kept
  between reads; a read that follows one which ended at a transaction boundary
  continues at the offset where that one ended, and appends;
* otherwise (a new process, a checkpoint behind what the buffer holds, a read
  that stopped inside a transaction) it starts at the checkpoint's
  transaction, skipping the changes of it already delivered, and checks that
  the log there still holds that transaction (its GTID);
* a poller with no checkpoint starts where the reader was created (the control
  row), so nothing committed since ``install`` is missed;
* and when the control row says the log was read through to some offset with
  nothing after this very checkpoint (**read-through**), from there.

**Which log.** A file name and offset name a place in *a* log, not in this
server's log as it is now: after ``RESET MASTER`` (or ``RESET BINARY LOGS AND
GTIDS``) the server starts again at ``...000001``, and a restored server or a
promoted replica writes files of the same names holding other transactions. A
checkpoint's position carries its transaction's GTID, checked where the read
starts. The control row's two positions (created, read-through) carry the
**mark** of their file instead (:func:`file_mark`: the server id and creation
second of the file's format description event, which every dump sends before
the first event it reads): a read starting at one of them checks it before it
reads a change, and a file that is not the one the position was recorded in
is a :class:`~dbtrigger.errors.SlotLostError` (``cdc recreate --snapshot``),
never a read from that offset, which would skip what the new file holds before
it, start inside an event, or wait beyond the file's end. It costs nothing per
read: the dump sends that event anyway. Two resets within one second give
files one mark: on MariaDB the GTID state at the position is recorded too and
checked where a read starts at a recorded position (``BINLOG_GTID_POS``).

A checkpoint beyond the end of the log (its file number past the newest, or
its offset past its file's end) is in a log that was reset; when the control
row's start is in this log (its mark checked as above: ``cdc recreate`` after
the reset wrote it) the reader goes on from there, as after any recreate.

Read-through is written behind durable checkpoints only (:meth:`release`),
at most every ``heartbeat_interval_seconds``: the binlog's counterpart of
advancing a slot. A quiet table on a busy server then resumes near the end of
the log after a restart instead of re-reading hours of other tables' changes,
and its retention check measures from there. The write is itself a small row
in the log, the reader's heartbeat.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pymysql

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_reader import Assembler, Where, commit_token
from dbtrigger.cdc.binlog_setup import (
    beyond_end,
    binary_logs,
    connect_kwargs,
    current_user,
    default_server_id,
    event_mark,
    file_index,
    mark_text,
    replica_connect,
    replication_refused,
)
from dbtrigger.cdc.buffer import Transaction, TransactionBuffer
from dbtrigger.cdc.position import LogPosition
from dbtrigger.errors import DbTriggerError, FetchError, SlotLostError, SourcePermissionError
from dbtrigger.sources.errors_map import source_error

if TYPE_CHECKING:
    from dbtrigger.cdc.binlog_context import BinlogSourceParts

log = logging.getLogger("dbtrigger.cdc")

#: Server error: the dump cannot start at the position asked for.
ER_MASTER_FATAL_READING_BINLOG = 1236


#: How every read dumps the log: to its end and no further (``blocking`` off), from a
#: file and offset (COM_BINLOG_DUMP, on MariaDB too: the library's MariaDB path dumps by
#: GTID state and ignores log_file/log_pos), over our PyMySQL connections.
DUMP_OPTIONS: dict[str, Any] = {
    "blocking": False, "resume_stream": True, "is_mariadb": False,
    "enable_logging": False, "pymysql_wrapper": replica_connect,
}  # fmt: skip


@dataclass
class _ReadState:
    """Where one read is in the log."""

    file: str
    index: int
    #: End of the last event read: where the next one starts.
    last_end: int
    #: The last transaction boundary (None: the read stopped inside a transaction).
    boundary: tuple[str, int] | None
    #: The first transaction was checked against the one the read expected there.
    checked: bool
    #: The mark the start file must have (None: checked already, or nothing to check).
    want_mark: str | None = None
    #: The mark of ``file`` (None until its format description event is read).
    mark: str | None = None
    #: The GTID of the last transaction begun, and of the last one before ``boundary``.
    gtid: str | None = None
    boundary_gtid: str | None = None


@dataclass
class _Dump:
    """One binlog dump (its connections) and where it is in the log."""

    stream: Any
    state: _ReadState

    def close(self) -> None:
        self.stream.close()


class BinlogPoller:
    """Fills the source's buffer by bounded binlog dumps (see the module docstring)."""

    def __init__(self, source: BinlogSourceParts) -> None:
        self.source = source
        #: (file name, offset, its file's mark) where the last read ended at a transaction
        #: boundary.
        self.continue_from: tuple[str, int, str | None] | None = None
        #: The GTID state the log holds at ``continue_from`` (as far as this reader knows).
        self.continue_gtid: str | None = None
        self._seed_gtid: str | None = None
        self._last_through_write = 0.0
        self._through_written: tuple[str, str, int] | None = None
        #: A dump stopped inside a transaction for want of room (see :meth:`_dump`).
        self._held: _Dump | None = None

    # --- where to start --------------------------------------------------------------------

    def start_for(self, after: LogPosition | None) -> tuple[str, int, str | None, str | None]:
        """(file, offset, commit expected first, mark of the file) for a read of what
        follows ``after``.

        Raises:
            SlotLostError: the file the read must start in is no longer on the server.
        """
        s = self.source
        row = s.control_row
        files = binary_logs(s.connection())
        sizes = dict(files)
        by_index = {file_index(name): name for name, _ in files}
        key = "-" if after is None else after.text
        if row is not None and row.through_after == key and row.through_file in sizes:
            assert row.through_pos is not None  # noqa: S101 - written together
            self.check_gtid(row.through_file, row.through_pos, row.through_gtid)
            return row.through_file, row.through_pos, None, row.through_mark
        if row is None or row.created_file is None or row.created_pos is None:
            raise SlotLostError(
                f"reader {s.reader} has no recorded start position; run dbtrigger cdc "
                "install MODULE:TRIGGER --yes",
                poller=s.poller,
            )
        created = (file_index(row.created_file), row.created_pos)
        where = None if after is None else Where.parse(after.commit)
        if where is not None and where.generation != row.generation:
            self.check_generation(where, row.generation)
            where = None  # a checkpoint of the log before cdc recreate: go on from the new start
        if where is None or created > (where.file_index, where.offset):
            # No checkpoint yet, or the reader was recreated after it (cdc recreate): the
            # operator chose to go on from the new start.
            name, offset, expect = row.created_file, row.created_pos, None
            index, mark = created[0], row.created_mark
            if name in sizes:
                self.check_gtid(name, offset, row.created_gtid)
        else:
            self._seed_gtid = None
            index, offset = where.file_index, where.offset
            expect = None if after is None else after.commit
            name, mark = by_index.get(index, ""), None
        if beyond_end(files, index, offset):
            raise self.reset_error(
                f"poller {s.poller or s.reader}'s position (file #{index}, offset {offset}) is "
                f"beyond the end of the server's binary log (newest file: {files[-1][0]})"
            )
        if index not in by_index:
            oldest = files[0][0] if files else "(none)"
            raise SlotLostError(
                f"the binary log file holding poller {s.poller or s.reader}'s position "
                f"(file #{index}, offset {offset}) was purged by the server (oldest kept: "
                f"{oldest}; binlog_expire_logs_seconds={s.facts_expire_text()}), so the changes "
                "since then are gone. Start again from now and read the tables again: "
                "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
                poller=s.poller,
            )
        return name, offset, expect, mark

    def check_gtid(self, name: str, offset: int, recorded: str | None) -> None:
        """MariaDB: the log holds at ``name``:``offset`` the GTID state recorded with the
        position (a file of another reset within the same second has the same mark).

        Raises:
            SlotLostError: it does not.
        """
        self._seed_gtid = recorded
        s = self.source
        if recorded is None or not s.facts.mariadb:
            return
        found = control.gtid_at(s.connection(), name, offset)
        if not control.same_gtid(recorded, found):
            raise self.reset_error(
                f"the binary log at {name}:{offset} is not where poller {s.poller or s.reader}'s "
                f"position was recorded (the log held GTID {recorded or '(none)'} there, it "
                f"holds {found or 'no event boundary'} now)"
            )

    @property
    def generation(self) -> int | None:
        """The reader's generation, the first part of every commit token it writes."""
        row = self.source.control_row
        return None if row is None else row.generation

    def check_generation(self, where: Where, generation: int | None) -> None:
        """A checkpoint of another reader generation than the control row's: one taken
        before ``cdc recreate`` (older, or written before generations) is passed over;
        a newer one means the control row is older than the checkpoint (restored from a
        backup, written by hand), and nothing says where to read.

        Raises:
            SlotLostError: the checkpoint is of a later generation than the control row.
        """
        if generation is not None and (where.generation is None or where.generation < generation):
            return
        s = self.source
        raise SlotLostError(
            f"poller {s.poller or s.reader}'s checkpoint was written by reader generation "
            f"{where.generation}, but the control row of reader {s.reader} is of generation "
            f"{generation} (older: restored or written by hand?), so where its changes "
            "continue cannot be told. Start again and read the tables again: dbtrigger cdc "
            "recreate MODULE:TRIGGER --snapshot --yes",
            poller=s.poller,
        )

    # --- reading -----------------------------------------------------------------------------

    def fill(self, after: LogPosition | None, limit: int) -> None:
        s = self.source
        buffer = s.buffer
        keep = max(s.read_ahead, limit)
        held, self._held = self._held, None
        if held is not None and buffer.covers(after):
            try:
                s.assembler.more(max(1, keep - buffer.pending(after)))
                self._dump(held, after, None)
                return
            except Exception as exc:  # noqa: BLE001 - read again from the checkpoint below
                log.debug("the held binlog dump could not go on (%s): reading again", exc)
        elif held is not None:
            held.close()
        if buffer.covers(after) and self.continue_from is not None:
            name, offset, mark = self.continue_from
            self._seed_gtid = self.continue_gtid
            expect = None
            room = max(1, keep - buffer.pending(after))
        else:
            name, offset, expect, mark = self.start_for(after)
            buffer.reset(after)
            self.continue_from = None
            room = keep
        if buffer.pending(after) == 0:
            s.snapshots.emit()  # caught up: a chunk written now is in this very read
        self.read(name, offset, after, room, expect, mark)
        if s.assembler.renames.found:  # a followed table's rename found: read again
            self.fill(after, limit)

    def read(
        self,
        name: str,
        offset: int,
        after: LogPosition | None,
        room: int,
        expect: str | None,
        mark: str | None = None,
    ) -> None:
        from pymysqlreplication import BinLogStreamReader  # noqa: PLC0415

        s = self.source
        s.assembler.start(room)
        stream = BinLogStreamReader(
            connection_settings=connect_kwargs(s.url),
            server_id=s.server_id,
            log_file=name,
            log_pos=offset,
            only_schemas=s.schemas,
            **DUMP_OPTIONS,
        )
        state = _ReadState(name, file_index(name), offset, (name, offset), expect is None, mark)
        state.gtid = state.boundary_gtid = self._seed_gtid
        self._dump(_Dump(stream, state), after, expect)

    def _dump(self, dump: _Dump, after: LogPosition | None, expect: str | None) -> None:
        """Read events of ``dump`` into the buffer until the log ends, the room is used up
        or the time is (at a transaction boundary), or a column type changes.

        Out of room inside a transaction, the part read so far is handed out and the
        dump is held there: the next read goes on with the rest of the transaction
        (while the buffer still covers the checkpoint) instead of reading it again.
        """
        s = self.source
        buffer = s.buffer
        asm: Assembler = s.assembler
        state = dump.state
        deadline = time.monotonic() + s.read_timeout
        stopped = held = False
        try:
            while True:
                event = dump.stream.fetchone()
                if event is None:
                    break
                self._feed(state, event, after, expect)
                # The library's event and its packet wrapper refer to each other: garbage
                # only the cyclic collector frees, which the runtime pauses while a batch is
                # fetched; a 100k-row transaction then held every parsed row until the read
                # ended (94 MB). Cut the cycle so each event is freed as soon as it is read.
                event.packet = None
                if asm.current is not None and asm.stopped:
                    asm.partial()  # a type change: stop before it, nothing of the new shape
                    stopped, state.boundary = True, None
                    break
                if asm.current is not None and asm.full:
                    part = asm.split()  # out of room inside a transaction: hold it there
                    if part is not None:
                        buffer.append(part)
                    stopped = held = True
                    state.boundary = None
                    break
                if asm.current is None and (  # a scan (binlog_ddl.Followed) reads on
                    asm.full or (time.monotonic() >= deadline and not asm.renames.scanning)
                ):
                    stopped = True
                    break
        except DbTriggerError:
            dump.close()
            buffer.loaded = False
            self.continue_from = None
            raise
        except Exception as exc:
            dump.close()
            buffer.loaded = False
            self.continue_from = None
            raise self.translate(exc) from exc
        if held:
            self._held = dump
        else:
            dump.close()
        if asm.renames.read_ended():  # a scan ended: read again from the checkpoint
            stopped, state.boundary = True, None
        boundary = state.boundary
        self.continue_from = (
            None
            if boundary is None
            else (*boundary, state.mark if boundary[0] == state.file else None)
        )
        self.continue_gtid = state.boundary_gtid if boundary is not None else None
        buffer.finish(complete=not stopped, through=None)
        s.schema_break = asm.schema_break

    def _feed(
        self, state: _ReadState, event: Any, after: LogPosition | None, expect: str | None
    ) -> None:
        """Take one event of the dump (positions, transaction boundaries, rows)."""
        from pymysqlreplication import event as ev  # noqa: PLC0415
        from pymysqlreplication import row_event as rev  # noqa: PLC0415

        asm = self.source.assembler
        buffer = self.source.buffer
        kind = type(event)
        if kind is ev.RotateEvent:
            state.file = event.next_binlog
            state.index = file_index(state.file)
            state.last_end = event.position
            state.mark = None  # the next file's comes next
            if asm.current is None:
                state.boundary = (state.file, state.last_end)
            return
        start = state.last_end
        end = event.packet.log_pos or start
        state.last_end = end
        if kind is ev.FormatDescriptionEvent:
            state.mark = event_mark(event)
            want, state.want_mark = state.want_mark, None
            if want is not None and want != state.mark:
                raise self.other_log(want, state.mark, state.file, start)
            return
        if kind is ev.MariadbGtidEvent or kind is ev.GtidEvent:
            gtid = state.gtid = event.gtid if getattr(event, "gno", 1) else None
            token = commit_token(state.index, start, gtid, self.generation)
            if not state.checked:
                state.checked = True
                if token != expect:
                    raise self.not_there(expect or "", token, state.file, start)
            standalone = kind is ev.MariadbGtidEvent and bool(event.flags & 1)
            asm.begin(token, gtid, event.timestamp, after, explicit=not standalone)
        elif kind is ev.QueryEvent:
            text = event.query if isinstance(event.query, str) else str(event.query)
            word = text.lstrip()[:6].upper()
            if word == "BEGIN":
                if asm.current is None:  # no GTID event (old servers): BEGIN starts it
                    token = commit_token(state.index, start, None, self.generation)
                    asm.begin(token, None, event.timestamp, after, explicit=True)
                return
            asm.query(text, getattr(event, "schema", None))
            if asm.commits(word):
                self._committed(asm.commit(event.timestamp), buffer, state, end)
        elif kind is ev.XidEvent:
            self._committed(asm.commit(event.timestamp), buffer, state, end)
        elif kind is rev.TableMapEvent:
            asm.table_map(event, (state.file, end))
        elif kind is rev.WriteRowsEvent:
            asm.rows(event, "I")
        elif kind is rev.UpdateRowsEvent:
            asm.rows(event, "U")
        elif kind is rev.DeleteRowsEvent:
            asm.rows(event, "D")

    @staticmethod
    def _committed(
        txn: Transaction[Any] | None, buffer: TransactionBuffer[Any], state: _ReadState, end: int
    ) -> None:
        if txn is not None:
            buffer.append(txn)
        state.boundary = (state.file, end)
        state.boundary_gtid = state.gtid

    def not_there(self, expect: str, found: str, name: str, offset: int) -> SlotLostError:
        s = self.source
        return self.reset_error(
            f"the binary log at {name} offset {offset} holds transaction {found}, not "
            f"{expect} where poller {s.poller or s.reader}'s checkpoint is"
        )

    def other_log(self, want: str, found: str, name: str, offset: int) -> SlotLostError:
        s = self.source
        return self.reset_error(
            f"the binary log file {name} is not the one poller {s.poller or s.reader}'s "
            f"position {name}:{offset} was recorded in (that one was {mark_text(want)}, this "
            f"one is {mark_text(found)})"
        )

    def reset_error(self, what: str) -> SlotLostError:
        """The log a position was recorded in is not the server's log now. ``cdc recreate``
        is enough, a checkpoint or not: it starts a new reader generation, and a checkpoint
        of an earlier one is passed over (:meth:`check_generation`)."""
        s = self.source
        return SlotLostError(
            f"{what}: the log was reset (RESET MASTER) or this is another server (restored "
            "from a backup, a promoted replica), and the changes since that position cannot be "
            "found. Start again and read the tables again: dbtrigger cdc recreate "
            "MODULE:TRIGGER --snapshot --yes",
            poller=s.poller,
        )

    def translate(self, exc: Exception) -> DbTriggerError:
        s = self.source
        code = exc.args[0] if isinstance(exc, pymysql.MySQLError) and exc.args else None
        message = (
            str(exc.args[1])
            if isinstance(exc, pymysql.MySQLError) and len(exc.args) > 1
            else str(exc)
        )
        if code in (1045, 1227, 1044) or "REPLICATION SLAVE" in message.upper():
            try:
                user = current_user(s.connection())
            except DbTriggerError:
                user = "'user'@'host'"
            return SourcePermissionError(replication_refused(user) + f" ({message})")
        if code == ER_MASTER_FATAL_READING_BINLOG:
            lowered = message.lower()
            if "same server_uuid/server_id" in lowered or "same server_id" in lowered:
                return FetchError(
                    f"the server dropped this reader's binlog connection: another replica or "
                    f"reader connected with server_id {s.server_id} ({message}). Give each "
                    "BinlogSource its own server_id= (the default is derived from the poller "
                    "name; two pollers with one name on one server collide)"
                )
            return SlotLostError(
                f"the server cannot send its binary log from the position needed ({message}): "
                "the file was purged or the log reset. Start again and read the tables again: "
                "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
                poller=s.poller,
            )
        return source_error(exc, "reading the binary log")

    # --- after durable checkpoints ------------------------------------------------------------

    def release(self, acked: LogPosition | None) -> None:
        """``acked`` is durable: forget what it passed; note read-through now and then."""
        s = self.source
        buffer = s.buffer
        if acked is not None:
            buffer.trim(acked)
        if (
            not buffer.loaded
            or not buffer.complete
            or self.continue_from is None
            or buffer.pending(acked) != 0
            or not buffer.covers(acked)
        ):
            return
        now = time.monotonic()
        if now - self._last_through_write < s.heartbeat_interval:
            return
        key = "-" if acked is None else acked.text
        name, offset, mark = self.continue_from
        if self._through_written == (key, name, offset):
            return
        self._last_through_write = now
        conn = s.connection()
        control.update(
            conn,
            s.control_database,
            s.reader,
            through_after=key,
            through_file=name,
            through_pos=offset,
            through_mark=mark,
            through_gtid=self.continue_gtid,
        )
        self._through_written = (key, name, offset)
        if s.control_row is not None:
            s.control_row.through_after = key
            s.control_row.through_file = name
            s.control_row.through_pos = offset
            s.control_row.through_mark = mark
            s.control_row.through_gtid = self.continue_gtid

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()


def file_mark(source: BinlogSourceParts, name: str) -> str:
    """The mark of binlog file ``name`` (see the module docstring): read from its format
    description event, by one short dump with a server id of its own (a running reader's
    dump is not displaced). For ``install``, ``recreate`` and ``cdc status``, never per
    read.

    Raises:
        SlotLostError: the server cannot send the file from there (purged, reset).
    """
    from pymysqlreplication import BinLogStreamReader  # noqa: PLC0415
    from pymysqlreplication import event as ev  # noqa: PLC0415

    try:
        stream = BinLogStreamReader(
            connection_settings=connect_kwargs(source.url),
            server_id=default_server_id(f"{source.reader}/mark"),
            log_file=name,
            log_pos=4,
            only_events=[ev.FormatDescriptionEvent],
            **DUMP_OPTIONS,
        )
        try:
            event = stream.fetchone()
        finally:
            stream.close()
    except Exception as exc:
        raise BinlogPoller(source).translate(exc) from exc
    if event is None:
        raise SlotLostError(f"the server sent nothing of binary log {name}")
    return event_mark(event)


__all__ = ["BinlogPoller", "beyond_end", "file_mark", "mark_text"]
