"""Parallel lanes: one batch handed to the handler as several concurrent calls.

``PollTrigger(..., max_concurrency=N)`` splits each batch into at most ``N``
lanes (:func:`split`): every event of one primary key goes to the same lane,
so the same key is never handled by two calls at once and one key's events
reach the handler in cursor order (a lane keeps the batch's order). Keys are
dealt to lanes by size, largest group first, each to the lane with the fewest
events so far: the lanes come out near-equal, which matters because the batch
waits for its slowest lane (a hash of the key modulo ``N`` leaves the largest
of 16 lanes of a 500-row batch some 30% above the mean, and the whole batch
pays for it). The split is deterministic: the same batch is split the same way
on every delivery. Batches never overlap (a batch's lanes all finish before
the next batch starts), so nothing needs a key to keep its lane across batches.

The lanes run at the same time in worker threads of a pool that lives as long
as the trigger: a synchronous handler blocks its own thread only, an async one
runs as a task on its lane's loop (or, through ``tick_async``, on the caller's
loop). An I/O-bound handler therefore handles ``N`` rows at a time. While they
run, the calling thread may do one more thing (``meanwhile``): the tick driver
fetches the next batch there (see :mod:`dbtrigger.runtime.tick`).

The lanes share the batch's context: one fencing token, one lease-lost flag
(a lost lease cancels every lane), one set of per-event marks. They have no
cursor of their own: the batch is settled as a whole, and a lane that fails
makes its rows the failed rows of the batch (as if the handler had raised
:class:`~dbtrigger.errors.PartialBatchError` naming them): the other lanes'
rows are settled, the failing lane's come again. Storage cost is unchanged:
one commit per batch, however many lanes.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from dbtrigger.cursor import pk_json
from dbtrigger.errors import LostLeaseError, PartialBatchError
from dbtrigger.events import RowChange


def _key(event: RowChange) -> Hashable:
    """The event's key as a dict key: its values (one source, one column
    order), or their canonical JSON when a value is not hashable. The split
    runs on the tick's thread before any lane starts, so it must be cheap
    (the JSON form for every event was 5 ms of a 500-row batch)."""
    values = tuple(event.pk.values())
    try:
        hash(values)
    except TypeError:
        return pk_json(event.pk)
    return values


def split(events: Sequence[RowChange], lanes: int) -> list[list[RowChange]]:
    """The non-empty lanes of a batch, each in batch (cursor) order.

    All events of one key land in one lane; keys are dealt largest group
    first to the least-loaded lane (ties: the lower lane), so lane sizes
    differ by at most the largest key's event count.
    """
    if lanes <= 1 or len(events) <= 1:
        return [list(events)] if events else []
    keys = [_key(e) for e in events]
    counts: dict[Hashable, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    loads = [(0, lane) for lane in range(min(lanes, len(counts)))]
    lane_of: dict[Hashable, int] = {}
    # sorted() is stable: equal groups keep their order of first appearance.
    for key, count in sorted(counts.items(), key=lambda item: -item[1]):
        load, lane = heapq.heappop(loads)
        lane_of[key] = lane
        heapq.heappush(loads, (load + count, lane))
    parts: list[list[RowChange]] = [[] for _ in range(len(loads))]
    for event, key in zip(events, keys, strict=True):
        parts[lane_of[key]].append(event)
    return [part for part in parts if part]


class Lanes:
    """Runs the lanes of a batch on a pool of ``size`` worker threads."""

    def __init__(self, size: int, *, name: str) -> None:
        self.size = size
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.size, thread_name_prefix=f"dbtrigger-lane-{self.name}"
                )
            return self._pool

    def run(
        self,
        events: list[RowChange],
        call: Callable[[list[RowChange]], None],
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Call ``call`` on each lane of ``events`` concurrently; wait for all.

        ``meanwhile`` runs on the calling thread while the lanes run; the lanes
        are waited for even if it raises (no handler call outlives this).

        Raises:
            LostLeaseError: a lane saw the lease lost.
            PartialBatchError: some lanes failed; it names their rows.
            Exception: every lane failed: the first lane's error.
        """
        parts = split(events, self.size)
        if len(parts) <= 1 and meanwhile is None:
            call(events)
            return
        futures = [self._executor().submit(call, part) for part in parts]
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            wait(futures)
        failures: list[tuple[list[RowChange], BaseException]] = []
        for part, future in zip(parts, futures, strict=True):
            error = future.exception()
            if error is not None:
                failures.append((part, error))
        if not failures:
            return
        for _, error in failures:
            if isinstance(error, LostLeaseError):
                raise error
        if len(failures) == len(parts) and not any(
            isinstance(e, PartialBatchError) for _, e in failures
        ):
            raise failures[0][1]
        named: list[dict[str, object]] = []
        causes: dict[int, BaseException] = {}
        for part, error in failures:
            if isinstance(error, PartialBatchError):
                for index, pk in enumerate(error.failed_pks):
                    causes[len(named)] = error.causes.get(index, error)
                    named.append(dict(pk))
                continue
            for event in part:
                causes[len(named)] = error
                named.append(dict(event.pk))
        raise PartialBatchError(
            named, f"{len(failures)} of {len(parts)} lanes failed", causes=causes
        ) from failures[0][1]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
