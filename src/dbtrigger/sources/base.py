"""The ``SourceAdapter`` port: fetch the rows after a position, in position order.

A source owns everything specific to where rows come from: the query, the
cursor and key columns, how a raw row becomes a :class:`~dbtrigger.RowChange`
and how it identifies itself in the state document (its fingerprint). The
runtime only asks for "up to ``limit`` rows after ``position``" and advances the
checkpoint to the position of the last event it delivered.

Contract (checked by one suite against every implementation):

* ``fetch(after, limit)`` returns at most ``limit`` rows, strictly after
  ``after``, ordered by position, and the first ``limit`` such rows: a row can
  only be skipped if it is not visible at all.
* ``to_events`` produces one event per row with ``position_of(event)`` equal to
  the row's position; a row it cannot turn into an event raises
  :class:`~dbtrigger.errors.SerializationError` naming the problem.
* ``fingerprint()`` is stable for an unchanged definition, changes when the
  definition changes, and contains no secret.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from dbtrigger.cursor import Position
from dbtrigger.events import RowChange


@runtime_checkable
class SourceAdapter(Protocol):
    @property
    def name(self) -> str:
        """Display name for logs and events (``dialect:schema.table``); no secrets."""
        ...

    def fingerprint(self) -> str:
        """``sha256:...`` of the source definition, secrets excluded."""
        ...

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        """Up to ``limit`` raw rows strictly after ``after``, in position order."""
        ...

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """Normalise raw rows into events (raises ``SerializationError``)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Definition details for status output; no secrets."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def position_of(event: RowChange) -> Position:
    """The checkpoint position just after ``event``."""
    return Position(cursor=event.cursor, pk=dict(event.pk))
