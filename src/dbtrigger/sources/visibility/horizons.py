"""PostgreSQL horizons: exact guards that wait for open transactions to end.

:class:`SnapshotHorizon` bounds a transaction-id cursor by the snapshot's
``xmin`` in the fetch statement itself; :class:`TransactionHorizon` probes the
highest visible cursor and consumes up to it once every transaction open at the
probe has ended (``pg_stat_activity``). Both report, and warn about, the
backend that holds them back.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.sources.visibility.base import (
    NOTHING,
    XID_COLUMN_MARKER,
    ActiveGuard,
    BoundPredicates,
    FetchCondition,
    FetchInfo,
    GuardTarget,
    Rows,
    _check_seconds,
)
from dbtrigger.sources.visibility.held_back import HorizonActive, HorizonGuard, greater

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

#: :class:`TransactionHorizon`'s ``settle_seconds`` on PostgreSQL when none is given.
PG_SETTLE_SECONDS = 0.5


@dataclass(frozen=True)
class SnapshotHorizon(HorizonGuard):
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

    require_marker: bool = True
    mode = "snapshot-horizon"
    promise = (
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
class TransactionHorizon(HorizonGuard):
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
            Default 0.5 s. On MariaDB/MySQL it is :class:`MariaDbHorizon`'s
            ``settle_seconds`` (default 2 s there: its observations are at
            least 100 ms apart).
    """

    settle_seconds: float | None = None
    mode = "transaction-horizon"
    promise = (
        "exact for cursor values the database assigns inside the writing transaction "
        "(now(), clock_timestamp(), uncached sequences): a value is consumed only after "
        "every transaction open when it was observed has ended; needs pg_read_all_stats; "
        "long transactions hold the poller back"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.settle_seconds is not None:
            _check_seconds("settle_seconds", self.settle_seconds)

    def activate(self, target: GuardTarget) -> ActiveGuard:
        if target.dialect in ("mysql", "mariadb"):
            # The same promise on MariaDB/MySQL, kept by other means (INNODB_TRX),
            # with the caller's settings (a settle_seconds given here used to be
            # dropped for MariaDbHorizon's own default).
            from dbtrigger.sources.visibility.mariadb import MariaDbHorizon  # noqa: PLC0415

            warn = self.warn_after_seconds
            if self.settle_seconds is None:
                return MariaDbHorizon(warn_after_seconds=warn).activate(target)
            settle = self.settle_seconds
            return MariaDbHorizon(warn_after_seconds=warn, settle_seconds=settle).activate(target)
        if target.dialect != "postgresql":
            raise ConfigurationError(
                f"TransactionHorizon needs PostgreSQL, MariaDB or MySQL, not {target.dialect!r}; "
                "use SafetyWindow(...)"
            )
        return _ActivityActive(self, target)


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


class _SnapshotActive(HorizonActive):
    mode = "snapshot-horizon"

    def __init__(self, guard: SnapshotHorizon, target: GuardTarget) -> None:
        super().__init__(guard, target)
        self._horizon: int | None = None
        self._horizon_since = time.monotonic()
        # The bound is computed by the fetch statement itself: one predicate for good.
        self._condition = FetchCondition(target.cursor < _snapshot_xmin())

    def before_fetch(self, conn: Connection, after: Position) -> FetchCondition | None:
        del conn, after
        return self._condition

    def after_fetch(self, conn: Connection, after: Position, rows: Rows, limit: int) -> FetchInfo:
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
        # The xmin does not move while nothing runs: after an idle sleep a new
        # writer's transaction takes the very id it stood at, and the time since
        # it last moved is the whole sleep. _reported bounds it by the last report
        # that found nothing held and by the blocking transaction's age (a
        # prepared one's counts from its PREPARE only: no bound).
        info = FetchInfo(
            mode=self.mode,
            horizon=xmin,
            held_back=held,
            held_back_seconds=(now - self._horizon_since) if held else 0.0,
            blocking_pid=pid,
            blocking_xact_age_seconds=age,
            blocking_detail=detail,
        )
        return self._reported(info, blocker_age_bounds=detail is None)


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


class _ActivityActive(HorizonActive):
    mode = "transaction-horizon"

    def __init__(self, guard: TransactionHorizon, target: GuardTarget) -> None:
        super().__init__(guard, target)
        self._state = _ProbeState()
        self._lock = threading.Lock()
        self._next_info: FetchInfo | None = None
        # The bound (the newest safe probe) stays valid for good: every value
        # at or below it is committed or rolled back. So a fetch only probes
        # again when the previous one reached the bound (returned a short
        # batch, or a full one that ended at it); a catch-up of full batches
        # pays the probe once.
        self._stale = True
        self._bounded = BoundPredicates(lambda value: target.cursor <= target.bind_bound(value))

    def _probe(self, conn: Connection) -> _Probe | None:
        """The highest visible cursor, and the database clock read after its snapshot."""
        stmt = self.target.over_rows(sa.func.max(self.target.cursor), sa.func.clock_timestamp())
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
            return greater(probe.value, _value(self._state.safe)) and greater(
                probe.value, after.cursor
            )

    def before_fetch(self, conn: Connection, after: Position) -> FetchCondition | None:
        with self._lock:
            cached = None if self._stale else self._state.safe
        # A full batch that ended exactly at the bound leaves nothing below it: a
        # fetch with it would find nothing and report nothing held back, and the
        # worker would sleep its interval while rows committed since wait.
        if cached is not None and greater(cached.value, after.cursor):
            self._next_info = None
            return self._bounded(cached.value)
        probe = self._probe(conn)
        activity = self._activity(conn)
        given = cast("TransactionHorizon", self.guard).settle_seconds
        settle = PG_SETTLE_SECONDS if given is None else given
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
        with self._lock:
            self._stale = False
        if info.horizon is None:
            return FetchCondition(NOTHING)
        return self._bounded(info.horizon)

    def _advance(self, probe: _Probe | None, activity: Any, after: Position) -> FetchInfo:
        """Promote the probes every transaction open at their time has outlived."""
        # Every transaction open now started at or after `cut`. A prepared
        # transaction's start is unknown, so it keeps every pending probe pending.
        cut: dt.datetime | None = activity.oldest_start
        prepared = activity.prepared_gid is not None
        with self._lock:
            state = self._state
            newest = state.pending[-1].value if state.pending else _value(state.safe)
            if probe is not None and greater(probe.value, newest):
                state.pending.append(probe)
            while state.pending and not prepared and (cut is None or state.pending[0].at < cut):
                state.safe = state.pending.pop(0)
            if len(state.pending) > _MAX_PENDING_PROBES:
                # Fewer probes only make the bound more conservative.
                state.pending = [*state.pending[:-1:2], state.pending[-1]]
            bound = _value(state.safe)
            held = bool(state.pending) and greater(state.pending[-1].value, after.cursor)
            if not held:
                return FetchInfo(mode=self.mode, horizon=bound)
            waiting = max(0.0, (activity.now - state.pending[0].at).total_seconds())
        if prepared:
            age = (activity.now - activity.prepared_at).total_seconds()
            detail = f"prepared transaction {activity.prepared_gid!r}"
            return FetchInfo(self.mode, bound, True, waiting, None, age, detail)
        age = None if cut is None else (activity.now - cut).total_seconds()
        return FetchInfo(self.mode, bound, True, waiting, activity.oldest_pid, age)

    def after_fetch(self, conn: Connection, after: Position, rows: Rows, limit: int) -> FetchInfo:
        del conn, after
        if len(rows) < limit:
            with self._lock:
                self._stale = True
        if self._next_info is None:  # the cached bound: nothing new to report
            return self.last_info
        info = self._next_info
        # A prepared transaction's age counts from its PREPARE only: no bound.
        return self._reported(info, blocker_age_bounds=info.blocking_detail is None)


def _value(probe: _Probe | None) -> Any:
    return None if probe is None else probe.value
