"""``lag_seconds`` for every cursor type, and a name for how it was measured.

How far behind a poller is, in seconds, is the age of the oldest row it has
not delivered yet. Where that age comes from depends on the cursor (the
*basis*, reported next to the number by the worker's log, the metrics, the
health check and ``dbtrigger status``):

``cursor``
    A timestamp cursor carries its own time: the age of the committed cursor
    (aware, or naive against the database's clock, see
    :mod:`dbtrigger.sources.clock`).
``column:<name>``
    An integer or decimal cursor carries none, but a row often has a time
    column (``created_at``, the ``time_column`` of a ``SafetyWindow``). With
    ``lag_column=`` (or that ``time_column``) the age is the value of that
    column on the oldest undelivered row: one single-row keyset query after a
    commit, at most once a second.
``observed``
    Neither: the seconds since this poller first saw the oldest undelivered
    row pending. After each commit (at most once a second) the poller notes
    the newest row of the table; the oldest row still pending was first seen
    at the earliest note whose newest row was at or past it. It is measured
    by this process only: a restarted worker starts counting again, and a
    stateless probe (``check_health``) cannot give it.
"""

from __future__ import annotations

import collections
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The cursor is a timestamp: its own age.
CURSOR = "cursor"
#: No time anywhere: what the poller observed.
OBSERVED = "observed"
#: Prefix of a declared time column's basis (``column:created_at``).
COLUMN = "column:"

#: Seconds between two query-based measurements of one source.
MEASURE_INTERVAL_SECONDS = 1.0
#: Notes kept by :class:`ObservedLag` before every other one is dropped.
MAX_NOTES = 512


@dataclass(frozen=True)
class LagReading:
    """One measurement of ``lag_seconds`` and how it was made.

    ``seconds`` is None when the basis cannot give a number here (``observed``
    in a stateless probe, a NULL in the time column).
    """

    seconds: float | None
    basis: str


def column_basis(column: str) -> str:
    return f"{COLUMN}{column}"


def describe_basis(basis: str | None) -> str:
    """A person's wording of a basis, for the worker's banner and ``status``."""
    if basis is None:
        return "decided at the first fetch (from the cursor's type)"
    if basis == CURSOR:
        return "the age of the committed cursor (a timestamp)"
    if basis.startswith(COLUMN):
        return f"the age of {basis[len(COLUMN) :]} on the oldest undelivered row"
    return (
        "observed: seconds since this worker first saw the oldest undelivered row pending "
        "(the cursor carries no time; declare lag_column= for the rows' real age)"
    )


class ObservedLag:
    """Seconds since the oldest still-undelivered row was first seen pending.

    :meth:`observe` is given, at time ``now``, the key (``(cursor, *pk)``) of
    the oldest undelivered row and of the newest row of the source. It keeps a
    note ``(now, newest)``; every row up to ``newest`` was pending (or already
    delivered) at ``now``. The oldest undelivered row was therefore first seen
    at the earliest note whose ``newest`` is at or past it; notes before that
    are dropped, as are all notes once nothing is pending.
    """

    def __init__(self, max_notes: int = MAX_NOTES) -> None:
        self._notes: collections.deque[tuple[dt.datetime, tuple[Any, ...]]] = collections.deque()
        self._max = max_notes

    def observe(
        self,
        now: dt.datetime,
        oldest: Sequence[Any] | None,
        newest: Sequence[Any] | None,
    ) -> float:
        if oldest is None or newest is None:
            self._notes.clear()
            return 0.0
        first = tuple(oldest)
        self._notes.append((now, tuple(newest)))
        try:
            while self._notes and self._notes[0][1] < first:
                self._notes.popleft()
        except (TypeError, ArithmeticError):
            # Keys that do not compare (mixed types; a Decimal NaN, which
            # raises InvalidOperation on <): start over.
            self._notes.clear()
            self._notes.append((now, tuple(newest)))
        if len(self._notes) > self._max:
            # Halve the resolution, keeping the earliest note (the answer).
            kept = list(self._notes)
            self._notes = collections.deque([kept[0], *kept[2::2]])
        return max(0.0, (now - self._notes[0][0]).total_seconds())


__all__ = [
    "COLUMN",
    "CURSOR",
    "OBSERVED",
    "LagReading",
    "ObservedLag",
    "column_basis",
    "describe_basis",
]
