"""Bulk reads: one query for several batches of a catch-up.

A catch-up of small batches pays, per batch, a query: its round trip, the
server's start-up of the statement, the driver's and the source's Python
around it (about a third of a 100-row batch's client CPU on a narrow table).
When a tick may deliver several batches in a row (``max_batches_per_tick``
above one) and nothing is waiting in the settled window, the tick reads up to
:data:`MAX_ROWS` rows (at most :data:`MAX_BATCHES` batches) with one query,
hands out the first ``batch_size`` of them as the batch, and keeps the rest:
the next batch is the kept rows' first ``batch_size`` if, and only if, the
batch before it landed exactly at the end of the rows handed out (every
event accepted, no retry, the window still empty), under the same lease,
within :data:`MAX_AGE_SECONDS` of the read. Anything else drops the rest
and the tick reads again.

So what a handler gets, and when the checkpoint moves, is what a read of
``batch_size`` rows at each batch would give: the same rows in the same
order, each batch committed (under the lease) before the next is handed out.
What changes is only *when* a row was read: up to a few batches earlier, as
with the read-ahead (:mod:`dbtrigger.runtime.readahead`), which, while kept
rows are handed out, reads what follows them (once, if their read came back
full: :meth:`BulkReads.rest_end`) and is used, as any read-ahead, only if the
tick then asks for exactly that read; the visibility
guard's bound is computed by the read itself, so a read made earlier is as
safe as one made later, and a row updated since it was read comes again with
its new cursor (at-least-once). A source opts in with a true ``bulk_reads``
attribute (:func:`reads_in_bulk`): its ``fetch(after, limit)`` must return
the first ``limit`` rows after ``after`` in checkpoint order, as
:class:`~dbtrigger.sources.rows.Rows` or mappings with the cursor and key
columns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dbtrigger.cursor import Position
from dbtrigger.sources.rows import Rows

if TYPE_CHECKING:
    from dbtrigger.runtime.poll_options import PollOptions

#: A bulk read covers at most this many rows (the memory a read holds at once
#: stays that of a 1,000-row batch) ...
MAX_ROWS = 1000

#: ... and at most this many batches.
MAX_BATCHES = 10

#: Kept rows are handed out at most this long after their read.
MAX_AGE_SECONDS = 1.0


def reads_in_bulk(source: object) -> bool:
    """May the tick read several batches of ``source`` with one ``fetch``?"""
    return getattr(source, "bulk_reads", False) is True


def depth_for(batch_size: int, max_batches_per_tick: int) -> int:
    """How many batches one read covers: 1 (no bulk reads) for batches of
    :data:`MAX_ROWS` / 2 rows or more, or for one batch a tick."""
    return max(1, min(MAX_BATCHES, MAX_ROWS // max(batch_size, 1), max_batches_per_tick))


def bulk_reads_for(source: Any, checked: PollOptions, wanted: bool) -> BulkReads | None:
    """The bulk reads of a trigger over ``source`` with the ``checked`` options
    (``batch_size``, ``max_batches_per_tick``); None: one read a batch."""
    depth = depth_for(checked.batch_size, checked.max_batches_per_tick)
    if not wanted or depth < 2 or not reads_in_bulk(source):
        return None
    return BulkReads(depth=depth, columns=(source.cursor_column, source.pk_columns))


@dataclass(eq=False, slots=True)
class _Rest:
    """Rows read beyond the batch handed out, for the batches after it."""

    after: Position
    rows: Sequence[Any]
    tag: object
    read_at: float
    #: The read came back full: rows are likely pending after these.
    full: bool


class BulkReads:
    """The rows one tick read ahead of its batches; see the module docstring."""

    def __init__(
        self,
        *,
        depth: int,
        columns: tuple[str, Sequence[str]],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.depth = depth
        #: The cursor column and the key columns.
        self.cursor_column, self.pk_columns = columns[0], tuple(columns[1])
        self.monotonic = monotonic
        self._rest: _Rest | None = None
        #: Batches handed out from kept rows (for tests and the benchmark).
        self.served = 0

    def read_limit(self, limit: int) -> int:
        """What to read for a batch of ``limit`` rows with nothing in the window."""
        return limit * self.depth

    @property
    def holds(self) -> bool:
        """Are rows kept for the next batch?"""
        return self._rest is not None

    def take(
        self, position: Position, tag: object, limit: int, *, plain: bool = True
    ) -> Sequence[Any] | None:
        """The next batch from the kept rows if they continue exactly at
        ``position`` under ``tag`` (and are fresh enough) and the batch is
        ``plain`` (nothing in the settled window, no reserve); None otherwise.
        Either way nothing older is held afterwards."""
        rest, self._rest = self._rest, None
        if (
            rest is None
            or not plain
            or rest.tag != tag
            or self.monotonic() - rest.read_at > MAX_AGE_SECONDS
            or rest.after != position
        ):
            return None
        self.served += 1
        return self._split(rest.rows, limit, tag, rest.read_at, rest.full)

    def keep(self, rows: Sequence[Any], limit: int, tag: object) -> Sequence[Any]:
        """``rows`` (one read of ``limit`` times the depth) cut to the batch of
        ``limit`` rows handed out now; the rest is kept for the batches after it."""
        self._rest = None
        if len(rows) <= limit:
            return rows
        full = len(rows) >= self.read_limit(limit)
        return self._split(rows, limit, tag, self.monotonic(), full)

    def rest_end(self) -> Position | None:
        """Where the kept rows end, when the read that gave them came back full
        (the next read starts there: a read-ahead may make it meanwhile); None
        when nothing is kept or nothing is likely pending after it."""
        rest = self._rest
        if rest is None or not rest.full:
            return None
        return self._after(_row(rest.rows, len(rest.rows) - 1))

    def retag(self, old: object, new: object) -> None:
        """Rows kept under ``old`` now stand for ``new`` (the tick's first read,
        made before its lease was taken on the etag it read under)."""
        rest = self._rest
        if rest is not None and rest.tag == old:
            rest.tag = new

    def drop(self) -> None:
        self._rest = None

    def _split(
        self, rows: Sequence[Any], limit: int, tag: object, read_at: float, full: bool
    ) -> Sequence[Any]:
        if len(rows) <= limit:
            return rows
        if isinstance(rows, Rows):
            head: Sequence[Any] = _part(rows, 0, limit)
            tail: Sequence[Any] = _part(rows, limit, len(rows))
        else:
            head, tail = rows[:limit], rows[limit:]
        self._rest = _Rest(self._after(_row(rows, limit - 1)), tail, tag, read_at, full)
        return head

    def _after(self, row: Mapping[str, Any]) -> Position:
        """The checkpoint just after ``row`` (what ``position_of`` gives for its event)."""
        return Position(cursor=row[self.cursor_column], pk={n: row[n] for n in self.pk_columns})


def _row(rows: Sequence[Any], index: int) -> Mapping[str, Any]:
    """Row ``index`` of a read as a mapping (of :class:`Rows`, without making them all)."""
    if isinstance(rows, Rows):
        return dict(zip(rows.columns, rows.tuples[index], strict=True))
    row: Mapping[str, Any] = rows[index]
    return row


def _part(rows: Rows, start: int, end: int) -> Rows:
    part = Rows(rows.columns, rows.tuples[start:end], plain=rows.plain)
    types = rows.types
    # The value types the source collected are those of the whole read: a superset
    # for a part, which the events' checks may take as long as it holds no NULL (a
    # NULL key is looked for among the part's rows, which may not hold it).
    if types is not None and not any(type(None) in found for found in types.values()):
        part.types = types
    return part


__all__ = [
    "MAX_AGE_SECONDS",
    "MAX_BATCHES",
    "MAX_ROWS",
    "BulkReads",
    "bulk_reads_for",
    "depth_for",
    "reads_in_bulk",
]
