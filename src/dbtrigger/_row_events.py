"""The list :func:`dbtrigger.events.events_from_rows` returns: it remembers the
one shape its events were made over, until it is changed.

The tick walks a committed batch for its history (:func:`dbtrigger.history.kept_rows.kept`)
and, when events are marked, for their ids (:func:`dbtrigger.events.event_ids`);
both first prove that every event is a fetched row of one shape, two passes
over the batch (every item's type, every item's shape). A batch made by
``events_from_rows`` is that by construction, so the list says so, and any
change made to it through the list's own methods (an item set, deleted or
added, a sort) forgets it: the proof is then made item by item as for any
other sequence. Reads (indexing, iteration, ``len``, slicing, which returns a
plain list) are the list's own, at C speed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, SupportsIndex, TypeVar

#: The events (a :class:`~dbtrigger.events._Event`) and the shape they were
#: made over (a :class:`~dbtrigger.events.RowShape`), named by
#: :mod:`dbtrigger.events`, which this module sits below.
_Event = TypeVar("_Event")
_Shape = TypeVar("_Shape")


class RowEvents(list[_Event], Generic[_Event, _Shape]):
    """Events made over ``shape`` (None: changed since, or never said)."""

    __slots__ = ("shape",)

    def __init__(self, shape: _Shape | None = None) -> None:
        super().__init__()
        self.shape = shape

    # Every way list's own methods change the items forgets the shape.

    def __setitem__(self, index: Any, value: Any) -> None:
        self.shape = None
        super().__setitem__(index, value)

    def __delitem__(self, index: SupportsIndex | slice) -> None:
        self.shape = None
        super().__delitem__(index)

    def __iadd__(self, other: Iterable[_Event]) -> RowEvents[_Event, _Shape]:  # type: ignore[override,misc]
        self.shape = None
        return super().__iadd__(other)

    def __imul__(self, count: SupportsIndex) -> RowEvents[_Event, _Shape]:
        self.shape = None
        return super().__imul__(count)

    def append(self, item: _Event) -> None:
        self.shape = None
        super().append(item)

    def extend(self, items: Iterable[_Event]) -> None:
        self.shape = None
        super().extend(items)

    def insert(self, index: SupportsIndex, item: _Event) -> None:
        self.shape = None
        super().insert(index, item)

    def pop(self, index: SupportsIndex = -1) -> _Event:
        self.shape = None
        return super().pop(index)

    def remove(self, item: _Event) -> None:
        self.shape = None
        super().remove(item)

    def clear(self) -> None:
        self.shape = None
        super().clear()

    def reverse(self) -> None:
        self.shape = None
        super().reverse()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self.shape = None
        super().sort(*args, **kwargs)


__all__ = ["RowEvents"]
