"""Stream mode: a replication connection, confirmed to the server only behind durable checkpoints.

A thread holds a ``psycopg2`` logical replication connection open and decodes
what the server streams into the source's buffer as it arrives; ``fetch``
answers from the buffer. Protocol 1 sends a transaction only once it has
committed, so its changes may be handed out as they arrive, before its Commit
message (each position is known from the Begin message); a transaction larger
than memory therefore flows through instead of being held whole.

Bounds, as in poll mode:

* **end LSN**: a fetch takes the server's flush position when it starts and
  waits (at most ``read_timeout_seconds``) until the stream has delivered
  everything before it (asking the server for a keepalive when it is quiet),
  so a change committed before a fetch is always seen by it. With
  ``stream_wait_seconds`` it then waits that much longer for the first change,
  which is what brings commit-to-handler latency down to milliseconds.
* **memory**: the thread stops reading when ``read_ahead`` changes wait in the
  buffer (it keeps the connection alive meanwhile); the server holds the rest.
* **idle**: a stream no fetch has read from for :data:`IDLE_SECONDS` lets go
  of the slot (the next fetch opens it again). A slot has one reader, and a
  worker that lost its lease but lives on must not keep the worker that holds
  the lease from reading.
* **feedback**: the flush position reported to the server is only ever what
  :meth:`StreamReader.release` computed from a durable checkpoint. Every
  status message of ours is sent by the thread's loop (psycopg2's own interval
  is set out of reach), after the bound it may confirm (the stream's WAL end)
  is recorded in the control row; a slot confirmed past that bound is one made
  again by hand (:mod:`dbtrigger.cdc.pg_control`). psycopg2 also answers by
  itself, inside ``read_message``, a keepalive that asks for a reply (the
  server heard nothing for ``wal_sender_timeout``/2, or it shuts down), and
  first moves the flush position it reports to that keepalive's WAL end when
  every data message received was confirmed - a position no loop could record
  first, so the next start took the slot for one made again by hand
  (:class:`~dbtrigger.errors.SlotLostError`). The loop therefore confirms at
  most up to just below the last data message received (:func:`confirmable`):
  that message stays unconfirmed, so psycopg2 never moves the position on. The
  slot still advances past quiet stretches of the log: each fetch's heartbeat
  (:mod:`dbtrigger.cdc.pg_poll`) is such a message.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from dbtrigger.cdc.pg_connection import connect_kwargs
from dbtrigger.cdc.pg_poll import PollReader
from dbtrigger.cdc.pg_reader import Decoder
from dbtrigger.cdc.pgoutput import parse_lsn
from dbtrigger.cdc.position import LogPosition
from dbtrigger.errors import ConfigurationError, FetchError, SlotLostError

if TYPE_CHECKING:
    from dbtrigger.cdc.pg_context import PgSourceParts

log = logging.getLogger("dbtrigger.cdc")

#: Seconds between status messages while the stream is paused (the server drops
#: a silent client after wal_sender_timeout, 60 s by default).
KEEPALIVE_SECONDS = 10.0
#: psycopg2's own status interval: longer than any stream lives, so every status
#: message is the loop's (:meth:`StreamReader._record_bound` runs before each).
NO_OWN_STATUS_SECONDS = 365 * 24 * 3600.0
_UNBOUNDED = 1 << 62
#: Seconds without a fetch after which the stream closes (see the module docstring).
IDLE_SECONDS = 60.0
#: How long stopping the stream waits for its thread (a status message or a bound
#: recorded, each under the source's statement timeout, may be under way).
STOP_SECONDS = 30.0


def confirmable(target: int, last_start: int) -> int:
    """The flush position to report for ``target``: below ``last_start``, the start
    of the last data message received on the connection (0: none yet).

    psycopg2 moves the position it reports to a keepalive's WAL end by itself once
    the position confirmed explicitly reaches the last data message's start, and
    sends it unasked when the keepalive asks for a reply, before this stream could
    record that end as the bound. Kept below that message, it never does. Nothing is
    delivered again for it: that message (a commit's end, a heartbeat) is the last
    one, and a restart resumes after every transaction that committed before it.
    """
    if last_start <= 0:
        return target
    return min(target, last_start - 1)


def _psycopg2() -> Any:
    try:
        import psycopg2  # noqa: PLC0415
        import psycopg2.extras  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigurationError(
            "mode='stream' needs psycopg2 (its logical replication connection): "
            "pip install 'dbtrigger[cdc]' (or psycopg2-binary), or use mode='poll'"
        ) from exc
    return psycopg2


class StreamReader:
    """Feeds the source's buffer from a replication connection (see the module docstring)."""

    def __init__(self, source: PgSourceParts) -> None:
        self.source = source
        self.helper = PollReader(source)  # heartbeat and the server's flush position
        self._lock = source.lock
        self._changed = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._after: LogPosition | None = None
        self._decoder: Decoder | None = None
        self._open: Any = None
        self.flush_target = 0
        self.received_through = 0
        self._want_reply = False
        self._last_fill = time.monotonic()
        #: The thread closed the stream for want of fetches (set under the lock).
        self._idle = False
        _psycopg2()  # refuse at once, not in the thread

    # --- the fetch side (under the source's lock) ---------------------------------------

    def fill(self, after: LogPosition | None, limit: int) -> None:
        s = self.source
        if s.schema_break is not None:
            return  # stopped at a type change: the source says so once nothing is pending
        self._last_fill = time.monotonic()
        if self._error is not None or self._idle:
            self.stop()
        started = self._thread is None or not s.buffer.covers(after)
        if started:
            self.start(after)
        conn = s.connection()
        if started:  # a slot made again while no stream held it: refused before a change
            try:
                s.check_identity(conn, self.helper.confirmed_flush(conn))
            except SlotLostError:
                self.stop()
                raise
        s.check_published(conn)  # a table dropped and created again is in no publication
        self.helper.heartbeat(conn)
        if s.buffer.pending(after) == 0:
            s.snapshots.emit()  # caught up: the chunk is in the log before ``end`` is taken
        end = self.helper.flush_lsn(conn)
        deadline = time.monotonic() + s.read_timeout
        while self.received_through < end and self._error is None and s.schema_break is None:
            if self._has(after, limit):
                break
            self._want_reply = True
            self._last_fill = time.monotonic()  # a fetch waiting is a fetch: not idle
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchError(
                    f"replication stream of slot {s.slot} did not reach the server's position "
                    f"within {s.read_timeout:g}s (read_timeout_seconds); the next tick waits again",
                    poller=s.poller,
                )
            self._changed.wait(min(remaining, 0.2))
        if (
            s.stream_wait > 0
            and s.buffer.pending(after) == 0
            and self._error is None
            and s.schema_break is None
        ):
            self._last_fill = time.monotonic() + s.stream_wait
            self._changed.wait(s.stream_wait)
        self._raise_error()

    def _has(self, after: LogPosition | None, limit: int) -> bool:
        return self.source.buffer.pending(after) >= limit

    def _raise_error(self) -> None:
        error = self._error
        if error is None:
            return
        self.stop()
        s = self.source
        if isinstance(error, SlotLostError | ConfigurationError | FetchError):
            raise error
        lost = s.lost_slot()  # dropped or invalidated: no reconnect brings it back
        if lost is not None:
            raise lost from error
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "invalidated" in text or "can no longer get changes" in text:
            raise SlotLostError(
                f"replication slot {s.slot} can no longer stream: {text}. Recreate it and read "
                "the tables again: dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
                poller=s.poller,
            ) from error
        raise FetchError(
            f"replication stream of slot {s.slot} failed: {type(error).__name__}: {text}; the "
            "next tick reconnects",
            poller=s.poller,
        ) from error

    def start(self, after: LogPosition | None) -> None:
        self.stop()
        s = self.source
        s.buffer.reset(after)
        s.buffer.complete = True
        self._after = after
        self._error = None
        self._idle = False
        self._open = None
        s.schema_break = None
        self.received_through = 0
        self._decoder = Decoder(s.infos, s.guard, slot=s.slot)
        self._decoder.start(_UNBOUNDED)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name=f"dbtrigger-cdc-stream-{s.slot}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._lock.release()  # the thread takes the lock to finish what it read
        try:
            thread.join(timeout=STOP_SECONDS)
        finally:
            self._lock.acquire()
        if thread.is_alive():  # a daemon: it ends with the process, or on its own
            log.warning(
                "slot %s: the stream thread did not end within %gs of being stopped (its "
                "connection is closed when it does); left to end on its own",
                self.source.slot,
                STOP_SECONDS,
                extra={"event": "cdc_stream_stop_abandoned", "poller": self.source.poller},
            )

    # --- releasing ------------------------------------------------------------------------

    def release(self, acked: LogPosition | None) -> None:
        s = self.source
        buffer = s.buffer
        point = 0
        if acked is not None:
            point = max(buffer.release_point(acked) or 0, parse_lsn(acked.commit))
            if buffer.pending(acked) == 0 and self._open is None and buffer.covers(acked):
                point = max(point, self.received_through)
            buffer.trim(acked)
        elif buffer.changes == 0 and self._open is None and self._after is None:
            point = self.received_through
        self.flush_target = max(self.flush_target, point)

    def close(self) -> None:
        self.stop()

    # --- the thread -------------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        """``stop``: this thread's own (a thread left running by a stop that timed out
        must not take the next start's for its own)."""
        s = self.source
        psycopg2 = _psycopg2()
        conn = None
        try:
            kwargs = connect_kwargs(s.url, application_name="dbtrigger-cdc-stream")
            conn = psycopg2.connect(
                connection_factory=psycopg2.extras.LogicalReplicationConnection, **kwargs
            )
            cursor = conn.cursor()
            cursor.start_replication(
                slot_name=s.slot,
                decode=False,
                options={
                    "proto_version": "1",
                    "publication_names": s.publication,
                    "messages": "true",
                },
                # Status messages are sent by the loop below, each after the bound it may
                # confirm is recorded; psycopg2 sends one by itself only when asked to.
                status_interval=NO_OWN_STATUS_SECONDS,
            )
            sent = 0
            last_start = 0  # the start of the last data message (see confirmable)
            last_status = time.monotonic()
            while not stop.is_set():
                if time.monotonic() - self._last_fill > IDLE_SECONDS and self._let_go():
                    break
                target = confirmable(self.flush_target, last_start)
                due = time.monotonic() - last_status > KEEPALIVE_SECONDS
                if target > sent or self._want_reply or due:
                    reply, self._want_reply = self._want_reply, False
                    self._record_bound(cursor, target)
                    cursor.send_feedback(flush_lsn=target, reply=reply)
                    sent = max(sent, target)
                    last_status = time.monotonic()
                if s.buffer.changes >= s.read_ahead:  # back-pressure: let the handler catch up
                    stop.wait(0.02)
                    continue
                message = cursor.read_message()
                if message is None:
                    with self._lock:
                        self.received_through = max(self.received_through, cursor.wal_end or 0)
                        self._changed.notify_all()
                    select.select([conn], [], [], 0.05)
                    continue
                last_start = int(message.data_start)
                with self._lock:
                    self._take(bytes(message.payload))
        except Exception as exc:  # noqa: BLE001 - handed to the fetching thread
            with self._lock:
                self._error = exc
                self._changed.notify_all()
        finally:
            if conn is not None:
                conn.close()

    def _record_bound(self, cursor: Any, target: int) -> None:
        """Record in the control row how far the next status message may move the slot.

        That is the checkpointed ``target``, or further: psycopg2 moves the flush
        position it reports to a keepalive's WAL end by itself once everything
        received was confirmed (nothing for us was below it), and the slot then
        confirms WAL this poller never released. Either is at most the stream's
        WAL end, so that is what is recorded, before the message is sent.
        """
        upto = max(target, int(cursor.wal_end or 0))
        s = self.source
        if s.bound is not None and upto <= s.bound:
            return
        with self._lock:
            s.raise_bound(s.connection(), upto)

    def _let_go(self) -> bool:
        """No fetch for :data:`IDLE_SECONDS`: close the stream (True), unless one just came."""
        with self._lock:
            if time.monotonic() - self._last_fill <= IDLE_SECONDS:
                return False
            self._idle = True
        log.info(
            "slot %s: no fetch for %gs; the stream lets go of the slot until the next one",
            self.source.slot,
            IDLE_SECONDS,
            extra={"event": "cdc_stream_idle", "poller": self.source.poller},
        )
        return True

    def _take(self, payload: bytes) -> None:
        decoder = self._decoder
        assert decoder is not None  # noqa: S101 - set before the thread starts
        s = self.source
        done = decoder.feed(payload, self._after)
        current = decoder.delivering
        if current is not None and current is not self._open:
            current.whole = False
            s.buffer.append(current, keep_empty=True)
            self._open = current
        brk = decoder.schema_break
        if brk is not None and s.schema_break is None:
            # Nothing after it is read until the shape is accepted; the transaction it
            # is in stays unfinished, so the slot is never released past its start.
            s.schema_break = brk
            self._stop.set()
            self._changed.notify_all()
            return
        if done is not None:
            done.whole = True
            self._open = None
        if done is not None or (current is not None and current.changes):
            self._changed.notify_all()


__all__ = ["StreamReader"]
