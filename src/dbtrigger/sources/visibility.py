"""Visibility guards: never checkpoint past a row that is not committed yet.

Cursor polling assumes rows become visible in cursor order. They do not: a
writer takes its cursor value (``now()``, a sequence number, a transaction id)
when it writes and the row becomes visible when it *commits*. A transaction that
takes a small value early and commits late appears behind a checkpoint that has
already moved past it, and a plain keyset poller never looks back: the row is
lost. A guard adds one condition to the fetch so that the poller only consumes
the part of the cursor order that can no longer change.

Guards (configuration objects, immutable, shareable):

* :class:`SnapshotHorizon` - PostgreSQL, exact. The cursor is a transaction-id
  column stamped by a trigger (:func:`install_visibility_trigger`); the fetch
  only returns rows whose id is below ``pg_snapshot_xmin(pg_current_snapshot())``
  computed in the same statement, i.e. rows of transactions that ended before
  every transaction still running began. Works for any table whatever its own
  keys; needs no privilege.
* :class:`TransactionHorizon` - PostgreSQL, exact for cursor values the
  database assigns inside the writing transaction (``now()``,
  ``clock_timestamp()``, a sequence without a per-session cache). Probes the
  highest visible cursor, then waits until every transaction that was open at
  the probe has ended (``pg_stat_activity``) before consuming up to it. Needs to
  see every session of the database (``pg_read_all_stats``).
* :class:`SafetyWindow` - every dialect with a clock (MariaDB/MySQL, SQLite,
  SQL Server, PostgreSQL on request): only rows whose timestamp is older than
  the database's own clock minus N seconds, the bound computed in the fetch
  statement. Bounded: a writer that commits more than N seconds after taking
  its timestamp can still be skipped.
* :class:`NoGuard` - explicit opt-out.

``"auto"`` (the default of :class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource`)
picks the strongest guard the dialect and cursor support; see :func:`choose`
and ``docs/visibility.md`` for the table.

Why the PostgreSQL transaction id has to *be* the cursor: filtering a
``BIGSERIAL`` cursor by ``xid < xmin`` is not enough. Transaction 101 takes
id 5 and stays open; transaction 100 inserts id 10 and commits. The horizon is
101, so id 10 (xid 100) is consumed and checkpointed; when 101 commits, id 5 is
behind the checkpoint. Sequence order and transaction order are unrelated, so
the order the poller walks must be the transaction order itself.
"""

from __future__ import annotations

import abc
import datetime as dt
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql import ColumnElement, Select

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier

log = logging.getLogger(__name__)

#: Default safety window. Five seconds covers ordinary commit latency (fsync
#: stalls, replication waits, a short lock wait) and equals Python's default
#: SQLite busy timeout, the longest a writer that computed its timestamp before
#: waiting for the write lock usually waits; it keeps the added visibility delay
#: of a near-real-time trigger small. Transactions that hold a cursor value
#: longer than this (batch jobs, lock waits up to ``innodb_lock_wait_timeout``)
#: need a larger window or a transaction-id cursor.
DEFAULT_WINDOW_SECONDS = 5.0

#: Held back longer than this, a horizon guard logs a WARNING naming the
#: blocking backend (and repeats it at this interval while it lasts).
DEFAULT_WARN_AFTER_SECONDS = 60.0

#: Column comment that marks a PostgreSQL transaction-id column; ``auto``
#: chooses :class:`SnapshotHorizon` for a cursor column that carries it.
XID_COLUMN_MARKER = "dbtrigger:xid8"

#: Dialects with a safety-window expression. SQL Server's is compiled in tests
#: but not run against a server here.
WINDOW_DIALECTS = frozenset({"postgresql", "mysql", "mariadb", "sqlite", "mssql"})

#: Backend types that never write user rows; their transactions do not hold the
#: :class:`TransactionHorizon` back.
_NON_WRITING_BACKENDS = (
    "autovacuum launcher",
    "autovacuum worker",
    "walsender",
    "walreceiver",
    "walwriter",
    "checkpointer",
    "background writer",
    "archiver",
    "startup",
    "logger",
)

_MAX_PENDING_PROBES = 128


# --- what a fetch reports -----------------------------------------------------


@dataclass(frozen=True)
class FetchInfo:
    """What the guard did on the last fetch, for metrics, logs and ``status``.

    Attributes:
        mode: the guard in force (``snapshot-horizon``, ``transaction-horizon``,
            ``safety-window``, ``none``).
        horizon: the bound the fetch used (a transaction id, a cursor value), or
            None when the bound lives only inside the SQL (safety window).
        held_back: rows exist after the checkpoint that the guard withheld
            because a transaction that may precede them is still open.
        held_back_seconds: for how long progress has been held back (0 if not).
        blocking_pid: the backend whose open transaction holds the horizon.
        blocking_xact_age_seconds: how long that transaction has been open.
        blocking_detail: a prepared (two-phase) transaction holding it, if any.
    """

    mode: str
    horizon: Any = None
    held_back: bool = False
    held_back_seconds: float = 0.0
    blocking_pid: int | None = None
    blocking_xact_age_seconds: float | None = None
    blocking_detail: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "horizon": None if self.horizon is None else str(self.horizon),
            "held_back": self.held_back,
            "held_back_seconds": round(self.held_back_seconds, 3),
            "blocking_pid": self.blocking_pid,
            "blocking_xact_age_seconds": self.blocking_xact_age_seconds,
            "blocking_detail": self.blocking_detail,
        }


# --- what the source tells a guard --------------------------------------------


@dataclass(frozen=True)
class GuardTarget:
    """The parts of a source a guard needs, without importing the source.

    ``cursor`` is the expression the fetch orders by; ``bind`` turns a Python
    value into a literal typed like the cursor; ``pending`` is the unguarded
    keyset select strictly after a position (no ORDER BY, no LIMIT);
    ``position_of`` is the position just after a fetched row.
    """

    dialect: str
    source_name: str
    cursor_name: str
    cursor: ColumnElement[Any]
    cursor_type: sa.types.TypeEngine[Any] | None
    cursor_comment: str | None
    columns: Mapping[str, ColumnElement[Any]]
    selectable: sa.FromClause
    base_filter: ColumnElement[bool] | None
    bind: Callable[[Any], ColumnElement[Any]]
    pending: Callable[[Position], Select[Any]]
    position_of: Callable[[Mapping[str, Any]], Position]
    table_mode: bool


class ActiveGuard:
    """A guard bound to one source: per-source state (probes, held-back clock).

    The source calls :meth:`before_fetch` (which may run statements of its own
    and ends the transaction it used) and adds the returned predicate to the
    fetch statement, then calls :meth:`after_fetch` with the rows it read.
    """

    mode = "none"

    def __init__(self, guard: VisibilityGuard, target: GuardTarget) -> None:
        self.guard = guard
        self.target = target
        self.last_info = FetchInfo(mode=self.mode)

    @property
    def guarantee(self) -> str:
        return self.guard.guarantee(self.target.dialect)

    def before_fetch(self, conn: Connection, after: Position) -> ColumnElement[bool] | None:
        del conn, after
        return None

    def after_fetch(
        self,
        conn: Connection,
        after: Position,
        rows: Sequence[Mapping[str, Any]],
        limit: int,
    ) -> FetchInfo:
        del conn, after, rows, limit
        return self.last_info


def _check_seconds(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigurationError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


# --- the guards ---------------------------------------------------------------


class VisibilityGuard(abc.ABC):
    """Base of the guard configurations. Subclasses are immutable."""

    mode = "none"

    @abc.abstractmethod
    def guarantee(self, dialect: str) -> str:
        """One sentence: what this guard promises on ``dialect``."""

    def label(self) -> str:
        """The mode with its parameters, for logs and ``status``."""
        return self.mode

    @abc.abstractmethod
    def activate(self, target: GuardTarget) -> ActiveGuard:
        """Bind to a source (validating that the guard fits it)."""


@dataclass(frozen=True)
class NoGuard(VisibilityGuard):
    """No protection: rows of a transaction that commits after a later one can be skipped.

    ``reason`` says why (an explicit opt-out, or why ``auto`` found no guard).
    """

    reason: str = "switched off explicitly"
    mode = "none"

    def guarantee(self, dialect: str) -> str:
        return f"none ({self.reason}): a transaction that commits late can be skipped"

    def activate(self, target: GuardTarget) -> ActiveGuard:
        return ActiveGuard(self, target)


@dataclass(frozen=True)
class SafetyWindow(VisibilityGuard):
    """Consume only rows whose timestamp is older than the database clock minus ``seconds``.

    Args:
        seconds: the window; must exceed the longest time a writer holds a
            cursor value before committing (see :data:`DEFAULT_WINDOW_SECONDS`).
        time_column: compare this column instead of the cursor (for an integer
            cursor set together with a timestamp, e.g. ``AUTO_INCREMENT`` id and
            ``created_at DEFAULT NOW(6)``).
        utc: the naive timestamps are UTC rather than the database session's
            time zone (MariaDB ``UTC_TIMESTAMP``; PostgreSQL ``timezone('UTC',
            ...)``). SQLite's clock is UTC either way.

    The bound is an expression in the fetch statement, evaluated by the database
    when it reads the rows, so no client clock is involved.
    """

    seconds: float = DEFAULT_WINDOW_SECONDS
    time_column: str | None = None
    utc: bool = False
    mode = "safety-window"

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds)):
            raise ConfigurationError(
                f"safety window must be a number of seconds, got {self.seconds!r}"
            )
        if self.seconds <= 0:
            raise ConfigurationError(f"safety window must be > 0 seconds, got {self.seconds}")
        if self.time_column is not None:
            validate_sql_identifier(self.time_column, "visibility time_column")

    def label(self) -> str:
        column = f", time_column={self.time_column}" if self.time_column else ""
        return f"{self.mode}({self.seconds:g}s{column})"

    def guarantee(self, dialect: str) -> str:
        what = self.time_column or "cursor"
        return (
            f"bounded: rows are consumed once their {what} is {self.seconds:g}s older than the "
            f"{dialect} clock; a writer that commits more than {self.seconds:g}s after taking "
            "its value can still be skipped"
        )

    def activate(self, target: GuardTarget) -> ActiveGuard:
        if target.dialect not in WINDOW_DIALECTS:
            raise ConfigurationError(
                f"no safety-window expression for dialect {target.dialect!r} "
                f"(supported: {', '.join(sorted(WINDOW_DIALECTS))}); choose visibility='none' "
                "explicitly or see docs/visibility.md"
            )
        column = target.cursor
        column_type = target.cursor_type
        if self.time_column is not None:
            if self.time_column not in target.columns:
                raise ConfigurationError(
                    f"safety window time_column {self.time_column!r} is not a column of "
                    f"{target.source_name}"
                )
            column = target.columns[self.time_column]
            column_type = column.type if target.table_mode else None
        return _WindowActive(
            self, target, window_predicate(self, target.dialect, column, column_type)
        )


@dataclass(frozen=True)
class SnapshotHorizon(VisibilityGuard):
    """PostgreSQL, exact: the cursor is the writing transaction's id.

    The cursor column must hold ``pg_current_xact_id()`` of the transaction that
    last wrote the row, as :func:`install_visibility_trigger` maintains it. The
    fetch reads only rows below ``pg_snapshot_xmin(pg_current_snapshot())`` in
    the same statement: every transaction with a smaller id has ended, and every
    transaction that has not ended (or not started) has a larger one, so nothing
    can appear behind the checkpoint later.

    Args:
        warn_after_seconds: log a WARNING naming the blocking backend once the
            horizon has held rows back this long.
        require_marker: refuse a cursor column without the
            :data:`XID_COLUMN_MARKER` comment (table mode), so a plain
            ``BIGSERIAL`` column is not mistaken for transaction ids.
    """

    warn_after_seconds: float = DEFAULT_WARN_AFTER_SECONDS
    require_marker: bool = True
    mode = "snapshot-horizon"

    def __post_init__(self) -> None:
        _check_seconds("warn_after_seconds", self.warn_after_seconds)

    def guarantee(self, dialect: str) -> str:
        del dialect
        return (
            "exact: only rows of transactions that ended before every still-running "
            "transaction began (pg_snapshot_xmin, same statement); long transactions hold "
            "the poller back"
        )

    def activate(self, target: GuardTarget) -> ActiveGuard:
        if target.dialect != "postgresql":
            raise ConfigurationError(
                f"SnapshotHorizon needs PostgreSQL 13+, not {target.dialect!r}; use "
                "SafetyWindow(...) or see docs/visibility.md"
            )
        marked = (target.cursor_comment or "").startswith(XID_COLUMN_MARKER)
        if target.table_mode and self.require_marker and not marked:
            raise ConfigurationError(
                f"cursor column {target.cursor_name!r} of {target.source_name} is not a "
                "transaction-id column (no dbtrigger:xid8 comment); create it with "
                "install_visibility_trigger(), or pass SnapshotHorizon(require_marker=False) "
                "if it holds pg_current_xact_id() of the writing transaction"
            )
        return _SnapshotActive(self, target)


@dataclass(frozen=True)
class TransactionHorizon(VisibilityGuard):
    """PostgreSQL, exact for cursor values assigned by the database inside the writer.

    Each fetch (1) probes the highest visible cursor value ``M`` and the clock
    ``t`` after that snapshot, (2) reads the start of the oldest open transaction
    in this database from ``pg_stat_activity`` (a fresh transaction, after the
    probe), and (3) reads rows up to the newest probe whose ``t`` precedes that
    oldest start. Any cursor value ``<= M`` was taken by a transaction that began
    before ``t``; once none of those is open, all of them are committed (visible
    to the row read, which starts after step 2) or rolled back.

    Holds for values that grow with the database clock across sessions:
    ``DEFAULT now()``, ``now()``/``clock_timestamp()`` in the writer or a trigger,
    a sequence with ``CACHE 1`` (the default). Not for application-clock
    timestamps or cached sequences - use :class:`SafetyWindow` or a
    transaction-id cursor there. Prepared (two-phase) transactions hold the
    poller back until they finish.

    Args:
        warn_after_seconds: log a WARNING naming the oldest open backend once
            rows have been held back this long.
        settle_seconds: when the oldest open transaction began shortly before
            the new probe (less than this long before), re-read
            ``pg_stat_activity`` every 10 ms for up to this long before settling
            for an older probe. Short transactions (writers, other pollers,
            other applications' reads) end within milliseconds, so this turns
            "nothing until the next tick" into "everything committed so far";
            an older open transaction is a long one, and is not waited for.
    """

    warn_after_seconds: float = DEFAULT_WARN_AFTER_SECONDS
    settle_seconds: float = 0.5
    mode = "transaction-horizon"

    def __post_init__(self) -> None:
        _check_seconds("warn_after_seconds", self.warn_after_seconds)
        _check_seconds("settle_seconds", self.settle_seconds)

    def guarantee(self, dialect: str) -> str:
        del dialect
        return (
            "exact for cursor values the database assigns inside the writing transaction "
            "(now(), clock_timestamp(), uncached sequences): a value is consumed only after "
            "every transaction open when it was observed has ended; needs pg_read_all_stats; "
            "long transactions hold the poller back"
        )

    def activate(self, target: GuardTarget) -> ActiveGuard:
        if target.dialect != "postgresql":
            raise ConfigurationError(
                f"TransactionHorizon needs PostgreSQL, not {target.dialect!r}; "
                "use SafetyWindow(...)"
            )
        return _ActivityActive(self, target)


# --- choosing a guard ---------------------------------------------------------


def parse_visibility(value: str | VisibilityGuard | None) -> str | VisibilityGuard:
    """Validate the ``visibility=`` argument: ``"auto"``, ``"none"`` or a guard."""
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return NoGuard()
    if isinstance(value, VisibilityGuard):
        return value
    raise ConfigurationError(
        f"visibility must be 'auto', 'none' or a guard (SnapshotHorizon(), "
        f"TransactionHorizon(), SafetyWindow(seconds)), got {value!r}"
    )


def is_timestamp_type(type_: sa.types.TypeEngine[Any] | None) -> bool:
    return isinstance(type_, sa.DateTime)


def choose(
    dialect: str,
    *,
    cursor_type: sa.types.TypeEngine[Any] | None,
    cursor_comment: str | None,
    sample_is_timestamp: bool | None,
) -> VisibilityGuard:
    """The guard ``auto`` picks: the strongest the dialect and cursor support.

    ``sample_is_timestamp`` is the answer of a one-row probe in query mode
    (where no declared type is known); None when no row exists yet.
    """
    if dialect == "postgresql":
        if (cursor_comment or "").startswith(XID_COLUMN_MARKER):
            return SnapshotHorizon()
        return TransactionHorizon()
    timestamp = is_timestamp_type(cursor_type) if cursor_type is not None else sample_is_timestamp
    if dialect in WINDOW_DIALECTS and timestamp:
        return SafetyWindow()
    if dialect == "sqlite":
        return NoGuard(
            reason="SQLite runs one writer at a time, so values assigned inside the write "
            "transaction become visible in order; application-assigned non-timestamp "
            "cursors are not protected"
        )
    if dialect in WINDOW_DIALECTS:
        return NoGuard(
            reason=f"a non-timestamp cursor on {dialect} has no clock to wait on; use "
            "SafetyWindow(time_column=...) with a timestamp set on write"
        )
    return NoGuard(reason=f"no visibility guard for dialect {dialect!r}; see docs/visibility.md")


# --- safety window ------------------------------------------------------------


def window_predicate(
    guard: SafetyWindow,
    dialect: str,
    column: ColumnElement[Any],
    column_type: sa.types.TypeEngine[Any] | None,
) -> ColumnElement[bool]:
    """``column < <database clock> - window`` in the dialect's own SQL.

    The clock is read by the database in the fetch statement itself, so the
    bound and the snapshot the rows come from belong to the same statement.
    """
    seconds = float(guard.seconds)
    if dialect == "postgresql":
        aware = isinstance(column_type, sa.DateTime) and bool(column_type.timezone)
        clock: ColumnElement[Any] = sa.func.statement_timestamp()
        if guard.utc and not aware:
            clock = sa.func.timezone("UTC", clock)
        window = sa.literal(dt.timedelta(seconds=seconds), sa.Interval())
        return column < clock - window
    if dialect in ("mysql", "mariadb"):
        now = sa.func.utc_timestamp(6) if guard.utc else sa.func.now(6)
        micros = sa.literal(-round(seconds * 1_000_000), sa.BigInteger())
        return column < sa.func.timestampadd(sa.literal_column("MICROSECOND"), micros, now)
    if dialect == "sqlite":
        # SQLite keeps timestamps as text in the writer's format ('T' or ' ',
        # with or without fractions or 'Z'); julianday() reads all of them, a
        # text comparison would not. 'now' is UTC, as CURRENT_TIMESTAMP writes.
        days = sa.literal(seconds / 86400.0, sa.Float())
        return sa.func.julianday(column) < sa.func.julianday("now") - days
    if dialect == "mssql":
        aware = isinstance(column_type, sa.DateTime) and bool(column_type.timezone)
        if aware:
            clock = sa.func.sysdatetimeoffset()
        else:
            clock = sa.func.sysutcdatetime() if guard.utc else sa.func.sysdatetime()
        millis = sa.literal(-round(seconds * 1000), sa.Integer())
        return column < sa.func.dateadd(sa.literal_column("millisecond"), millis, clock)
    raise ConfigurationError(f"no safety-window expression for dialect {dialect!r}")


class _WindowActive(ActiveGuard):
    mode = "safety-window"

    def __init__(
        self, guard: SafetyWindow, target: GuardTarget, predicate: ColumnElement[bool]
    ) -> None:
        super().__init__(guard, target)
        self._predicate = predicate
        self.last_info = FetchInfo(mode=self.mode)

    def before_fetch(self, conn: Connection, after: Position) -> ColumnElement[bool] | None:
        del conn, after
        return self._predicate


# --- held-back bookkeeping shared by the two horizons -------------------------


class _Warner:
    """Rate-limits the held-back WARNING and logs (INFO) when the hold ends.

    "Held back" is measured as the *staleness of the horizon*: how long the
    oldest withheld data has been waiting. Under a steady write load the
    horizon trails by about one fetch and keeps moving; only a transaction that
    stays open makes the staleness grow.
    """

    def __init__(self, target: GuardTarget, mode: str, warn_after: float) -> None:
        self.target = target
        self.mode = mode
        self.warn_after = warn_after
        self.warned = False
        self.last_warning = -math.inf

    def observe(self, info: FetchInfo) -> None:
        fields = {
            "source": self.target.source_name,
            "mode": self.mode,
            "held_back_seconds": info.held_back_seconds,
            "blocking_pid": info.blocking_pid,
            "blocking_xact_age_seconds": info.blocking_xact_age_seconds,
            "blocking_detail": info.blocking_detail,
            "horizon": None if info.horizon is None else str(info.horizon),
        }
        if not info.held_back or info.held_back_seconds < self.warn_after:
            if self.warned:
                self.warned = False
                self.last_warning = -math.inf
                log.info(
                    "%s: %s is no longer held back",
                    self.target.source_name,
                    self.mode,
                    extra={"event": "visibility_released", **fields},
                )
            return
        now = time.monotonic()
        if now - self.last_warning < self.warn_after:
            return
        self.last_warning = now
        self.warned = True
        if info.blocking_detail:
            blocker = info.blocking_detail
        elif info.blocking_pid is not None:
            age = info.blocking_xact_age_seconds or 0.0
            blocker = f"backend pid {info.blocking_pid} (transaction open {age:.0f}s)"
        else:
            blocker = "a transaction this role cannot identify"
        log.warning(
            "%s: %s has held rows back for %.0fs, blocked by %s; the poller resumes when it "
            "ends (rows are delayed, not skipped)",
            self.target.source_name,
            self.mode,
            info.held_back_seconds,
            blocker,
            extra={"event": "visibility_held_back", **fields},
        )


def _greater(a: Any, b: Any) -> bool:
    """``a > b``, treating None as minus infinity and incomparable values as greater."""
    if a is None:
        return False
    if b is None:
        return True
    try:
        return bool(a > b)
    except TypeError:
        return True


# --- snapshot horizon (transaction-id cursor) ---------------------------------


def _snapshot_xmin() -> ColumnElement[Any]:
    """``pg_snapshot_xmin(pg_current_snapshot())`` as a bigint (xid8 -> text -> bigint).

    Stable within a statement, so PostgreSQL uses it as an index bound; the
    64-bit xid8 (epoch and xid) always fits a bigint.
    """
    xmin = sa.func.pg_snapshot_xmin(sa.func.pg_current_snapshot())
    return sa.cast(sa.cast(xmin, sa.Text()), sa.BigInteger())


_BLOCKING_XID_SQL = sa.text(
    """
    SELECT pid,
           EXTRACT(EPOCH FROM clock_timestamp() - xact_start) AS age,
           NULL AS gid
      FROM pg_stat_activity
     WHERE backend_xid IS NOT NULL AND backend_xid::text = :xid
    UNION ALL
    SELECT NULL, EXTRACT(EPOCH FROM clock_timestamp() - prepared), gid
      FROM pg_prepared_xacts
     WHERE transaction::text = :xid
    LIMIT 1
    """
)


class _SnapshotActive(ActiveGuard):
    mode = "snapshot-horizon"

    def __init__(self, guard: SnapshotHorizon, target: GuardTarget) -> None:
        super().__init__(guard, target)
        self._warner = _Warner(target, self.mode, guard.warn_after_seconds)
        self._horizon: int | None = None
        self._horizon_since = time.monotonic()
        self.last_info = FetchInfo(mode=self.mode)

    def before_fetch(self, conn: Connection, after: Position) -> ColumnElement[bool] | None:
        del conn, after
        return self.target.cursor < _snapshot_xmin()

    def after_fetch(
        self,
        conn: Connection,
        after: Position,
        rows: Sequence[Mapping[str, Any]],
        limit: int,
    ) -> FetchInfo:
        if len(rows) >= limit:
            # A full batch: the horizon did not cut it short; the next fetch reports.
            return self.last_info
        # Reporting only (a later snapshot than the fetch): is anything withheld,
        # and which transaction is the horizon?
        position = after if not rows else self.target.position_of(rows[-1])
        horizon = _snapshot_xmin()
        withheld = sa.exists(self.target.pending(position).where(self.target.cursor >= horizon))
        row = conn.execute(sa.select(horizon.label("h"), withheld.label("w"))).one()
        xmin, held = int(row.h), bool(row.w)
        now = time.monotonic()
        if xmin != self._horizon:
            self._horizon, self._horizon_since = xmin, now
        pid = age = detail = None
        if held:
            found = conn.execute(_BLOCKING_XID_SQL, {"xid": str(xmin % 2**32)}).first()
            if found is not None:
                pid = found.pid
                age = None if found.age is None else float(found.age)
                if found.gid is not None:
                    detail = f"prepared transaction {found.gid!r}"
        conn.rollback()
        info = FetchInfo(
            mode=self.mode,
            horizon=xmin,
            held_back=held,
            held_back_seconds=(now - self._horizon_since) if held else 0.0,
            blocking_pid=pid,
            blocking_xact_age_seconds=age,
            blocking_detail=detail,
        )
        self._warner.observe(info)
        self.last_info = info
        return info


# --- transaction horizon (pg_stat_activity) -----------------------------------

_ACTIVITY_SQL = sa.text(
    """
    WITH act AS (
        SELECT pid, xact_start, backend_type, usesysid
          FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
    ), open AS (
        SELECT pid, xact_start FROM act
         WHERE xact_start IS NOT NULL
           AND backend_type NOT IN :non_writing
    ), prepared AS (
        SELECT gid, prepared FROM pg_prepared_xacts WHERE database = current_database()
    )
    SELECT (SELECT min(xact_start) FROM open) AS oldest_start,
           (SELECT pid FROM open ORDER BY xact_start LIMIT 1) AS oldest_pid,
           (SELECT count(*) FROM act
             WHERE backend_type IS NULL AND usesysid IS NOT NULL) AS hidden,
           (SELECT gid FROM prepared ORDER BY prepared LIMIT 1) AS prepared_gid,
           (SELECT min(prepared) FROM prepared) AS prepared_at,
           pg_is_in_recovery() AS standby,
           clock_timestamp() AS now
    """
).bindparams(sa.bindparam("non_writing", value=list(_NON_WRITING_BACKENDS), expanding=True))


@dataclass(frozen=True)
class _Probe:
    at: dt.datetime  # database clock, read after the probe's snapshot was taken
    value: Any  # the highest cursor visible in that snapshot


@dataclass
class _ProbeState:
    safe: _Probe | None = None
    pending: list[_Probe] = field(default_factory=list)


class _ActivityActive(ActiveGuard):
    mode = "transaction-horizon"

    def __init__(self, guard: TransactionHorizon, target: GuardTarget) -> None:
        super().__init__(guard, target)
        self._state = _ProbeState()
        self._lock = threading.Lock()
        self._warner = _Warner(target, self.mode, guard.warn_after_seconds)
        self.last_info = FetchInfo(mode=self.mode)
        self._next_info: FetchInfo | None = None

    def _probe(self, conn: Connection) -> _Probe | None:
        """The highest visible cursor, and the database clock read after its snapshot."""
        stmt = sa.select(sa.func.max(self.target.cursor), sa.func.clock_timestamp())
        stmt = stmt.select_from(self.target.selectable)
        if self.target.base_filter is not None:
            stmt = stmt.where(self.target.base_filter)
        value, at = conn.execute(stmt).one()
        conn.rollback()  # the activity read must be a new transaction, after this one
        return None if value is None else _Probe(at=at, value=value)

    def _activity(self, conn: Connection) -> Any:
        # pg_stat_activity is not transactional: it says what is open *now*
        # (after the probe), and it is read once per transaction, so each read
        # gets a transaction of its own.
        activity = conn.execute(_ACTIVITY_SQL).one()
        conn.rollback()
        return activity

    def _worth_waiting_for(self, probe: _Probe | None, after: Position) -> bool:
        if probe is None:
            return False
        with self._lock:
            return _greater(probe.value, _value(self._state.safe)) and _greater(
                probe.value, after.cursor
            )

    def before_fetch(self, conn: Connection, after: Position) -> ColumnElement[bool] | None:
        probe = self._probe(conn)
        activity = self._activity(conn)
        settle = cast("TransactionHorizon", self.guard).settle_seconds
        deadline = time.monotonic() + settle
        young = dt.timedelta(seconds=settle)
        while (
            probe is not None
            and not activity.hidden
            and activity.prepared_gid is None
            and activity.oldest_start is not None
            and probe.at - young < activity.oldest_start <= probe.at
            and time.monotonic() < deadline
            and self._worth_waiting_for(probe, after)
        ):
            time.sleep(0.01)
            activity = self._activity(conn)
        # The row read below starts a new transaction, so its snapshot is taken
        # after the last activity read.
        if activity.standby:
            raise ConfigurationError(
                f"{self.target.source_name}: TransactionHorizon cannot run on a standby: the "
                "primary's open transactions are not in the standby's pg_stat_activity. Poll "
                "the primary, or use a transaction-id cursor (SnapshotHorizon; a standby's "
                "snapshot tracks the primary's running transaction ids), or a SafetyWindow "
                "larger than the longest transaction plus the replication lag"
            )
        if activity.hidden:
            raise ConfigurationError(
                f"{self.target.source_name}: the visibility guard cannot see "
                f"{activity.hidden} session(s) of other roles in pg_stat_activity, so it "
                "cannot tell whether their transactions are still open. GRANT "
                "pg_read_all_stats to the polling role, or use a transaction-id cursor "
                "(install_visibility_trigger + SnapshotHorizon, no privilege needed), or "
                "choose SafetyWindow(...) / visibility='none' explicitly"
            )
        info = self._advance(probe, activity, after)
        self._next_info = info
        if info.horizon is None:
            return sa.false()
        return self.target.cursor <= self.target.bind(info.horizon)

    def _advance(self, probe: _Probe | None, activity: Any, after: Position) -> FetchInfo:
        """Promote the probes every transaction open at their time has outlived."""
        # Every transaction open now started at or after `cut`. A prepared
        # transaction's start is unknown, so it keeps every pending probe pending.
        cut: dt.datetime | None = activity.oldest_start
        prepared = activity.prepared_gid is not None
        with self._lock:
            state = self._state
            newest = state.pending[-1].value if state.pending else _value(state.safe)
            if probe is not None and _greater(probe.value, newest):
                state.pending.append(probe)
            while state.pending and not prepared and (cut is None or state.pending[0].at < cut):
                state.safe = state.pending.pop(0)
            if len(state.pending) > _MAX_PENDING_PROBES:
                # Fewer probes only make the bound more conservative.
                state.pending = [*state.pending[:-1:2], state.pending[-1]]
            bound = _value(state.safe)
            held = bool(state.pending) and _greater(state.pending[-1].value, after.cursor)
            if not held:
                return FetchInfo(mode=self.mode, horizon=bound)
            waiting = max(0.0, (activity.now - state.pending[0].at).total_seconds())
        if prepared:
            age = (activity.now - activity.prepared_at).total_seconds()
            detail = f"prepared transaction {activity.prepared_gid!r}"
            return FetchInfo(self.mode, bound, True, waiting, None, age, detail)
        age = None if cut is None else (activity.now - cut).total_seconds()
        return FetchInfo(self.mode, bound, True, waiting, activity.oldest_pid, age)

    def after_fetch(
        self,
        conn: Connection,
        after: Position,
        rows: Sequence[Mapping[str, Any]],
        limit: int,
    ) -> FetchInfo:
        del conn, after, rows, limit
        info = self._next_info or FetchInfo(mode=self.mode)
        self._warner.observe(info)
        self.last_info = info
        return info


def _value(probe: _Probe | None) -> Any:
    return None if probe is None else probe.value


# --- the transaction-id column ------------------------------------------------


def visibility_trigger_ddl(
    table: str,
    *,
    schema: str | None = None,
    column: str = "dbtrigger_xid",
    index_columns: Sequence[str] = (),
    quote: Callable[[str], str] | None = None,
) -> list[str]:
    """The PostgreSQL DDL :func:`install_visibility_trigger` runs, for migrations.

    Adds ``column bigint NOT NULL DEFAULT 0`` (existing rows get 0: they were
    committed long ago and sort first; no table rewrite), a function and a
    ``BEFORE INSERT OR UPDATE`` trigger that stamp ``pg_current_xact_id()`` of the
    writing transaction, the marker comment ``auto`` looks for, and an index on
    ``(column, *index_columns)`` (pass the primary key: the fetch orders by it).
    Idempotent. PostgreSQL 13+.
    """
    validate_sql_identifier(table, "table")
    validate_sql_identifier(column, "visibility column")
    if schema is not None:
        validate_sql_identifier(schema, "schema")
    for name in index_columns:
        validate_sql_identifier(name, "index column")
    q = quote or (lambda name: '"' + name + '"')
    prefix = q(schema) + "." if schema else ""
    target = prefix + q(table)
    function = prefix + q(_short(f"dbtrigger_stamp_{table}_{column}"))
    trigger = q(_short(f"dbtrigger_stamp_{column}"))
    index = q(_short(f"ix_{table}_{column}"))
    col = q(column)
    index_list = ", ".join([col, *(q(c) for c in index_columns)])
    marker = f"{XID_COLUMN_MARKER} transaction id of the last writer, stamped by trigger {trigger}"
    return [
        "ALTER TABLE " + target + " ADD COLUMN IF NOT EXISTS " + col + " bigint NOT NULL DEFAULT 0",
        "CREATE OR REPLACE FUNCTION " + function + "() RETURNS trigger LANGUAGE plpgsql AS $f$\n"
        "BEGIN\n"
        "    NEW." + col + " := pg_current_xact_id()::text::bigint;\n"
        "    RETURN NEW;\n"
        "END\n"
        "$f$",
        "DROP TRIGGER IF EXISTS " + trigger + " ON " + target,
        "CREATE TRIGGER "
        + trigger
        + " BEFORE INSERT OR UPDATE ON "
        + target
        + " FOR EACH ROW EXECUTE FUNCTION "
        + function
        + "()",
        "COMMENT ON COLUMN " + target + "." + col + " IS '" + marker.replace("'", "''") + "'",
        "CREATE INDEX IF NOT EXISTS " + index + " ON " + target + " (" + index_list + ")",
    ]


def _short(name: str) -> str:
    """PostgreSQL truncates identifiers at 63 bytes; keep generated names unique by hashing."""
    if len(name) <= 63:
        return name
    return name[:54] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]


def install_visibility_trigger(
    engine: Engine,
    table: str,
    *,
    schema: str | None = None,
    column: str = "dbtrigger_xid",
    index_columns: Sequence[str] = (),
) -> str:
    """Add and maintain a transaction-id column on a PostgreSQL table; returns its name.

    Poll it with ``SqlAlchemySource(cursor_column=column, pk_columns=[...])``;
    ``auto`` then chooses :class:`SnapshotHorizon`. Runs
    :func:`visibility_trigger_ddl` in one transaction. Needs the privilege to
    alter the table and create a function.
    """
    if engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"the transaction-id trigger is PostgreSQL-only, not {engine.dialect.name!r}"
        )
    quote = engine.dialect.identifier_preparer.quote
    statements = visibility_trigger_ddl(
        table, schema=schema, column=column, index_columns=index_columns, quote=quote
    )
    with engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
    return column
