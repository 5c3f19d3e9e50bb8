"""What every log source is to the runtime: the port, over a buffer its reader fills.

:class:`~dbtrigger.cdc.PgLogicalSource` and :class:`~dbtrigger.cdc.BinlogSource`
read different logs but face the runtime alike, and that face lives here once:

* **identity**: the poller it serves (one; a log position is one poller's),
  the fingerprint of what a stored position means, the ``describe()`` a
  status shows (the password masked);
* **fetch**: answered from the read-ahead buffer
  (:class:`~dbtrigger.cdc.buffer.TransactionBuffer`), which the source's
  reader fills when it holds too little; a column type change holds delivery
  back with :class:`~dbtrigger.errors.SchemaChangedError` once everything
  before it was delivered (a watched table moved off its name, likewise with
  :class:`~dbtrigger.errors.SourceDefinitionError`); a ``truncate`` comes in a
  batch of its own;
* **acknowledge**: after the runtime's checkpoint is durable, the reader
  releases the log behind it (a slot advanced; a binlog read-through noted);
  a release that fails is retried after the next commit, never raised;
* ``lag_after`` from what the buffer holds (no query), ``to_events``, ``close``.

A subclass says how to open its connection, prepare the server (first use),
build its reader, persist accepted columns, and the names it is known by.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from sqlalchemy.engine import URL

from dbtrigger import options as opt
from dbtrigger._engine import parse_database_url
from dbtrigger.cdc.assembly import SchemaBreak, SchemaGuard
from dbtrigger.cdc.buffer import Materialise, TransactionBuffer
from dbtrigger.cdc.changes import to_events, truncate_alone
from dbtrigger.cdc.health import HealthReporter
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cdc.snapshots import ChunkWriter, Snapshot
from dbtrigger.cursor import Position, canonical_json
from dbtrigger.errors import (
    ConfigurationError,
    CorruptStateError,
    SchemaChangedError,
    SourceDefinitionError,
)
from dbtrigger.events import RowChange
from dbtrigger.metrics import MetricsCollector
from dbtrigger.redaction import safe_url_text
from dbtrigger.sources.fingerprint import identity_url
from dbtrigger.sources.lag import LagReading, column_basis

log = logging.getLogger("dbtrigger.cdc")

#: How ``lag_seconds`` is measured: the commit time of the oldest undelivered change.
LAG_BASIS = column_basis("commit_time")
SNAPSHOTS = ("initial", "never")


class LogReader(Protocol):
    """A source's reader of its log: fills the buffer, releases the log behind checkpoints."""

    def fill(self, after: LogPosition | None, limit: int) -> None: ...

    def release(self, acked: LogPosition | None) -> None: ...

    def close(self) -> None: ...


class LogSourceParts(Protocol):
    """What the parts of every log source (readers, snapshot writer, health, admin) use
    of it: they see the source through this, and the database's own additions
    (:mod:`dbtrigger.cdc.pg_context`, :mod:`dbtrigger.cdc.binlog_context`), never
    through its class, so a source imports its parts and no part imports a source."""

    snapshot: str
    poller: str | None
    metrics: MetricsCollector | None
    read_timeout: float
    read_ahead: int
    heartbeat_interval: float
    snapshot_chunk_size: int
    snapshot_lock_timeout: float
    buffer: TransactionBuffer[Any]
    acked: LogPosition | None
    schema_break: SchemaBreak | None
    lock: threading.RLock
    snapshots: ChunkWriter[Any, Any, Any]

    @property
    def url(self) -> URL: ...

    def table_names(self) -> list[str]: ...

    def close(self) -> None: ...


class LogSource(ABC):
    """The port's face of a log source (see the module docstring)."""

    #: ``describe()["kind"]`` and the fingerprint's kind.
    KIND: ClassVar[str]
    #: What a second poller needs of its own (a slot, a server_id).
    OWN: ClassVar[str]
    #: The keys of :meth:`describe_names`.
    NAME_FIELDS: ClassVar[tuple[str, ...]]

    #: Accepted columns (set by :meth:`set_up` from the control row).
    guard: SchemaGuard[Any]
    snapshots: ChunkWriter[Any, Any, Any]
    health: HealthReporter[Any]

    def __init__(
        self,
        url: str,
        url_hint: str,
        snapshot: str,
        create: bool,
        read_timeout_seconds: float,
        read_ahead: int,
        heartbeat_interval_seconds: float,
        snapshot_chunk_size: int,
        snapshot_lock_timeout_seconds: float,
    ) -> None:
        if snapshot not in SNAPSHOTS:
            raise ConfigurationError(f"snapshot must be one of {SNAPSHOTS}, got {snapshot!r}")
        self.read_timeout = opt.seconds("read_timeout_seconds", read_timeout_seconds)
        self.read_ahead = opt.whole("read_ahead", read_ahead)
        self.heartbeat_interval = opt.seconds(  # 0: see the subclass
            "heartbeat_interval_seconds", heartbeat_interval_seconds, inclusive=True
        )
        self.snapshot_chunk_size = opt.whole("snapshot_chunk_size", snapshot_chunk_size)
        self.snapshot_lock_timeout = opt.seconds(
            "snapshot_lock_timeout_seconds", snapshot_lock_timeout_seconds
        )
        if not isinstance(url, str) or not url:
            raise ConfigurationError(f"{type(self).__name__} needs url= ({url_hint})")
        self._url_text = url
        self._url: URL | None = None
        self.snapshot = snapshot
        self.create = create
        self.poller: str | None = None
        self.metrics: MetricsCollector | None = None
        #: Held while the buffer is read or changed (fetch, acknowledge, a stream thread).
        self.lock = threading.RLock()
        self._ready = False
        self._conn: Any = None
        self._log_reader: LogReader | None = None
        self.buffer: TransactionBuffer[Any] = TransactionBuffer(self.materialise)
        self.acked: LogPosition | None = None
        #: Where a column changed type (set by the reader; delivery stops there).
        self.schema_break: SchemaBreak | None = None

    # --- what a subclass says ---------------------------------------------------------------

    #: How the buffer turns a raw change into a :class:`~dbtrigger.cdc.changes.Change`
    #: (a ``staticmethod``).
    materialise: Materialise[Any]

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    def table_names(self) -> list[str]:
        """The watched tables, qualified."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """The names a stored position belongs to, beside server and tables (fingerprinted)."""

    @abstractmethod
    def describe_names(self) -> dict[str, Any]:
        """The names to show (ConfigurationError while they are unknown: no poller yet)."""

    @abstractmethod
    def describe_settings(self) -> dict[str, Any]: ...

    @abstractmethod
    def open_connection(self) -> Any: ...

    @abstractmethod
    def usable(self, conn: Any) -> bool: ...

    @abstractmethod
    def set_up(self, after: LogPosition | None) -> None:
        """Check the server, find (or create) what the source needs there (first use)."""

    @abstractmethod
    def new_reader(self) -> LogReader: ...

    @abstractmethod
    def save_columns(self, accepted: dict[str, dict[str, Any]]) -> None:
        """Persist the accepted columns (the control row)."""

    @abstractmethod
    def release_failed(self, acked: LogPosition | None, exc: Exception) -> None:
        """Say that the log could not be released behind ``acked`` (retried later)."""

    def schema_break_seen(
        self, after: LogPosition | None, limit: int, changes: list[Any]
    ) -> list[Any]:
        """Delivery reached a type change (``changes`` is what is still before it): what
        to deliver now. A subclass may look for an acceptance made elsewhere."""
        return changes

    def read_on_seen(self) -> None:  # noqa: B027 - most sources record no stop
        """A read reached the end of the log with no stop in it (a stop recorded for
        ``cdc status`` may be forgotten)."""

    def close_parts(self) -> None:  # noqa: B027 - most sources have nothing more
        """Forget per-process state beyond the reader, connection and buffer."""

    # --- identity ---------------------------------------------------------------------------

    def bind_poller(self, name: str, metrics: MetricsCollector | None = None) -> None:
        """Named after the poller it serves (its own names default to the poller's)."""
        if self.poller is not None and self.poller != name:
            raise ConfigurationError(
                f"this {type(self).__name__} already serves poller {self.poller!r}; poller "
                f"{name!r} needs a source ({self.OWN}) of its own"
            )
        self.poller = name
        self.metrics = metrics

    def poller_named(self, given: str | None, what: str, default: Callable[[str], str]) -> str:
        """A name given to the source, else ``default`` of the poller's name."""
        if given is not None:
            return given
        if self.poller is None:
            raise ConfigurationError(
                f"{type(self).__name__}: name the {what} or give the source to a PollTrigger, "
                "whose name it then takes"
            )
        return default(self.poller)

    def initial_requests(self, tables: Sequence[str], *, snapshots: bool = True) -> list[Snapshot]:
        """The snapshot requests a new reader starts with (``snapshot="initial"``)."""
        if not snapshots or self.snapshot != "initial":
            return []
        return [Snapshot(t) for t in tables]

    @property
    def url(self) -> URL:
        if self._url is None:
            self._url = parse_database_url(self._url_text, f"{type(self).__name__} url")
        return self._url

    def fingerprint(self) -> str:
        """What a stored position means: this server's log, these tables, these names.

        Not how the server is reached (see :mod:`dbtrigger.sources.fingerprint`).
        """
        definition = {
            "fingerprint_version": 1,
            "kind": self.KIND,
            "source": identity_url(self.url),
            "tables": sorted(self.table_names()),
            **self.identity(),
        }
        return "sha256:" + hashlib.sha256(canonical_json(definition).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        url: str | None = None
        try:
            url = safe_url_text(self.url)
        except ConfigurationError:
            url = self._url_text if self._url_text.startswith("%") else None
        try:
            names = self.describe_names()
        except ConfigurationError:  # no poller yet: no names yet
            names = dict.fromkeys(self.NAME_FIELDS)
        return {
            "name": self.name,
            "kind": self.KIND,
            "url": url,
            "tables": self.table_names(),
            **names,
            **self.describe_settings(),
            "snapshot": self.snapshot,
            "read_timeout_seconds": self.read_timeout,
            "read_ahead": self.read_ahead,
        }

    # --- the connection and first use -------------------------------------------------------

    def connection(self) -> Any:
        """The source's session (opened on first use, reopened after a failure)."""
        conn = self._conn
        if conn is None or not self.usable(conn):
            conn = self._conn = self.open_connection()
        return conn

    def drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def prepare(self, after: LogPosition | None) -> None:
        """:meth:`set_up` once per process (again after :meth:`close`)."""
        if self._ready:
            return
        try:
            self.set_up(after)
        except Exception:
            self.drop_connection()
            raise
        self._ready = True

    def log_reader(self) -> LogReader:
        if self._log_reader is None:
            self._log_reader = self.new_reader()
        return self._log_reader

    def drop_reader(self) -> None:
        reader, self._log_reader = self._log_reader, None
        if reader is not None:
            reader.close()

    def save_added_columns(self) -> None:
        """Persist columns first seen in the log (best effort: re-learnt if lost)."""
        guard = self.guard
        if not guard.added:
            return
        guard.added = False
        try:
            self.save_columns(guard.accepted)
        except Exception as exc:  # noqa: BLE001 - a column list re-learnt next time
            log.warning("could not save the accepted columns: %s", exc)

    # --- the port -----------------------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        """Up to ``limit`` changes after ``after``, in commit order (see the module docstring)."""
        if limit < 1:
            raise ConfigurationError(f"limit must be at least 1, got {limit}")
        position = LogPosition.of(after)
        with self.lock:
            self.prepare(position)
            buffer = self.buffer
            if not buffer.covers(position) or buffer.pending(position) < limit:
                self.log_reader().fill(position, limit)
            changes = self.buffer.take(position, limit)
            if self.schema_break is not None:
                changes = self.schema_break_seen(position, limit, changes)
            elif self.buffer.complete:
                self.read_on_seen()
            changes = truncate_alone(changes)  # a barrier for every key of its table
            self.save_added_columns()
            self.health.maybe_report(position)
            brk = self.schema_break
            if not changes and brk is not None and brk.table_gone:
                raise SourceDefinitionError(brk.problem, poller=self.poller)
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
        with self.lock:
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
        with self.lock:
            if not self._ready:
                return
            if acked is not None and (self.acked is None or acked > self.acked):
                self.acked = acked
            try:
                self.log_reader().release(acked)
            except Exception as exc:  # noqa: BLE001 - the checkpoint stands; retried next commit
                self.release_failed(acked, exc)
                self.drop_connection()

    def close(self) -> None:
        with self.lock:
            self.drop_reader()
            self.drop_connection()
            self._ready = False
            self.buffer = TransactionBuffer(self.materialise)
            self.schema_break = None
            self.close_parts()
            self.snapshots.poke()  # requests are looked for again at the next read


__all__ = ["LAG_BASIS", "SNAPSHOTS", "LogReader", "LogSource", "LogSourceParts"]
