"""A committed batch as the history's appender keeps it: row tuples, not events.

The appender makes a batch's detail some time after its commit (up to a
round's interval, longer behind a slow store). Kept as its events, a batch
stays alive that long: a thousand objects a batch that the cyclic collector
promotes and scans again in its older generations, only for the detail to
read their row tuples. The detail needs the tuples and their shape alone, and
a fetched row's tuple (plain values) leaves the collector's view at its first
collection; the events go when the tick lets them go.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, overload

from dbtrigger.events import RowChange, RowShape, batch_shape, row_event

_row_of = attrgetter("_row")


class KeptRows(Sequence[RowChange]):
    """The events of a batch made over one shape, as that shape and their rows.

    A read of an event makes it again over its tuple (the same fields; its id,
    computed when read, the same id): what the detail reads of the events
    themselves is the last one's position, and each event's image when its
    ``repr`` names a memory address."""

    __slots__ = ("rows", "shape")

    def __init__(self, shape: RowShape, rows: list[Any]) -> None:
        self.shape = shape
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> RowChange: ...

    @overload
    def __getitem__(self, index: slice) -> list[RowChange]: ...

    def __getitem__(self, index: int | slice) -> RowChange | list[RowChange]:
        if isinstance(index, slice):
            return [row_event(self.shape, row) for row in self.rows[index]]
        return row_event(self.shape, self.rows[index])


def kept(events: Sequence[RowChange]) -> Sequence[RowChange]:
    """``events`` as the appender keeps them until their detail is made:
    :class:`KeptRows` when they were made over one shape, else a tuple of them."""
    shape = batch_shape(events)
    if shape is None:
        return tuple(events)
    return KeptRows(shape, list(map(_row_of, events)))


__all__ = ["KeptRows", "kept"]
