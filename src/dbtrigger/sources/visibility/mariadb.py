"""MariaDB/MySQL transaction horizon: a lossless bound from ``innodb_trx``.

A row written by a transaction that is still open carries a cursor value the
poller must not pass. InnoDB lists open transactions in
``information_schema.INNODB_TRX`` (PROCESS privilege) and the server lists
running statements in ``information_schema.PROCESSLIST``; together they bound
what any transaction can still commit:

* **Statement-time timestamps** (``DEFAULT``/``ON UPDATE CURRENT_TIMESTAMP(n)``,
  ``NOW(n)`` in the writing statement): the value is the *statement's start*,
  read from the server clock when the statement was dispatched. A row that may
  still commit was written by a statement that is running now, or by an open
  transaction that has already written (``trx_rows_modified > 0``), or by a
  statement that starts later. So the bound is the earliest of: the clock now,
  the start of every running statement, and a lower bound for the statements
  of every open writing transaction.
* **AUTO_INCREMENT**: values are allocated from one counter in time order. A
  sample ``(t, M)`` - the highest visible id ``M``, then the clock ``t`` - says
  every id ``<= M`` was allocated before ``t``. Once every writer that could
  have allocated before ``t`` has ended, ``M`` is final: the bound is the newest
  such sample (and nothing at all before the first one qualifies).

Why not simply ``trx_started``: it has one-second resolution, it is InnoDB's
start, which comes *after* the first statement's clock reading (a statement can
wait on a metadata lock for as long as a ``LOCK TABLES`` or a backup's
``FLUSH TABLES WITH READ LOCK`` lasts before it touches InnoDB), and the table
is a cache that InnoDB refreshes at most every 100 ms. The guard instead
carries what it learnt from one observation to the next (a writer new since
the last observation wrote after that observation began, or was a running
statement then), and checks that each observation's cache is newer than its
own process-list read (reading it in turns with the other guards of the
server: :mod:`.innodb_trx`). A writer already open at the guard's first observation
has no such history: it holds the bound where it is until it ends. The
argument in full is in ``docs/visibility.md``.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import threading
import time
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ColumnElement

from dbtrigger import options as opt
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.sources.visibility.base import (
    BOUND_PARAMETER,
    NOTHING,
    ActiveGuard,
    BoundPredicates,
    FetchCondition,
    FetchInfo,
    GuardTarget,
    Rows,
    _check_seconds,
)
from dbtrigger.sources.visibility.held_back import HorizonActive, HorizonGuard, greater, log
from dbtrigger.sources.visibility.innodb_trx import (
    CACHE_SECONDS,
    Observation,
    Observed,
    Writer,
    observe,
)

MYSQL_DIALECTS = frozenset({"mysql", "mariadb"})

#: Samples kept for an AUTO_INCREMENT cursor (older ones are only ever needed
#: while a transaction older than all of them is open; keeping fewer only makes
#: the bound more conservative).
_MAX_SAMPLES = 64

#: A fetch this close to the next fresh observation InnoDB's cache allows
#: waits for it rather than keeping the bound, which cost one more held-back
#: wait (50-110 ms) on a steady writer's rows: the runner's wait that ends with
#: a held second often ends a few milliseconds inside the cache's 100 ms, and
#: its 50 ms wait after the fetch that follows a delivery left ~50 ms of it
#: (one fresh observation per ~175 ms instead of ~115: the change log's
#: AUTO_INCREMENT bound, one observation behind, and ``precision=6`` waited
#: that much longer).
WAIT_OUT_SECONDS = 0.06

#: A cache found stale for this long is reported at WARNING (and again at
#: ``warn_after_seconds`` intervals while it lasts).
STALE_WARN_SECONDS = 10.0

# (LIMIT 0 would skip the privilege check.)
_CAN_READ_TRX = sa.text("SELECT COUNT(*) FROM information_schema.INNODB_TRX")
_ACCESS_DENIED = 1227


def can_read_transactions(conn: Connection) -> bool:
    """Whether this account can read ``INNODB_TRX`` (it needs the PROCESS privilege).

    Ends the connection's transaction either way.
    """
    try:
        conn.execute(_CAN_READ_TRX).all()
    except DBAPIError:
        conn.rollback()
        return False
    conn.rollback()
    return True


@dataclass(frozen=True)
class MariaDbHorizon(HorizonGuard):
    """MariaDB/MySQL, exact for cursor values the server assigns when a statement runs.

    Reads open transactions from ``information_schema.INNODB_TRX`` and running
    statements from ``PROCESSLIST`` (the PROCESS privilege) and consumes only
    cursor values no open transaction can still commit:

    * a ``DATETIME``/``TIMESTAMP`` cursor set by ``CURRENT_TIMESTAMP``/``NOW()``
      in the writing statement (``DEFAULT``, ``ON UPDATE`` or the SQL itself);
    * an ``AUTO_INCREMENT`` cursor.

    Not for values the application computes (its own clock, its own ids), nor
    ``SET TIMESTAMP``, replication appliers or Galera writers on other nodes.
    Read-only transactions, and transactions that have not written yet, do not
    hold it back; a running statement holds it back (at its start) until it
    ends, whatever it does.

    Args:
        warn_after_seconds: log a WARNING naming the blocking transaction once
            rows have been held back this long.
        precision: fractional digits of the writers' timestamps. The bound is
            truncated to it; 0 (the default) is safe for ``NOW()`` and
            ``NOW(6)`` alike, 6 shortens the delay when every writer uses
            ``NOW(6)``/``CURRENT_TIMESTAMP(6)``.
        utc: the naive timestamps are UTC (``UTC_TIMESTAMP()``) while the
            poller's session has another time zone.
        settle_seconds: while there is no bound yet (the first fetch of an
            AUTO_INCREMENT cursor needs two to three observations on a busy
            server), re-observe every ~110 ms for up to this long before
            settling for no rows on this fetch.
    """

    precision: int = 0
    utc: bool = False
    settle_seconds: float = 2.0
    mode = "transaction-horizon"
    promise = (
        "exact for cursor values the server assigns when the writing statement runs "
        "(CURRENT_TIMESTAMP/NOW(), AUTO_INCREMENT): a value is consumed only once no open "
        "transaction or running statement can still commit one below it (innodb_trx, "
        "PROCESS privilege); long write transactions hold the poller back"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_seconds("settle_seconds", self.settle_seconds)
        opt.whole("precision", self.precision, minimum=0, maximum=6)  # fractional digits

    def strength(self, dialect: str) -> str:
        del dialect
        return "exact"

    def activate(self, target: GuardTarget) -> ActiveGuard:
        if target.dialect not in MYSQL_DIALECTS:
            raise ConfigurationError(
                f"MariaDbHorizon needs MariaDB or MySQL, not {target.dialect!r}; use "
                "TransactionHorizon() on PostgreSQL or SafetyWindow(...)"
            )
        timestamp = isinstance(target.cursor_type, sa.DateTime)
        if target.cursor_type is not None and not timestamp:
            if not isinstance(target.cursor_type, sa.Integer):
                raise ConfigurationError(
                    f"MariaDbHorizon needs a DATETIME/TIMESTAMP or AUTO_INCREMENT cursor; "
                    f"{target.cursor_name!r} of {target.source_name} is {target.cursor_type}"
                )
            if target.table_mode and not is_auto_increment(target):
                raise ConfigurationError(
                    f"cursor column {target.cursor_name!r} of {target.source_name} is an "
                    "integer without AUTO_INCREMENT: values the application assigns have no "
                    "order the server can vouch for; use an AUTO_INCREMENT or a "
                    "CURRENT_TIMESTAMP cursor, or SafetyWindow(time_column=...)"
                )
        return _InnoDbActive(self, target, timestamp=timestamp if target.cursor_type else None)


def is_auto_increment(target: GuardTarget) -> bool:
    """The reflected cursor column is AUTO_INCREMENT (table mode only)."""
    table = target.selectable
    if not isinstance(table, sa.Table) or target.cursor_name not in table.c:
        return False
    return table.c[target.cursor_name].autoincrement is True


@dataclass
class _State:
    last: Observation | None = None
    bound: Any = None  # the consumable limit (epoch for timestamps, id for AUTO_INCREMENT)
    bound_at: Decimal | None = None  # when the bound's data was current (epoch)
    samples: list[tuple[Decimal, Any]] = field(default_factory=list)  # (t, max id)
    stale: bool = True
    blocker: Any = None
    stale_cache: bool = False
    first_seen: float = field(default_factory=time.monotonic)
    held_since: Decimal | None = None  # the first observation of the current hold (epoch)
    last_attempt: float = -math.inf
    observations: int = 0  # fresh ones
    stale_reads: int = 0  # reads of INNODB_TRX that found it not refilled
    stale_observations: int = 0  # observations that ended without a fresh read
    last_fresh: float = field(default_factory=time.monotonic)
    stale_warned: float = -math.inf


class _InnoDbActive(HorizonActive):
    mode = "transaction-horizon"
    # An observation proves InnoDB's cache fresh by finding its own transaction in it.
    autocommit_reads = False

    def __init__(self, guard: MariaDbHorizon, target: GuardTarget, timestamp: bool | None) -> None:
        super().__init__(guard, target)
        self.config = guard
        self._timestamp = timestamp
        self._state = _State()
        self._lock = threading.Lock()
        self._bounded = BoundPredicates(self._bounded_by)
        #: The fetch in progress reads with a bound observed for it (not one kept
        #: from before: after a full batch, or within InnoDB's 100 ms cache).
        self._looked = False

    def _bounded_by(self, bound: Any) -> ColumnElement[bool]:
        """The fetch predicate for a bound like ``bound`` (its value is a parameter)."""
        if self._timestamp:
            epoch = sa.bindparam(BOUND_PARAMETER, bound, sa.Numeric(20, self.config.precision))
            limit: ColumnElement[Any] = sa.func.from_unixtime(epoch)
            if self.config.utc:
                limit = sa.func.convert_tz(limit, sa.text("@@session.time_zone"), "+00:00")
            return self.target.cursor < limit
        return self.target.cursor <= self.target.bind_bound(bound)

    # -- observing --------------------------------------------------------------

    def _max(self, conn: Connection) -> tuple[Any, Decimal | None]:
        value: ColumnElement[Any] = sa.func.max(self.target.cursor)
        columns = [value]
        if self._timestamp:
            columns.append(sa.func.unix_timestamp(value))
        row = conn.execute(self.target.over_rows(*columns)).one()
        if self._timestamp:
            return row[0], None if row[1] is None else Decimal(row[1])
        return row[0], None

    def _read_max(self, conn: Connection) -> tuple[Any, Decimal | None]:
        if self._timestamp is None:
            self._timestamp = isinstance(self._max(conn)[0], dt.datetime)
        return self._max(conn)

    def _refresh(self, conn: Connection) -> bool:
        """Observe; True when a fresh observation was made.

        InnoDB refreshes its transaction cache only when nobody read it for
        100 ms, so observations are at least that far apart: a fetch that
        comes sooner keeps the cached bound (it stays valid), unless the next
        observation is at most :data:`WAIT_OUT_SECONDS` away. Only while there
        is no bound at all does it wait longer and re-observe, for up to
        ``settle_seconds``: an AUTO_INCREMENT cursor needs a sample older than
        every writer open at a later observation, which takes two to three
        observations on a busy server.
        """
        deadline = time.monotonic() + self.config.settle_seconds
        while True:
            with self._lock:
                state = self._state
                previous, bound = state.last, state.bound
                wait = state.last_attempt + CACHE_SECONDS - time.monotonic()
            if wait > 0:
                kept = bound is not None and wait > WAIT_OUT_SECONDS
                if kept or time.monotonic() + wait > deadline:
                    return False
                time.sleep(wait)
            observed = observe(conn, previous, self._read_max)
            observation = observed.observation
            with self._lock:
                state.last_attempt = time.monotonic()
                state.stale_cache = observation is None
                state.stale_reads += observed.stale_reads
                if observation is None:
                    state.stale_observations += 1
                else:
                    state.observations += 1
                    state.last_fresh = state.last_attempt
                    self._advance(state, observation)
                done = state.bound is not None
            self._report_staleness(state, observed)
            if done:
                return observation is not None
            if time.monotonic() + CACHE_SECONDS > deadline:
                return observation is not None

    def _report_staleness(self, state: _State, observed: Observed) -> None:
        """WARNING while INNODB_TRX stays stale: rows are held back, and why."""
        now = time.monotonic()
        with self._lock:
            stale_for = now - state.last_fresh
            if observed.observation is not None:
                warned, state.stale_warned = state.stale_warned > -math.inf, -math.inf
            else:
                warned = False
                interval = max(STALE_WARN_SECONDS, self.config.warn_after_seconds)
                if stale_for < STALE_WARN_SECONDS or now - state.stale_warned < interval:
                    return
                state.stale_warned = now
            fields = {
                "source": self.target.source_name,
                "mode": self.mode,
                "stale_seconds": round(stale_for, 3),
                "stale_reads": state.stale_reads,
                "turn": observed.turn,
            }
        if warned:
            log.info(
                "%s: information_schema.INNODB_TRX is refreshed again",
                self.target.source_name,
                extra={"event": "visibility_trx_cache_fresh", **fields},
            )
        elif observed.observation is None:
            log.warning(
                "%s: %s has found information_schema.INNODB_TRX stale for %.0fs (%d stale "
                "reads): other sessions read it more often than every 100 ms between them "
                "(monitoring tools, or pollers that do not take turns on "
                "GET_LOCK('dbtrigger:innodb_trx')), so InnoDB does not refresh it; rows "
                "after the last bound are held back until a read finds it fresh (delayed, "
                "not skipped)",
                self.target.source_name,
                self.mode,
                stale_for,
                state.stale_reads,
                extra={"event": "visibility_trx_cache_stale", **fields},
            )

    def _advance(self, state: _State, observation: Observation) -> None:
        """Move the bound forward with a new observation (never backward)."""
        cut, blocker = observation.cutoff()
        state.blocker = blocker
        if self._timestamp:
            if cut is not None:
                step = Decimal(1).scaleb(-self.config.precision)
                bound = cut.quantize(step, rounding=decimal.ROUND_FLOOR)
                if state.bound is None or bound > state.bound:
                    state.bound, state.bound_at = bound, bound
        else:
            usable = None
            if cut is not None:
                for sample in state.samples:
                    if sample[0] < cut:
                        usable = sample
            if usable is not None:
                index = state.samples.index(usable)
                del state.samples[:index]
                if usable[1] is not None and greater(usable[1], state.bound):
                    state.bound = usable[1]
                state.bound_at = usable[0]
            state.samples.append((observation.sampled_at, observation.max_value))
            if len(state.samples) > _MAX_SAMPLES:
                # Fewer samples only make the bound more conservative.
                state.samples = [*state.samples[:-1:2], state.samples[-1]]
        state.last = observation

    # -- the fetch --------------------------------------------------------------

    def before_fetch(self, conn: Connection, after: Position) -> FetchCondition | None:
        with self._lock:
            stale = self._state.stale
        if stale:
            try:
                fresh = self._refresh(conn)
            except DBAPIError as exc:
                if _error_code(exc) != _ACCESS_DENIED:
                    raise
                conn.rollback()
                raise ConfigurationError(
                    f"{self.target.source_name}: the MariaDB/MySQL transaction horizon needs "
                    "the PROCESS privilege to read information_schema.INNODB_TRX and every "
                    "session in PROCESSLIST: GRANT PROCESS ON *.* TO the polling account, or "
                    "choose SafetyWindow(...) (bounded) or visibility='none' explicitly"
                ) from exc
            if fresh:
                with self._lock:
                    self._state.stale = False
        self._looked = stale and fresh
        with self._lock:
            bound = self._state.bound
        if bound is None:
            return FetchCondition(NOTHING)
        return self._bounded(bound)

    def after_fetch(self, conn: Connection, after: Position, rows: Rows, limit: int) -> FetchInfo:
        if len(rows) >= limit:
            # A full batch did not reach the bound: keep it (it stays valid, see
            # the module docstring) and let the fetch that reaches it refresh it.
            return self.last_info
        position = after if not rows else self.target.position_of(rows[-1])
        newest = None
        if not rows and not self._looked:
            # Nothing below a bound not observed for this fetch: the checkpoint may
            # have reached it (a full batch that ended there) with rows committed
            # since. The newest row says whether any wait beyond it, so the tick
            # reports them held back (the worker looks again soon) rather than an
            # idle table (the worker sleeps its interval).
            conn.rollback()  # a snapshot of now, not of the fetch's start
            newest = self._read_max(conn)
            conn.rollback()
        with self._lock:
            self._state.stale = True
            info = self._info(self._state, position, newest)
        # A timestamp bound that nothing open holds is this second's start (the
        # precision's step): the time into it is all the guard measured, and the
        # runner's next wait ends with it (pacing.held_back_delay).
        unblocked = info.blocking_pid is None and info.blocking_detail is None
        return self._reported(info, measured=bool(self._timestamp) and unblocked)

    def _info(
        self, state: _State, position: Position, newest: tuple[Any, Decimal | None] | None = None
    ) -> FetchInfo:
        """What the fetch that ended at ``position`` was held back by; ``newest``:
        the highest cursor (and its epoch) read after the fetch, when newer than
        the last observation's."""
        observation = state.last
        if observation is not None and newest is not None:
            observation = replace(observation, max_value=newest[0], max_epoch=newest[1])
        horizon = self._horizon_value(state.bound)
        if observation is None:
            return FetchInfo(
                self.mode,
                horizon,
                True,
                time.monotonic() - state.first_seen,
                blocking_detail="the transaction list could not be read fresh yet",
            )
        stale_for = time.monotonic() - state.last_fresh
        if state.stale_cache and stale_for >= STALE_WARN_SECONDS:
            # Blind: whatever was committed since the last fresh observation waits.
            return FetchInfo(
                self.mode,
                horizon,
                True,
                stale_for,
                blocking_detail=(
                    f"information_schema.INNODB_TRX not refreshed for {stale_for:.0f}s: other "
                    "sessions read it more often than every 100 ms; rows after the horizon "
                    "wait until a read finds it fresh"
                ),
            )
        newest = observation.max_value
        if self._timestamp:
            beyond = observation.max_epoch is not None and (
                state.bound is None or observation.max_epoch >= state.bound
            )
        else:
            beyond = newest is not None and greater(newest, state.bound)
        held = beyond and (position.is_beginning or greater(newest, position.cursor))
        if not held:
            state.held_since = None
            return FetchInfo(self.mode, horizon)
        if state.held_since is None:
            state.held_since = observation.at
        since = state.bound_at
        waited = (
            float(observation.at - since)
            if since is not None
            else time.monotonic() - state.first_seen
        )
        pid: int | None = None
        age: float | None = None
        trx: str | None = None
        detail: str | None = None
        blocker = state.blocker
        if blocker is None and not self._timestamp:
            # Nothing was open at the observation: the rows wait only for the next
            # sample of an AUTO_INCREMENT cursor (one observation), not for a
            # transaction. The bound's sample can be from before an idle sleep;
            # the hold is as old as the first observation that saw it.
            waited = min(waited, float(observation.at - state.held_since))
        if isinstance(blocker, Writer):
            pid, trx = blocker.thread_id, blocker.trx_id
            if blocker.started is not None:
                age = max(0.0, float(observation.sampled_at - blocker.started))
            kind = "XA transaction" if blocker.thread_id == 0 else "InnoDB transaction"
            opened = "" if age is None else f", open {age:.0f}s"
            detail = f"{kind} {blocker.trx_id} on thread {blocker.thread_id}{opened}"
            if blocker.lower is None:
                detail += (
                    ", a write transaction already open when this poller started (when its "
                    "statements read the clock is unknown): nothing is consumed until it ends"
                )
        elif isinstance(blocker, tuple):
            _, pid, start = blocker
            age = max(0.0, float(observation.at - start))
            detail = f"statement running on thread {pid} for {age:.1f}s"
        if state.stale_cache:
            detail = (
                "information_schema.INNODB_TRX was not refreshed (InnoDB refreshes it only "
                "when nobody read it for 100 ms, and other sessions keep reading it); "
                + (detail or "no blocker known")
            )
        return FetchInfo(self.mode, horizon, True, max(0.0, waited), pid, age, detail, trx)

    def _horizon_value(self, bound: Any) -> Any:
        if bound is None or not self._timestamp:
            return bound
        return dt.datetime.fromtimestamp(float(bound), dt.timezone.utc)


def _error_code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


__all__ = [
    "MYSQL_DIALECTS",
    "MariaDbHorizon",
    "can_read_transactions",
    "is_auto_increment",
]
