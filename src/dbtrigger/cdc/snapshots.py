"""Snapshot requests, and the writer that works them off one chunk at a time, into the log.

Both log sources snapshot a table the same way (the database-specific part is
how one chunk is read under a lock and written into the log: see
:mod:`dbtrigger.cdc.pg_snapshot` and :mod:`dbtrigger.cdc.binlog_snapshot`):

* a request (:class:`Snapshot`, kept in the source's control row) names a
  table and optionally a condition, and remembers the last key read;
* while the poller is caught up, each read first writes the next chunk of the
  oldest pending request into the log, in the transaction that moves the
  request forward, so the chunk arrives in commit order with every change and
  an interrupted snapshot resumes at the next chunk (never from zero, never
  skipping one);
* a chunk that cannot get its locks in time waits for the next read.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from dbtrigger.errors import ConfigurationError

log = logging.getLogger("dbtrigger.cdc")

#: How often a running source looks for new snapshot requests (``cdc snapshot``).
RECHECK_SECONDS = 5.0


@dataclass
class Snapshot:
    """One table's snapshot request: chunks read so far end at ``last_key``.

    ``where`` is an optional SQL condition (``dbtrigger cdc snapshot --where``),
    ``done`` is set once a chunk came back short. The JSON shape is the same
    for every database.

    ``log_position`` is where the source's log ended when the request was made,
    read in the request's own transaction (in the source's position text; None:
    not recorded, as for a reader's first snapshot or a request of an earlier
    version). It says exactly whether a request came after a statement of the
    log, which a binlog reader must know before it reads on past a table put
    under a watched name (:func:`dbtrigger.cdc.binlog_snapshot.asked_after`).
    ``requested_at`` is the client's clock, for people only: the log's times are
    the server's, in whole seconds, and cannot order the two.
    """

    table: str
    where: str | None = None
    last_key: list[Any] | None = None
    chunks: int = 0
    rows: int = 0
    done: bool = False
    requested_at: str | None = None
    log_position: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Snapshot:
        return cls(
            raw["table"],
            raw.get("where"),
            raw.get("last_key"),
            int(raw.get("chunks", 0)),
            int(raw.get("rows", 0)),
            bool(raw.get("done", False)),
            raw.get("requested_at"),
            raw.get("log_position"),
        )

    @classmethod
    def request(
        cls, table: str, where: str | None = None, log_position: str | None = None
    ) -> Snapshot:
        """A new request, stamped now (and with the log's position, when given)."""
        return cls(
            table,
            where=where,
            requested_at=dt.datetime.now(dt.timezone.utc).isoformat(),
            log_position=log_position,
        )

    def advance(self, rows: int, last_key: list[Any] | None, chunk_size: int) -> None:
        """A chunk of ``rows`` rows was written: it ends at ``last_key``."""
        if rows:
            self.last_key = last_key
        self.chunks += 1
        self.rows += rows
        self.done = rows < chunk_size
        if self.requested_at is None:
            self.requested_at = dt.datetime.now(dt.timezone.utc).isoformat()


C = TypeVar("C")


class ControlRowLike(Protocol[C]):
    """What a control row of either database has for snapshots and accepted columns."""

    columns: dict[str, dict[str, C]]
    snapshots: list[Snapshot]


def pending(snapshots: Sequence[Snapshot]) -> list[Snapshot]:
    return [s for s in snapshots if not s.done]


def still_pending(row: ControlRowLike[Any] | None, request: Snapshot) -> Snapshot | None:
    """``request`` as the control row ``row`` has it now - read again, under the row's
    lock, in the transaction that writes its next chunk - or None when the row no
    longer has it exactly as it was read.

    The chunk saves the whole request list, so it must save the list it read under
    that lock: a list read before would overwrite what another process wrote
    meanwhile (a request of ``cdc snapshot``, the fresh requests of ``cdc
    recreate``), and the rows those asked for would never be read. None: the row
    was changed under the writer (``cdc recreate``), and no chunk is written.
    """
    if row is None:
        return None
    for candidate in row.snapshots:
        if candidate == request:
            return candidate
    return None


def carry_over(
    previous: ControlRowLike[C] | None,
    row: ControlRowLike[C],
    tables: Sequence[str],
    *,
    snapshot: bool,
) -> None:
    """A recreated reader keeps what was accepted and done, and with ``snapshot`` reads
    every table again."""
    if previous is not None:
        row.columns = previous.columns  # what the consumers accepted stays accepted
        row.snapshots = [s for s in previous.snapshots if s.done]
    if snapshot:
        row.snapshots.extend(Snapshot.request(t) for t in tables)


class SnapshotSource(Protocol):
    """What a snapshot writer reads of its source."""

    @property
    def poller(self) -> str | None: ...

    @property
    def snapshot_lock_timeout(self) -> float: ...

    @property
    def infos(self) -> Mapping[str, Any]: ...

    def connection(self) -> Any: ...

    def read_control(self, conn: Any, *, lock: bool = False) -> Any:
        """The source's control row, or None (not installed)."""

    def save_snapshots(self, conn: Any, snapshots: list[Snapshot]) -> None:
        """Persist the snapshot requests in the source's control row."""


S = TypeVar("S", bound=SnapshotSource)
R = TypeVar("R", bound=ControlRowLike[Any])
I = TypeVar("I")  # noqa: E741 - a table's catalog description


def watched(table: str, tables: Sequence[str]) -> str:
    """``table`` (qualified) when it is one of a source's ``tables``, checked before a
    snapshot of it is requested.

    Raises:
        ConfigurationError: it is not, naming the ones that are.
    """
    if table not in tables:
        raise ConfigurationError(
            f"{table} is not one of this source's tables ({', '.join(tables)})"
        )
    return table


def add_request(
    source: SnapshotSource,
    conn: Any,
    table: str,
    where: str | None,
    *,
    reader: str,
    position: Callable[[Any], str | None] | None = None,
) -> Snapshot:
    """Queue a snapshot request of ``table`` in the source's control row, read under a
    lock and saved in the caller's transaction on ``conn``. ``position`` gives the
    source's log position now, of the locked row (its ``log_position``): read before
    the request commits, so every chunk of it is read after what the log held then.

    Raises:
        ConfigurationError: ``reader`` (``slot s``, ``reader r``) has no control row yet.
    """
    row = source.read_control(conn, lock=True)
    if row is None:
        raise ConfigurationError(
            f"{reader} is not installed yet: run the poller or dbtrigger cdc install"
        )
    request = Snapshot.request(table, where, None if position is None else position(row))
    row.snapshots.append(request)
    source.save_snapshots(conn, row.snapshots)
    return request


class ChunkWriter(ABC, Generic[S, R, I]):
    """Writes the next chunk of the oldest pending request into the log.

    ``R`` is the source's control row, ``I`` its description of a table.
    """

    #: What the chunk waits for, in the log line of a chunk that waits.
    LOCKS = "its locks were"

    def __init__(self, source: S) -> None:
        self.source = source
        self._next_check = 0.0
        self._pending = True

    def poke(self) -> None:
        """Look for requests at the next read (a request was just added)."""
        self._next_check = 0.0
        self._pending = True

    def emit(self) -> bool:
        """Write one chunk if a request is pending; True when one was written."""
        now = time.monotonic()
        if not self._pending and now < self._next_check:
            return False
        self._next_check = now + RECHECK_SECONDS
        s = self.source
        row = self.read_row()
        requests = [] if row is None else pending(row.snapshots)
        self._pending = bool(requests)
        if not requests or row is None:
            return False
        request = requests[0]
        info: I | None = s.infos.get(request.table)
        if info is None:
            log.warning(
                "snapshot of %s skipped: it is not one of this source's tables",
                request.table,
                extra={"event": "cdc_snapshot_skipped", "poller": s.poller},
            )
            request.done = True
            self.save(row)
            return False
        try:
            written = self.chunk(row, request, info)
        except Exception as exc:
            if not self.waits(exc, request.table):
                raise
            log.info(
                "snapshot chunk of %s waits: %s not granted within %gs (a long writer); "
                "tried again at the next read",
                request.table,
                self.LOCKS,
                s.snapshot_lock_timeout,
                extra={"event": "cdc_snapshot_lock_wait", "poller": s.poller},
            )
            self._pending = True
            return False
        if request.done:
            log.info(
                "snapshot of %s complete: %d rows in %d chunks",
                request.table,
                request.rows,
                request.chunks,
                extra={"event": "cdc_snapshot_done", "poller": s.poller, "table": request.table},
            )
        return written

    def read_row(self) -> R | None:
        """The source's control row (None: not installed)."""
        s = self.source
        row: R | None = s.read_control(s.connection())
        return row

    def save(self, row: R) -> None:
        """Persist the row's snapshot requests."""
        s = self.source
        s.save_snapshots(s.connection(), row.snapshots)

    @abstractmethod
    def chunk(self, row: R, request: Snapshot, info: I) -> bool:
        """Read and write one chunk, moving ``request`` forward; True when rows were written."""

    @abstractmethod
    def waits(self, exc: Exception, table: str) -> bool:
        """True when ``exc`` says the chunk's locks were not granted in time (it waits)."""


__all__ = [
    "RECHECK_SECONDS",
    "ChunkWriter",
    "ControlRowLike",
    "Snapshot",
    "SnapshotSource",
    "add_request",
    "carry_over",
    "pending",
    "still_pending",
    "watched",
]
