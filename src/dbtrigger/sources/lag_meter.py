"""``lag_seconds`` of a keyset source: the basis it is measured on, and the measuring.

The bases are explained in :mod:`dbtrigger.sources.lag`. Here is how a keyset
source gets each: a timestamp cursor is aged as it is (no query, see
:class:`~dbtrigger.sources.clock.DatabaseClock`); with a lag column one
single-row keyset query reads that column on the oldest undelivered row;
otherwise the same query reads the oldest undelivered and the newest row for
:class:`~dbtrigger.sources.lag.ObservedLag`. Queries run at most once every
:data:`~dbtrigger.sources.lag.MEASURE_INTERVAL_SECONDS`; in between the gauge
keeps its value.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, DbTriggerError, SerializationError
from dbtrigger.sources import lag as lagmod
from dbtrigger.sources.clock import DatabaseClock
from dbtrigger.sources.errors_map import mapped
from dbtrigger.sources.keyset import Keyset
from dbtrigger.sources.lag import LagReading, ObservedLag

#: Kinds of cursor value that carry their own time.
_TIMESTAMP_KINDS = ("timestamp", "naive_timestamp")


class LagMeter:
    """How far behind a keyset source's checkpoint is, in seconds.

    ``column`` is the lag column (None: the cursor, or observed); ``clock``
    the database's clock; ``source`` names the source in errors.
    """

    def __init__(self, column: str | None, clock: DatabaseClock, *, source: str) -> None:
        self.column = column
        self.clock = clock
        self.source = source
        self._observed = ObservedLag()
        self._measured_at = float("-inf")

    def basis(
        self,
        kind: Callable[[], str | None] | None,
        cursor_type: Callable[[], sa.types.TypeEngine[Any] | None],
    ) -> str | None:
        """``cursor``, ``column:<name>`` or ``observed`` (None: not known yet).

        ``kind`` reads the cursor's checkpoint kind (reflecting if needed);
        None when the source is not to be reflected now. A source that cannot
        be read has no basis yet. ``cursor_type`` is the declared type, once
        known (read after ``kind``, which may reflect).
        """
        if self.column is not None:
            return lagmod.column_basis(self.column)
        found: str | None = None
        if kind is not None:
            try:
                found = kind()
            except DbTriggerError:
                return None
        if isinstance(cursor_type(), sa.DateTime):  # SQLite's DATETIME compares as text
            return lagmod.CURSOR
        if found is None:
            return None
        return lagmod.CURSOR if found in _TIMESTAMP_KINDS else lagmod.OBSERVED

    def age(self, value: Any, now: dt.datetime) -> float | None:
        """How old cursor or lag-column ``value`` is at ``now`` (None: no time in it)."""
        if not isinstance(value, dt.datetime | str):
            return None  # (no time in it: what the clock says too, asked after every commit)
        with mapped(f"reading the clock of {self.source}"):
            return self.clock.age_seconds(value, now)

    def row_age(self, row: Mapping[str, Any], cursor_column: str, now: dt.datetime) -> LagReading:
        """How old a fetched row is: its lag column, else its cursor (``observed``: None)."""
        if self.column is not None:
            basis = lagmod.column_basis(self.column)
            return LagReading(self.age(row.get(self.column), now), basis)
        age = self.age(row.get(cursor_column), now)
        return LagReading(age, lagmod.CURSOR if age is not None else lagmod.OBSERVED)

    def without_query(self, after: Position, now: dt.datetime) -> LagReading | None:
        """The lag a timestamp checkpoint gives by itself (None: a query is needed)."""
        if self.column is not None:
            return None
        age = self.age(after.cursor, now)
        return LagReading(age, lagmod.CURSOR) if age is not None else None

    def due(self) -> bool:
        """Whether a query-based measurement may run now (at most once an interval)."""
        started = time.monotonic()
        if started - self._measured_at < lagmod.MEASURE_INTERVAL_SECONDS:
            return False
        self._measured_at = started
        return True

    @contextlib.contextmanager
    def unreadable_values(self) -> Iterator[None]:
        """A value the driver cannot convert (an SQLite DATETIME holding text, a
        MariaDB zero date) in the lag column or the keys: a SerializationError."""
        try:
            yield
        except DbTriggerError:
            raise
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise SerializationError(
                f"measuring the lag of {self.source} failed: a value of the oldest pending row "
                f"cannot be read ({type(exc).__name__}: {exc}); lag_seconds is not updated "
                "until that row is delivered or fixed"
            ) from exc

    def measure(
        self, conn: Connection, keyset: Keyset, after: Position, now: dt.datetime
    ) -> LagReading:
        """One query: the oldest undelivered row's lag column, or what ``observed`` needs."""
        if self.column is not None:
            column = keyset.columns.get(self.column)
            if column is None:
                raise ConfigurationError(
                    f"lag_column {self.column!r} is not a column of {self.source}"
                )
            oldest = keyset.statement(after, 1).with_only_columns(column.label("lag"))
            row = conn.execute(oldest).first()
            basis = lagmod.column_basis(self.column)
            if row is None:
                return LagReading(0.0, basis)  # nothing pending
            return LagReading(self.age(row[0], now), basis)
        keys = keyset.position_keys()
        first = conn.execute(keyset.statement(after, 1).with_only_columns(*keys)).first()
        newest = conn.execute(keyset.newest()).first() if first is not None else None
        seconds = self._observed.observe(
            now,
            tuple(first) if first is not None else None,
            tuple(newest) if newest is not None else None,
        )
        return LagReading(seconds, lagmod.OBSERVED)


__all__ = ["LagMeter"]
