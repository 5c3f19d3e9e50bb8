"""How old a cursor value is, in the clock of the database that wrote it.

``lag_seconds`` is ``now - cursor`` for an aware timestamp. A naive timestamp
(``TIMESTAMP WITHOUT TIME ZONE``, MariaDB ``DATETIME``, SQLite text) has no
zone: it is the database's wall clock when the row was written, so comparing
it with UTC would be off by the server's offset. :class:`DatabaseClock` reads
the database's own wall clock once (and again every ``refresh_seconds``),
keeps the offset to UTC, and ages naive values against ``now + offset`` with
no query per batch. Integer and decimal cursors carry no time at all: their age
is None, and the runtime has to measure lag another way (how long the
checkpoint has not moved while rows are pending).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

#: The database's current wall-clock time, as the naive value a naive column would hold.
_WALL_CLOCK = {
    "postgresql": "SELECT LOCALTIMESTAMP",
    "mysql": "SELECT NOW(6)",
    "mariadb": "SELECT NOW(6)",
    "sqlite": "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')",  # SQLite's clock is UTC
    "mssql": "SELECT SYSDATETIME()",
}


def _naive(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=None) if value.tzinfo is not None else value
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.strip().replace(" ", "T", 1))
        except ValueError:
            return None
        return parsed.replace(tzinfo=None)
    return None


class DatabaseClock:
    """The offset between a database's wall clock and UTC, measured now and then."""

    def __init__(
        self, engine: Callable[[], Engine], dialect: str, *, refresh_seconds: float = 300.0
    ) -> None:
        self._engine = engine
        self._dialect = dialect
        self._refresh = refresh_seconds
        self._lock = threading.Lock()
        self._offset: dt.timedelta | None = None
        self._measured_at = float("-inf")

    def offset(self) -> dt.timedelta | None:
        """Database wall clock minus UTC, rounded to the minute (None: unknown dialect)."""
        query = _WALL_CLOCK.get(self._dialect)
        if query is None:
            return None
        with self._lock:
            if time.monotonic() - self._measured_at < self._refresh:
                return self._offset
        with self._engine().connect() as conn:
            before = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
            wall = _naive(conn.execute(sa.text(query)).scalar())
        if wall is None:
            return None
        # Zone offsets are whole minutes (or quarter hours); rounding removes
        # the query's own latency and small clock differences.
        minutes = round((wall - before).total_seconds() / 60)
        with self._lock:
            self._offset = dt.timedelta(minutes=minutes)
            self._measured_at = time.monotonic()
            return self._offset

    def age_seconds(self, cursor: Any, now: dt.datetime) -> float | None:
        """Seconds from ``cursor`` to ``now`` (aware UTC); None when the cursor is not a time."""
        if isinstance(cursor, dt.datetime) and cursor.tzinfo is not None:
            return max(0.0, (now - cursor).total_seconds())
        naive = _naive(cursor)
        if naive is None:
            return None
        offset = self.offset()
        if offset is None:
            return None
        wall_now = now.astimezone(dt.timezone.utc).replace(tzinfo=None) + offset
        return max(0.0, (wall_now - naive).total_seconds())


__all__ = ["DatabaseClock"]
