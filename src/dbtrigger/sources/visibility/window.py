"""The safety window: a bounded guard for every dialect with a clock.

Only rows whose timestamp is older than the database's own clock minus N
seconds are consumed; the bound is computed by the database inside the fetch
statement, so no client clock is involved.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier
from dbtrigger.sources.visibility.base import ActiveGuard, FetchInfo, GuardTarget, VisibilityGuard

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
