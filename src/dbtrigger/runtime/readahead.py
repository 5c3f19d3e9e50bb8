"""Read-ahead: the next batch's read runs on a background thread while the
handler and the commit of this batch run.

A catch-up is a sequence of (read, hand over, commit). The read mostly waits
on the server (the driver releases the GIL), the rest is the client's CPU, so
overlapping them is the largest saving left on a narrow table: the server
reads batch N+1 while the handler and the commit of batch N run.

What runs on the background thread is the source's ``fetch`` alone: no retry,
no telemetry, no choice against the settled window. Those stay on the tick's
thread and run when the read is *taken*, exactly as after a read made then.

**When a read-ahead is started** (the default, adaptive): only while the
reads wait long enough to be worth the hand-off. The tick times its own reads
(wall less its thread's CPU: the server's and the network's time, what an
overlap can hide) and starts a read-ahead only while its last :data:`SAMPLES`
reads each waited :data:`MIN_WAIT_SECONDS`; then one batch in
:data:`PROBE_EVERY` is read by the tick again, to measure. On localhost a
100-row read waits about 0.2 ms and the hand-off's CPU (about 50-150 us a
batch) would be lost; across a network every read waits a round trip.
``always`` starts one after every batch. Either way, which read is *used* is
decided as below.

**When a read-ahead is used.** A read is started after where this batch
leaves the checkpoint *if every event is accepted* (and the limit the window
then gives), tagged with the tick's lease session. It is used only if the
tick then asks for exactly that read: the same position, the same limit, the
same session (so the same lease and fencing token: nothing written by anyone
else in between). Anything else drops it and the tick reads again: a handler
that failed or asked for retries (the batch lands elsewhere), a partial
commit, a commit that lost the lease, a tick told to stop, a read that
failed (the tick's own read retries as usual), ``close()``. A read has
nothing to undo, and its rows are handed out only after this batch's commit
succeeded under the same lease, so at-least-once, ordering and fencing are
those of the sequential read; the visibility guard's bound is computed by the
read itself, so a read made earlier is as safe as one made later.

**Across ticks.** A tick that stops at ``max_batches_per_tick`` with more rows
pending (``dbtrigger run`` does one batch a tick and ticks again at once)
keeps its last read-ahead for the next tick, which uses it only if the state
document it reads is the one this tick's last commit wrote (its etag) and
the read is at most :data:`CARRY_SECONDS` old. Anything else drops it.

**Which sources.** A source opts in with a true ``concurrent_reads``
attribute (:func:`reads_ahead`): its ``fetch`` may run on another thread
while the tick's thread makes its other calls (the commit's lag measurement),
each on a connection of its own. One that cannot be read from another thread
(an in-memory SQLite database, a fake whose fetches are counted) leaves it
out. Only one read is ever in flight, and a checkpoint acknowledgement waits
for it (:meth:`ReadAhead.quiet`). A read carried into the next tick goes on
while the tick returns: the next tick's first read takes or drops it, and a
failed or busy tick and ``close()`` drop it (waiting for it to end).

**The GIL.** The reader needs the GIL to start its read (the statement's
Python side, up to the driver's first wait on the server), and the tick's
thread, running the handler and the commit, would keep it until it blocks
itself. So :meth:`ReadAhead.start` waits (at most
:data:`HEAD_START_SECONDS`) for the reader to pick the read up: what
overlaps is the server's (and the network's) time, while the rows are
turned into Python objects when the tick's thread next waits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dbtrigger._gc import gc_paused
from dbtrigger.cursor import Position

#: How old a read carried to the next tick may be when that tick takes it.
CARRY_SECONDS = 1.0

#: How long a read's start may wait for the reader thread to pick it up.
HEAD_START_SECONDS = 0.0005

#: How long the idle reader thread waits for the next read before it exits.
LINGER_SECONDS = 2.0

#: Adaptive read-ahead (the default): the reads must wait at least this long
#: (a read's wall time less its thread's CPU time: the server and the network)
#: for a read-ahead to be started. A read-ahead costs the client about 130-170 us
#: of CPU a batch (the hand-off to the reader and back, the head-start wait, the
#: wake-ups) and can save at most the read's wait; on localhost PostgreSQL a
#: 100-row read waits about 0.1-0.3 ms and overlapping it saves nothing (the GIL
#: serialises the rest), while a database across a network waits a round trip
#: (0.5-2 ms in a region) on every read. See benchmarks/README.md "Read-ahead".
MIN_WAIT_SECONDS = 0.0008

#: How many of the tick's own reads are looked at (all must wait that long).
SAMPLES = 3

#: While reading ahead, one read in this many is made by the tick itself again,
#: to see whether the reads still wait (costs 1/PROBE_EVERY of the overlap).
PROBE_EVERY = 32

#: What a source's fetch returns.
Rows = Sequence[Mapping[str, Any]]


def reads_ahead(source: object) -> bool:
    """May the source's ``fetch`` run on another thread than its other calls?"""
    return getattr(source, "concurrent_reads", False) is True


class Flight:
    """One read: where from, under which tag, and (once done) its rows or error."""

    __slots__ = (
        "after",
        "done",
        "error",
        "finished",
        "limit",
        "rows",
        "seconds",
        "started",
        "tag",
    )

    def __init__(self, after: Position, limit: int, tag: object) -> None:
        self.after = after
        self.limit = limit
        self.tag = tag
        self.started = threading.Event()
        self.done = threading.Event()
        self.rows: Rows | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        #: time.monotonic() when the read ended.
        self.finished = 0.0

    def run(self, fetch: Callable[[Position, int], Rows]) -> None:
        started = time.perf_counter()
        self.started.set()
        try:
            with gc_paused():
                self.rows = fetch(self.after, self.limit)
        except BaseException as exc:  # noqa: BLE001 - kept: the tick reads again itself
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - started
            self.finished = time.monotonic()
            self.done.set()


class ReadAhead:
    """The read-ahead of one trigger: at most one read at a time, on one thread
    that exits after :data:`LINGER_SECONDS` without work (the next read starts
    it again). See the module docstring for when a read is used.

    ``always``: start a read-ahead after every batch that may have more (what
    ``PollTrigger(read_ahead="always")`` asks for, and tests that pin the
    read-ahead's cases). Otherwise (the default) only while the tick's own
    reads wait long enough to be worth overlapping (:meth:`wanted`)."""

    def __init__(
        self,
        fetch: Callable[[Position, int], Rows],
        *,
        name: str,
        linger: float = LINGER_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        always: bool = False,
    ) -> None:
        self.fetch = fetch
        self.name = name
        self.linger = linger
        self.monotonic = monotonic
        self.always = always
        #: The last SAMPLES waits of the tick's own reads (seconds).
        self.waits: deque[float] = deque(maxlen=SAMPLES)
        self._since_probe = 0
        #: Batches after which no read-ahead was started because the reads were fast.
        self.skipped = 0
        self._flight: Flight | None = None
        self._queued: Flight | None = None
        self._wake = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        #: A read given up while in flight (:meth:`abandon`): the next use waits for it.
        self._abandoned: Flight | None = None
        #: Reads started / used / dropped (for tests and the benchmark).
        self.started = 0
        self.used = 0
        self.dropped = 0

    def wanted(self) -> bool:
        """Start a read-ahead after this batch?

        Always with ``always``; otherwise only while the last :data:`SAMPLES`
        reads the tick made itself each waited at least :data:`MIN_WAIT_SECONDS`
        (:meth:`observe`), and then not after one batch in
        :data:`PROBE_EVERY`, so that the tick reads itself and measures again:
        reads that became fast turn read-ahead off at the next such read."""
        if self.always:
            return True
        waits = self.waits
        if len(waits) < SAMPLES or min(waits) < MIN_WAIT_SECONDS:
            self.skipped += 1
            return False
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            self.skipped += 1
            return False
        return True

    def observe(self, wait: float) -> None:
        """One of the tick's own reads waited ``wait`` seconds (wall less CPU)."""
        self.waits.append(wait)

    @property
    def pending(self) -> Flight | None:
        """The read started and not yet taken or dropped (None: none)."""
        return self._flight

    def start(self, after: Position, limit: int, tag: object) -> None:
        """Read ``limit`` rows after ``after`` on the reader thread (one held before is dropped)."""
        self.drop()  # (and waits for an abandoned read: one read at a time)
        flight = Flight(after, limit, tag)
        self._flight = flight
        self.started += 1
        with self._wake:
            self._queued = flight
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name=f"dbtrigger-readahead-{self.name}", daemon=True
                )
                try:
                    thread.start()  # (it waits for this lock before it looks at anything)
                except RuntimeError:
                    # No thread to be had (a container's pids limit, interpreter
                    # shutdown): nothing is read ahead, the tick reads itself.
                    self._queued = self._flight = None
                    self.dropped += 1
                    return
                self._thread = thread
            else:
                self._wake.notify()
        # Let the reader run up to the read's first wait on the server before this
        # thread goes on: it needs the GIL to start the read, and a thread that
        # holds it (the tick's, running the handler and the commit) would
        # otherwise keep it until it blocks itself - after the work the read was
        # to overlap. Bounded: a reader the OS does not schedule at once is not
        # waited for.
        flight.started.wait(HEAD_START_SECONDS)

    def retag(self, old: object, new: object) -> None:
        """The read tagged ``old`` now stands for ``new`` (a tick's carried read,
        once the etag of its last commit is known)."""
        flight = self._flight
        if flight is not None and flight.tag == old:
            flight.tag = new

    def take(
        self,
        after: Position,
        limit: int,
        tag: object,
        *,
        max_age: float | None = None,
        full_only: bool = False,
    ) -> Flight | None:
        """The read, done, if it is exactly this one (the same position, limit
        and tag) and it worked (and ended at most ``max_age`` seconds ago, and
        with ``full_only`` came back full); None otherwise. Either way nothing
        is held afterwards.

        ``full_only`` is for a read carried into another tick: rows committed
        since it ended sort after a full read's rows, so a fresh read would
        begin with the same rows; after a short or empty one they would be
        missing, and the tick would report nothing new while rows wait (a
        worker that re-polls after a delivering tick would then sleep its
        interval on them)."""
        self._await_abandoned()  # the tick's own read must not run beside it
        flight = self._flight
        if flight is None:
            return None
        self._flight = None
        flight.done.wait()
        if (
            flight.error is None
            and flight.tag == tag
            and flight.limit == limit
            and flight.after == after
            and (max_age is None or self.monotonic() - flight.finished <= max_age)
            and (not full_only or (flight.rows is not None and len(flight.rows) >= limit))
        ):
            self.used += 1
            return flight
        self.dropped += 1
        return None

    def quiet(self) -> None:
        """Wait until no read is in flight (the read, if any, is kept)."""
        self._await_abandoned()
        flight = self._flight
        if flight is not None:
            flight.done.wait()

    def drop(self) -> None:
        """Drop the read held (waiting for it to end first)."""
        self._await_abandoned()
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.done.wait()
            self.dropped += 1

    def abandon(self) -> None:
        """Drop the read held without waiting for it: the tick was interrupted
        (a second Ctrl-C or SIGTERM to ``dbtrigger run``, ``SystemExit``), and
        the worker must stop now, not after a read that a lock on the table may
        hold for minutes. The reader thread (a daemon) finishes the read on its
        own; the next use of this read-ahead, and the next tick's own read,
        wait for it first, so two reads never run at once."""
        flight, self._flight = self._flight, None
        if flight is not None:
            self.dropped += 1
            if not flight.done.is_set():
                self._abandoned = flight

    def _await_abandoned(self) -> None:
        flight, self._abandoned = self._abandoned, None
        if flight is not None:
            flight.done.wait()

    def close(self) -> None:
        """Drop the read held and stop the thread (it starts again on the next read).
        A read abandoned in flight is not waited for (see :meth:`abandon`)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.done.wait()
            self.dropped += 1
        with self._wake:
            thread = self._thread
            self._thread = None
            self._wake.notify_all()
        abandoned = self._abandoned
        busy = abandoned is not None and not abandoned.done.is_set()
        if thread is not None and thread is not threading.current_thread() and not busy:
            thread.join()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._wake:
                if self._queued is None and self._thread is me:
                    self._wake.wait(self.linger)
                flight, self._queued = self._queued, None
                if flight is None:  # lingered without work, or closed
                    if self._thread is me:
                        self._thread = None
                    return
            flight.run(self.fetch)


__all__ = [
    "CARRY_SECONDS",
    "MIN_WAIT_SECONDS",
    "PROBE_EVERY",
    "SAMPLES",
    "Flight",
    "ReadAhead",
    "reads_ahead",
]
