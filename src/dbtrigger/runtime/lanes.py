"""Parallel lanes: one batch handed to the handler as several concurrent calls.

``PollTrigger(..., max_concurrency=N)`` splits each batch into at most ``N``
lanes by a stable hash of the primary key (:func:`lane_of`), so the same key
is never handled by two calls at once and one key's events reach the handler
in cursor order (a lane keeps the batch's order). The lanes run at the same
time in worker threads: a synchronous handler blocks its own thread only, an
async one runs as a task on its lane's loop (or, through ``tick_async``, on
the caller's loop). An I/O-bound handler therefore handles ``N`` rows at a
time.

The lanes share the batch's context: one fencing token, one lease-lost flag
(a lost lease cancels every lane), one set of per-event marks. They have no
cursor of their own: the batch is settled as a whole, and a lane that fails
makes its rows the failed rows of the batch (as if the handler had raised
:class:`~dbtrigger.errors.PartialBatchError` naming them): the other lanes'
rows are settled, the failing lane's come again. Storage cost is unchanged:
one commit per batch, however many lanes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from dbtrigger.cursor import pk_hash
from dbtrigger.errors import LostLeaseError, PartialBatchError
from dbtrigger.events import RowChange


def lane_of(event: RowChange, lanes: int) -> int:
    """The lane of ``event``: a stable hash of its primary key, modulo ``lanes``."""
    return int(pk_hash(event.pk), 16) % lanes


def split(events: Sequence[RowChange], lanes: int) -> list[list[RowChange]]:
    """The non-empty lanes of a batch, each in batch (cursor) order."""
    parts: list[list[RowChange]] = [[] for _ in range(lanes)]
    for event in events:
        parts[lane_of(event, lanes)].append(event)
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

    def run(self, events: list[RowChange], call: Callable[[list[RowChange]], None]) -> None:
        """Call ``call`` on each lane of ``events`` concurrently; wait for all.

        Raises:
            LostLeaseError: a lane saw the lease lost.
            PartialBatchError: some lanes failed; it names their rows.
            Exception: every lane failed: the first lane's error.
        """
        parts = split(events, self.size)
        if len(parts) <= 1:
            call(events)
            return
        futures = [self._executor().submit(call, part) for part in parts]
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
