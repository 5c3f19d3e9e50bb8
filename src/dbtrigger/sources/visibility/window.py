"""The safety window: a bounded guard for every dialect with a clock.

Only rows whose timestamp is older than the database's own clock minus N
seconds are consumed; the bound is computed by the database inside the fetch
statement, so no client clock is involved.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ColumnElement

from dbtrigger import options as opt
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier
from dbtrigger.sources.visibility.base import (
    ActiveGuard,
    FetchCondition,
    FetchInfo,
    GuardTarget,
    Rows,
    VisibilityGuard,
    _exact_needs,
)
from dbtrigger.sources.visibility.innodb_trx import end_turn, try_turn

log = logging.getLogger("dbtrigger.sources.visibility")

#: Default safety window. Five seconds covers ordinary commit latency (fsync
#: stalls, replication waits, a short lock wait) and equals Python's default
#: SQLite busy timeout, the longest a writer that computed its timestamp before
#: waiting for the write lock usually waits; it keeps the added visibility delay
#: of a near-real-time trigger small. Transactions that hold a cursor value
#: longer than this (batch jobs, lock waits up to ``innodb_lock_wait_timeout``)
#: need a larger window or a transaction-id cursor.
DEFAULT_WINDOW_SECONDS = 5.0

#: Dialects with a safety-window expression. SQL Server's is compiled in tests
#: but not run against a server here.
WINDOW_DIALECTS = frozenset({"postgresql", "mysql", "mariadb", "sqlite", "mssql"})


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
        reason: why ``auto`` settled for a window (e.g. the MariaDB account
            lacks PROCESS); shown by ``describe_guard()``, not compared.

    On MariaDB/MySQL the window also watches for what it cannot cover: when a
    fetch drains the source it looks (at most once a second) for write
    transactions (``INNODB_TRX``, with PROCESS) and running statements (the
    account's own sessions without it) older than the window, and logs a
    WARNING (``event="visibility_window_exceeded"``) naming them.

    The bound is an expression in the fetch statement, evaluated by the database
    when it reads the rows, so no client clock is involved.
    """

    seconds: float = DEFAULT_WINDOW_SECONDS
    time_column: str | None = None
    utc: bool = False
    reason: str | None = field(default=None, compare=False)
    mode = "safety-window"

    def __post_init__(self) -> None:
        opt.seconds("safety window (SafetyWindow.seconds)", self.seconds)
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

    def strength(self, dialect: str) -> str:
        del dialect
        return "bounded"

    def needs(self, dialect: str) -> str | None:
        needs = _exact_needs(dialect)
        return f"{self.reason}; {needs}" if self.reason and needs else needs

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
        # An integer is Unix time (SQLite's other date format; julianday()
        # alone would read it as a day number). A value it cannot place (text
        # in another format) is released at once, unprotected: held back, it
        # would wait for ever, and be skipped once the checkpoint passed it.
        days = sa.literal(seconds / 86400.0, sa.Float())
        day = sa.case(
            (sa.func.typeof(column) == "integer", sa.func.julianday(column, "unixepoch")),
            else_=sa.func.julianday(column),
        )
        return sa.or_(day.is_(None), day < sa.func.julianday("now") - days)
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
        # The database clock is read by the fetch statement: one condition for good.
        self._condition = FetchCondition(predicate)
        self.last_info = FetchInfo(mode=self.mode)

        self._overruns = _OverrunWatch(target, guard) if target.dialect in _WATCHED else None

    def before_fetch(self, conn: Connection, after: Position) -> FetchCondition | None:
        del conn, after
        return self._condition

    def after_fetch(self, conn: Connection, after: Position, rows: Rows, limit: int) -> FetchInfo:
        del after
        if self._overruns is not None and len(rows) < limit:
            self.last_info = self._overruns.check(conn) or FetchInfo(mode=self.mode)
        return self.last_info


_WATCHED = frozenset({"mysql", "mariadb"})

# The oldest write transaction of another session (needs PROCESS) ...
_OLDEST_WRITER = sa.text(
    """
    SELECT t.trx_id AS trx_id, t.trx_mysql_thread_id AS thread_id,
           TIMESTAMPDIFF(
               MICROSECOND, t.trx_started, CONVERT_TZ(NOW(6), @@session.time_zone, 'SYSTEM')
           ) / 1000000 AS age
      FROM information_schema.INNODB_TRX AS t
     WHERE t.trx_rows_modified > 0 AND t.trx_mysql_thread_id <> CONNECTION_ID()
     ORDER BY t.trx_started
     LIMIT 1
    """
)
# ... and the longest-running statement among the sessions this account sees.
# MariaDB's TIME_MS has millisecond precision; MySQL only has whole-second TIME,
# which would hide a statement until it had run a full second past the window.
_OLDEST_STATEMENT_SQL = """
    SELECT p.ID AS thread_id, {age} AS age
      FROM information_schema.PROCESSLIST AS p
     WHERE p.ID <> CONNECTION_ID()
       AND p.COMMAND NOT IN ('Sleep', 'Daemon', 'Binlog Dump', 'Binlog Dump GTID')
       AND UPPER(LEFT(LTRIM(COALESCE(p.INFO, '')), 4)) NOT IN ('SELE', 'SHOW')
     ORDER BY age DESC
     LIMIT 1
"""
_OLDEST_STATEMENT_MARIADB = sa.text(_OLDEST_STATEMENT_SQL.format(age="p.TIME_MS / 1000"))
_OLDEST_STATEMENT_MYSQL = sa.text(_OLDEST_STATEMENT_SQL.format(age="p.TIME"))


#: The overrun check skips INNODB_TRX while the horizons' turn is busy, for up to this long.
TURN_BUSY_READ_SECONDS = 10.0


@dataclass
class _OverrunWatch:
    """Looks for writers older than the window, at most once a second, and warns.

    A window cannot tell a late commit from an early one, but it can notice a
    transaction that has already held its timestamp longer than the window:
    its rows may land behind the checkpoint. Saying so is the difference
    between a bounded guard and a silent one.
    """

    target: GuardTarget
    guard: SafetyWindow
    can_read_trx: bool | None = None
    last_check: float = -math.inf
    last_trx_read: float = -math.inf
    turn: bool = False
    warned: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _may_read_trx(self, conn: Connection, now: float) -> bool:
        """Read INNODB_TRX only holding the turn the transaction horizons take
        (see :mod:`.innodb_trx`), so as not to keep its cache stale for them;
        when the turn has been busy for 10 s, read anyway."""
        if self.can_read_trx is not None:  # (the first read finds out whether it may)
            turn = try_turn(conn)
            self.turn = bool(turn)
            if turn is False and now - self.last_trx_read < TURN_BUSY_READ_SECONDS:
                return False
        self.last_trx_read = now
        return True

    def check(self, conn: Connection) -> FetchInfo | None:
        now = time.monotonic()
        with self.lock:
            if now - self.last_check < 1.0:
                return None
            self.last_check = now
        window = float(self.guard.seconds)
        found: tuple[str, int, float, str | None] | None = None
        if self.can_read_trx is not False and self._may_read_trx(conn, now):
            try:
                row = conn.execute(_OLDEST_WRITER).first()
                self.can_read_trx = True
            except DBAPIError:
                self.can_read_trx = False
                row = None
            finally:
                conn.rollback()
                if self.turn:
                    self.turn = False
                    end_turn(conn)
            if row is not None and row.age is not None and float(row.age) > window:
                what = f"InnoDB transaction {row.trx_id} on thread {row.thread_id}"
                found = (what, int(row.thread_id), float(row.age), str(row.trx_id))
        if found is None:
            mariadb = bool(getattr(conn.dialect, "is_mariadb", True))
            query = _OLDEST_STATEMENT_MARIADB if mariadb else _OLDEST_STATEMENT_MYSQL
            row = conn.execute(query).first()
            conn.rollback()
            if row is not None and row.age is not None and float(row.age) > window:
                what = f"a statement on thread {row.thread_id}"
                found = (what, int(row.thread_id), float(row.age), None)
        if found is None:
            return None
        what, thread, age, trx = found
        info = FetchInfo(
            mode=self.guard.mode,
            blocking_pid=thread,
            blocking_xact_age_seconds=age,
            blocking_detail=f"{what}, open {age:.0f}s: longer than the window",
            blocking_trx_id=trx,
        )
        key = trx or f"thread {thread}"
        with self.lock:
            if now - self.warned.get(key, -math.inf) < 60.0:
                return info
            self.warned[key] = now
        needs = self.guard.needs(self.target.dialect)
        log.warning(
            "%s: %s has been open %.0fs, longer than the %gs safety window: rows it wrote "
            "before its commit may be skipped. Widen the window, or for an exact guard: %s",
            self.target.source_name,
            what,
            age,
            window,
            needs,
            extra={
                "event": "visibility_window_exceeded",
                "source": self.target.source_name,
                "mode": self.guard.label(),
                "blocking_pid": thread,
                "blocking_trx_id": trx,
                "blocking_xact_age_seconds": age,
                "window_seconds": window,
            },
        )
        return info
