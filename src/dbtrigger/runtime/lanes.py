"""Lanes: ``max_concurrency > 1`` splits a batch by key and runs the parts at once
on one pool of daemon threads per trigger (:class:`Lanes`), closed with it.

Part of the delivery kernel (:mod:`dbtrigger.runtime.kernel`, which re-exports
:func:`split` and :class:`Lanes`), shared by pollers and queues.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from dbtrigger.cursor import pk_json
from dbtrigger.errors import LostLeaseError, PartialBatchError
from dbtrigger.events import RowChange
from dbtrigger.runtime import let_go
from dbtrigger.runtime.daemon_pool import DaemonPool

T = TypeVar("T")

#: How long the lanes' caller waits at a time, so a signal's handler gets to run.
_SIGNAL_SLICE_SECONDS = 0.2


def _key(event: RowChange, pk: Mapping[str, Any] | None = None) -> Hashable:
    """The event's key (or ``pk``) as a dict key: its values (one source, one column
    order), or their canonical JSON when a value is not hashable. The split
    runs before any lane starts, so it must be cheap (the JSON form for every
    event was 5 ms of a 500-row batch)."""
    pk = event.pk if pk is None else pk
    values = tuple(pk.values())
    try:
        hash(values)
    except TypeError:
        return pk_json(pk)
    return values


def moved_from(event: RowChange) -> Mapping[str, Any] | None:
    """The key an update moved its row away from (a log's ``UPDATE ... SET id = 40
    WHERE id = 4``: ``pk`` is the new key, ``before`` holds the old one), else None."""
    before = event.before
    if event.op != "update" or not before or any(name not in before for name in event.pk):
        return None
    old = {name: before[name] for name in event.pk}
    return None if old == dict(event.pk) else old


def split(events: Sequence[RowChange], lanes: int) -> list[list[RowChange]]:
    """The non-empty lanes of a batch, each in batch (cursor) order.

    All events of one key land in one lane, so one key is never handled by
    two calls at once and its events arrive in order; an update that moved a
    row to another key ties both keys to one lane (the old key's next change,
    a new row under it, must not overtake the update that freed it). Keys are dealt largest
    group first to the least-loaded lane (ties: the lower lane), so lane sizes
    differ by at most the largest key's event count: the batch waits for its
    slowest lane (a hash of the key modulo N leaves the largest of 16 lanes of
    a 500-row batch some 30% above the mean). The split is deterministic.
    """
    if lanes <= 1 or len(events) <= 1:
        return [list(events)] if events else []
    keys = [_key(e) for e in events]
    joined: dict[Hashable, Hashable] = {}  # key -> the key it shares a lane with

    def root(key: Hashable) -> Hashable:
        while key in joined:
            key = joined[key]
        return key

    for event, key in zip(events, keys, strict=True):
        old = moved_from(event)
        if old is not None and (a := root(key)) != (b := root(_key(event, old))):
            joined[b] = a
    if joined:
        keys = [root(key) for key in keys]
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
    """The lanes of one trigger: a pool of ``size`` worker threads.

    The pool is started on first use and lives as long as the trigger; the
    trigger's ``close()`` shuts it down (it starts again if the trigger is
    used afterwards), so a trigger that is done holds no idle threads.
    """

    def __init__(self, size: int, *, name: str) -> None:
        self.size = size
        self.name = name
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()

    def _executor(self) -> DaemonPool:
        with self._lock:
            if self._pool is None:  # (daemons: an abandoned call never holds the exit up)
                self._pool = DaemonPool(self.size, name=f"dbtrigger-lane-{self.name}")
            return self._pool

    def each(
        self, parts: Sequence[T], fn: Callable[[T], None], meanwhile: Callable[[], None] | None
    ) -> list[BaseException | None]:
        """Run ``fn`` on every part at once; each part's error (None: it returned;
        a part not started because :meth:`close` came first: LostLeaseError).

        ``meanwhile`` runs on the calling thread while the lanes run; the lanes
        are waited for even if it raises (no handler call outlives this).
        """
        fn = let_go.carried(fn)  # (a lane's call is let go as the caller's would be)
        futures: list[Future[None]] = [self._executor().submit(fn, part) for part in parts]
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            # In slices: a signal the kernel hands to a lane's thread does not wake a
            # wait without a timeout, and Python runs its handler on this (main) thread
            # only between slices; SIGTERM went unheard while a lane hung.
            while wait(futures, timeout=_SIGNAL_SLICE_SECONDS).not_done:
                pass
        return [self._outcome(future) for future in futures]

    def _outcome(self, future: Future[None]) -> BaseException | None:
        """A part's error; a part the pool cancelled (closed before it started) did
        not run: :class:`LostLeaseError`, as for a batch abandoned (nothing of it
        is recorded, its rows are delivered again)."""
        if not future.cancelled():
            return future.exception()
        return LostLeaseError(
            f"{self.name}: a lane's part of the batch never started: the trigger was "
            "closed while the batch ran; nothing of the batch is recorded and its rows "
            "are delivered again (close a trigger after its tick returns)",
            poller=self.name,
        )

    def run(
        self,
        events: list[RowChange],
        call: Callable[[list[RowChange]], None],
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Call ``call`` on each lane of ``events`` concurrently; wait for all.

        A batch is settled as a whole: a lane that fails makes its rows the
        failed rows of the batch, as if the handler had raised
        :class:`~dbtrigger.errors.PartialBatchError` naming them.

        Raises:
            LostLeaseError: a lane saw the lease lost.
            PartialBatchError: some lanes failed; it names their rows.
            Exception: every lane failed: the first lane's error.
        """
        parts = split(events, self.size)
        if len(parts) <= 1 and meanwhile is None:
            call(events)
            return
        errors = self.each(parts, call, meanwhile)
        failures = [(p, e) for p, e in zip(parts, errors, strict=True) if e is not None]
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
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()


__all__ = ["Lanes", "moved_from", "split"]
