"""Appending a poller's journal to its history: after the commit, never against it.

**Where the truth is.** A commit is the conditional write of the state
document, journal entry included. The history append comes after it, as a
separate write to another object, and can therefore fail or be cut short by a
crash while the commit stands. So the history is *derived from the journal*:
every append first looks for the journal entries the history does not have
yet (the journal keeps the last ``journal_limit`` of them) and appends them
all, in journal order. A crash between a commit and its append, or a history
store that is down for a while, leaves a hole that the next append fills
from the journal; only an outage longer than the journal reaches back leaves
a real one, and then a ``gap`` record says so where it is. Records are never
appended before their commit landed, so the history has no phantom batches.

**What a failure does.** Nothing to the tick: the commit has landed, the
batch is done, the next batch goes on. The failure is counted
(``history_append_failures_total``) and logged once per outage at WARNING
(``history_append_failed``; at DEBUG while it lasts, ``history_append_recovered``
at INFO when an append works again and fills the hole).

**Off the tick's path.** A commit queues its record with its document's
journal and what its detail is made of (the batch's events); the trigger's
appender thread makes the details (the digests of every event, most of the
history's CPU) and writes whatever is queued in ONE append per round, so
commits that come faster than appends share a store write, and the tick
never waits for the history.
Records still go in journal order, never before their commit landed (they
are queued after it). The queued journals chain (each document's journal
holds the entry the one before it ends with), so a slow store that falls
behind by more than a journal still gets every commit, other writers'
entries in between too; a round that fails is not kept (the next round's
journals fill it in, as they did when the append ran on the committing
thread, and an outage longer than the journal leaves a ``gap`` record). The
queue is bounded: past ``PENDING_DETAIL_BYTES`` of details
the oldest commits' details go (their records stay, without), past
``MAX_PENDING`` commits the oldest go (the journal repair, or a ``gap``
record, stands in for them). :meth:`HistoryRecorder.flush` waits, for a
bounded time, until what is queued has been tried; the trigger flushes when
it hands control back (``tick()``, ``run()``, ``drain()``, a Functions
invocation) and on ``close()`` (the runner's stop); an interpreter exit
flushes too. The thread ends after ``IDLE_SECONDS`` with nothing queued (a
trigger dropped without ``close()`` leaves none behind) and the next commit
starts another.

**What it costs.** One append per round. The recorder remembers the last
record it wrote; only when the journal does not continue from it (the first
commit of a process, another instance committed in between) does it read the
history's tail first. An idle tick appends nothing, unless the journal's last
entry has stood for a while without this process knowing it recorded (a
crash right after a commit): then it reads the tail once and fills it in.
"""

from __future__ import annotations

import atexit
import datetime as dt
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

from dbtrigger.errors import CasConflictError
from dbtrigger.events import RowChange
from dbtrigger.history import records as rec
from dbtrigger.history.chains import Detail, Pending, chains_of, overtaken
from dbtrigger.history.kept_rows import kept
from dbtrigger.history.store import (
    DEFAULT_RETENTION,
    SEQ_PREFIX,
    EncodedRecord,
    HistoryStore,
    Retention,
    encode_line,
)
from dbtrigger.state.document import StateDocument, parse_time
from dbtrigger.state.journal import JournalEntry, encode

Emit = Callable[..., None]

#: A record larger than this keeps its digests but not its per-event lines
#: (every store takes it: a Table entity holds about 500 KB of text).
MAX_RECORD_BYTES = 400 * 1024
#: How long an idle tick leaves the journal's last entry to its writer before
#: checking that the history has it.
SETTLE_SECONDS = 30.0
#: Attempts at one append when other writers keep appending first.
_ROUNDS = 4
#: Records one store write carries at most: a record is at most MAX_RECORD_BYTES,
#: so an append stays under the 4 MiB of an Azure append block or table batch.
APPEND_RECORDS = 8
#: Commits the appender's queue holds at most (their journal entries: a few
#: hundred bytes each); past that the oldest goes, and the journal repair, or a
#: gap record, stands in for it.
MAX_PENDING = 2000
#: The details the queue holds at most, by an estimate of the memory they hold
#: until made (their batches' events); past that the oldest commits' details go
#: (their records stay, without).
PENDING_DETAIL_BYTES = 16 * 1024 * 1024
#: ... an event counted as this many bytes.
EVENT_BYTES = 512
#: A round of the appender starts at most this often: the commits in between
#: share its store write (group commit), which on a file or SQLite store beside
#: the state is also a write the state's commits do not wait behind.
ROUND_SECONDS = 0.05
#: An appender thread with nothing queued for this long ends (the next commit
#: starts another).
IDLE_SECONDS = 10.0
#: How long a flush (tick(), drain(), close(), a Functions invocation) waits for the
#: appender at most; what is still queued then stays queued, and the journal has it.
FLUSH_SECONDS = 10.0


class Outcome(Protocol):
    """What a delivered batch's outcome says about each event (runtime ``Delivered``)."""

    @property
    def rejected(self) -> Mapping[str, str]: ...

    @property
    def retried(self) -> Mapping[str, str]: ...


@dataclass(eq=False, repr=False)
class HistoryRecorder:
    """Keeps one poller's history up with its journal; see the module docstring.

    ``emit`` is the poller's telemetry (``Telemetry.emit``); ``journal_limit``
    tells a hole the journal cannot fill from one it can, and bounds the queue.
    ``background=False`` appends on the committing thread instead (the cost
    the appender thread takes off the tick; ``benchmarks.history`` shows both).
    """

    store: HistoryStore
    poller: str
    _: KW_ONLY
    emit: Emit
    clock: Callable[[], dt.datetime]
    journal_limit: int
    source: str | None = None
    retention: Retention = DEFAULT_RETENTION
    prune_every_seconds: float = 3600.0
    background: bool = True

    def __post_init__(self) -> None:
        #: The newest record this process knows the history holds: (id, seq).
        self._known: tuple[str, int] | None = None
        self._checked: str | None = None
        self._failing = 0
        self._next_prune = 0.0
        self._lock = threading.Lock()
        # The appender's queue and its bookkeeping, all under _cond: _queued counts
        # what was ever queued, _tried what a finished round covered (a flush waits
        # for it to reach what was queued when it was called).
        self._cond = threading.Condition()
        self._pending: deque[Pending] = deque()
        self._detailed: deque[Pending] = deque()  # those still with a detail, oldest first
        self._detail_bytes = 0
        self._queued = 0
        self._tried = 0
        self._written = True  # whether the last round was
        self._flushing = 0  # callers waiting in flush()
        self._hung: int | None = None  # _tried when a flush gave up waiting for a round
        self._round_at = 0.0  # when the last round started (monotonic)
        #: Rounds start at most this often (see ROUND_SECONDS).
        self.round_seconds = ROUND_SECONDS
        self._closing = False
        self._dropped = [0, 0]  # since the last round: records, details
        self._overflowing = False
        self._thread: threading.Thread | None = None

    # --- the runtime's calls (never raise) -------------------------------------------

    def committed(
        self,
        doc: StateDocument,
        entry: JournalEntry | Mapping[str, Any],
        events: Sequence[RowChange],
        outcome: Outcome | None = None,
    ) -> None:
        """A commit landed: ``doc`` is the document written, ``entry`` its journal entry.

        Queues the record, with what its detail is made of, for the appender
        thread; does not wait for it."""
        if isinstance(entry, JournalEntry):
            entry = encode(entry)
        try:
            make = self._detail(doc, events, outcome)
        except Exception:  # noqa: BLE001 - a digest that cannot be made loses detail, not the record
            make = None
        cost = 256 + EVENT_BYTES * len(events) if make is not None else 0
        self._submit(Pending(tuple(doc.journal), entry, make, cost))

    def idle(self, doc: StateDocument | None) -> None:
        """An idle tick read ``doc``: fill in a record a crash may have cut off."""
        if doc is None or not doc.journal:
            return
        last = doc.journal[-1]
        last_id = rec.entry_id(last)
        if (self._known is not None and self._known[0] == last_id) or self._checked == last_id:
            return
        when = rec.entry_time(last)
        try:
            age = (self.clock() - parse_time(when, "at")).total_seconds() if when else None
        except Exception:  # noqa: BLE001 - an entry without a readable time is checked now
            age = None
        if age is not None and age < SETTLE_SECONDS:
            return  # its writer is probably appending it right now
        self._checked = last_id
        self._submit(Pending(tuple(doc.journal)))

    def flush(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Wait (at most ``timeout`` seconds) until everything queued so far has
        been tried; whether it is all written. Never raises: a round that failed
        was counted and logged, and the journal holds what it could not write."""
        with self._cond:
            target = self._queued
            if self._hung is not None and self._tried == self._hung:
                return False  # still in the round a flush gave up on: not waited for again
            self._flushing += 1
            self._cond.notify_all()
            try:
                done = self._cond.wait_for(lambda: self._tried >= target, timeout)
            finally:
                self._flushing -= 1
            if done:
                return self._written
            self._hung = self._tried
        self.emit(
            "history_append_hung",
            "the history append of %s has not returned for %g s (its store hangs: a network "
            "partition, a lock held); ticks no longer wait for it until it returns (said "
            "once). The commits stand; what it misses is recorded from the journal",
            self.poller,
            timeout,
        )
        return False

    def close(self, timeout: float = FLUSH_SECONDS) -> bool:
        """:meth:`flush`, then stop the appender thread (it starts again with the
        next commit); whether everything queued was written."""
        written = self.flush(timeout)
        with self._cond:
            thread, self._closing = self._thread, True
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout if written else 0.0)  # a store that hangs: waited for once
        with self._cond:
            if self._thread is thread and (thread is None or not thread.is_alive()):
                self._thread = None  # (one still stuck in the store stays the appender)
            self._closing = False
        return written

    # --- the appender thread ---------------------------------------------------------

    def _submit(self, item: Pending) -> None:
        if not self.background:
            self._written = self._round([item])
            return
        with self._cond:
            if len(self._pending) >= MAX_PENDING:
                oldest = self._pending.popleft()  # as if its append had failed
                if oldest.detail is not None:
                    self._detail_bytes -= oldest.drop_detail()
                    self._detailed.popleft()
                self._dropped[0] += 1
            self._pending.append(item)
            if item.detail is not None:
                self._detailed.append(item)
                self._detail_bytes += item.cost
            while self._detail_bytes > PENDING_DETAIL_BYTES and len(self._detailed) > 1:
                self._detail_bytes -= self._detailed.popleft().drop_detail()
                self._dropped[1] += 1
            self._queued += 1
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name=f"dbtrigger-history-{self.poller}", daemon=True
                )
                thread.start()
                self._thread = thread
                _RUNNING.add(self)
            elif len(self._pending) == 1 or len(self._pending) == APPEND_RECORDS:
                # Woken only when it has something to do: a first commit to take (it
                # then waits out the round's interval, which the commits meanwhile
                # share), or a full store write's worth. A wake-up a commit costs the
                # committing thread its GIL twice.
                self._cond.notify_all()

    def _run(self) -> None:
        """Rounds: take everything queued, write it in one append, until closed."""
        try:
            self._rounds()
        finally:
            self._gone()

    def _gone(self) -> None:
        """The appender thread ends: the next commit starts another (said under the
        lock in which it saw nothing queued, so no commit is left to a thread that
        is going)."""
        with self._cond:
            if self._thread is threading.current_thread():
                self._thread = None

    def _rounds(self) -> None:
        while True:
            with self._cond:
                if (
                    not self._cond.wait_for(
                        lambda: self._closing or bool(self._pending), IDLE_SECONDS
                    )
                    or not self._pending
                ):
                    # Idle (a trigger dropped without close() leaves no thread
                    # behind), or closing.
                    self._gone()
                    return
                # Group commit: a round starts at most every round_seconds, so the
                # commits meanwhile share its write (a flush or close goes at once).
                self._cond.wait_for(
                    lambda: (
                        self._closing or self._flushing > 0 or len(self._pending) >= APPEND_RECORDS
                    ),
                    self._round_at + self.round_seconds - time.monotonic(),
                )
                self._round_at = time.monotonic()
                batch = list(self._pending)
                self._pending.clear()
                self._detailed.clear()
                self._detail_bytes = 0
                upto = self._queued
                (records, details), self._dropped = self._dropped, [0, 0]
            self._said_overflow(records, details)
            # A round that failed is not kept: as for an append on the committing
            # thread, the next round's journals fill it in (without the details).
            written = self._round(batch)
            with self._cond:
                self._written = written
                self._tried = upto
                hung, self._hung = self._hung, None
                self._cond.notify_all()
            if hung is not None:
                self.emit(
                    "history_append_returned", "the history append of %s returned", self.poller
                )

    def _said_overflow(self, records: int, details: int) -> None:
        if not (records or details):
            self._overflowing = False
            return
        if self._failing:
            return  # an outage: its own event said so
        self.emit(
            "history_queue_overflow" if not self._overflowing else "history_queue_overflow_again",
            "the history store of %s fell so far behind the commits that the appender's queue "
            "let go of %d record(s) (filled in from the journal while it still holds them, "
            "else marked by a gap record) and of the per-event detail of %d (said once until "
            "it keeps up again)",
            self.poller,
            records,
            details,
            values={"count": records + details},
        )
        self._overflowing = True

    def _round(self, batch: Sequence[Pending]) -> bool:
        """Append what ``batch`` (queued in order) and its documents' journals hold
        and the history lacks; whether it was written."""
        chains = chains_of(batch, self._known, self.journal_limit)
        return self._guarded(
            lambda: sum(self._sync(chain, details, ids) for chain, ids, details in chains)
        )

    def _detail(
        self, doc: StateDocument, events: Sequence[RowChange], outcome: Outcome | None
    ) -> Callable[[], Detail]:
        """What makes the detail of a commit of ``events`` later (what it reads of
        the document and the outcome is taken now)."""
        rejected = outcome.rejected if outcome is not None else None
        retried = outcome.retried if outcome is not None else None
        # (A batch with marked events keeps them: its detail reads every id.)
        batch = tuple(events) if rejected or retried else kept(events)
        waiting = rec.waiting_of(doc.window)
        source = self.source

        def make() -> Detail:
            return rec.encoded_detail(
                batch, rejected=rejected, retried=retried, waiting=waiting, source=source
            )

        return make

    def _guarded(self, work: Callable[[], int]) -> bool:
        with self._lock:
            try:
                appended = work()
            except Exception as exc:  # noqa: BLE001 - the commit stands whatever happens here
                self._known = None
                if not self._failing:
                    self.emit(
                        "history_append_failed",
                        "could not append to the history of %s (%s: %s); the commit stands, "
                        "and the next append fills the hole from the journal (said once "
                        "until an append works again)",
                        self.poller,
                        type(exc).__name__,
                        exc,
                        error_type=type(exc).__name__,
                    )
                else:
                    self.emit(
                        "history_append_failed_again",
                        "history append failed again: %s",
                        exc,
                        error_type=type(exc).__name__,
                    )
                self._failing += 1
                return False
            if self._failing:
                self.emit(
                    "history_append_recovered",
                    "history appends work again after %d failure(s); the records missed "
                    "meanwhile were filled in from the journal",
                    self._failing,
                    failures=self._failing,
                )
                self._failing = 0
            if appended:
                self.emit("history_appended", values={"count": appended})
            self._maybe_prune()
            return True

    def _maybe_prune(self) -> None:
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + self.prune_every_seconds
        try:
            removed = self.store.prune(self.poller, self.retention, self.clock())
        except Exception as exc:  # noqa: BLE001 - retention is housekeeping
            self.emit("history_prune_failed", "history pruning failed (tried again later): %s", exc)
            return
        if removed:
            self.emit(
                "history_pruned",
                "pruned %d history record(s) past retention",
                removed,
                values={"count": removed},
            )

    # --- the work (raises) -----------------------------------------------------------

    def sync(self, doc: StateDocument) -> int:
        """Append what ``doc``'s journal has and the history lacks; how many records.

        Raises:
            StoreError: the history store failed (nothing is lost: the journal
                still holds the entries, and the next call appends them).
        """
        journal = list(doc.journal)
        return self._sync(journal, {}, [rec.entry_id(e) for e in journal])

    def _sync(
        self,
        journal: Sequence[Mapping[str, Any]],
        details: Mapping[str, Detail],
        ids: Sequence[str],
    ) -> int:
        """:meth:`sync` of the entries ``journal`` (in journal order, their ids
        ``ids``), with the detail of each by entry id; in as few store writes as
        their size allows (one, unless more than ``APPEND_RECORDS`` are missing)."""
        if not journal:
            return 0
        for _ in range(_ROUNDS):
            first, after, gap = self._missing(journal, ids)
            if first >= len(journal):
                return 0
            records = []
            if gap is not None:
                records.append(gap)
            for e, eid in zip(journal[first:], ids[first:], strict=True):
                detail, text = details.get(eid) or (None, None)
                seq = after + len(records) + 1  # (numbered now: the stores keep it)
                record = rec.record_of(e, detail, record_id=eid, detail_json=text, seq=seq)
                records.append(self._fitted(record))
            try:
                for start in range(0, len(records), APPEND_RECORDS):
                    part = records[start : start + APPEND_RECORDS]
                    self.store.append(self.poller, part, after_seq=after)
                    after += len(part)
                    self._known = (part[-1]["id"], after)
            except CasConflictError:
                self._known = None  # someone appended meanwhile: read the tail again
                continue
            if gap is not None:
                self.emit(
                    "history_gap",
                    "the history of %s missed entries for longer than the journal reaches "
                    "back; a gap record marks where",
                    self.poller,
                )
            return len(records)
        raise CasConflictError(
            f"the history of {self.poller!r} kept changing under this writer; tried {_ROUNDS} times"
        )

    def _missing(
        self, entries: Sequence[Mapping[str, Any]], ids: Sequence[str]
    ) -> tuple[int, int, dict[str, Any] | None]:
        """Where the entries to append start, the number after which they go, and a
        gap record."""
        known = self._known
        if known is not None and known[0] in ids:
            return ids.index(known[0]) + 1, known[1], None
        if known is not None and self.journal_limit == 0:
            return 0, known[1], None  # no journal to repair from: just append
        tail = self.store.tail(self.poller, len(entries) + 1)
        after = int(tail[-1].get("seq") or 0) if tail else 0
        if overtaken(tail, entries):  # (a paused process's late append): nothing to add
            self.emit(
                "history_overtaken",
                "the history of %s was written on under a later lease while %d of this "
                "writer's record(s) waited; that writer recorded them, so they are not "
                "appended again",
                self.poller,
                len(entries),
            )
            return len(entries), after, None
        present = {str(r.get("id")) for r in tail}
        found = [i for i, rid in enumerate(ids) if rid in present]
        if found:
            self._known = (ids[found[-1]], after) if found[-1] == len(ids) - 1 else None
            return found[-1] + 1, after, None
        gap = None
        # A full journal has dropped entries: what the history lacks may go back
        # further. With no history at all (a history directory removed, a new table,
        # a history turned on for a poller that committed before) the records begin
        # with a gap record, not as if the poller's first commit were this one.
        if len(entries) >= self.journal_limit > 0:
            gap = rec.gap_record(
                after=tail[-1] if tail else None,
                now=self.clock(),
                missing_from=rec.entry_time(entries[0]),
            )
        return 0, after, gap

    @staticmethod
    def _fitted(record: dict[str, Any]) -> dict[str, Any]:
        """``record``, its per-event lines dropped when they would make it too large."""
        detail = record.get("detail")
        if not isinstance(detail, dict):
            return record
        if _size(record) > MAX_RECORD_BYTES:
            lines = ("events", "column", "kind", "values", "keys", "crcs")
            slim = {k: v for k, v in detail.items() if k not in lines}
            slim["events_omitted"] = len(detail.get("events") or detail.get("crcs") or [])
            if "crcs" in detail:
                slim["digest"] = rec.columns_digest(detail)
            record = {**record, "detail": slim}
        return record


def _size(record: dict[str, Any]) -> int:
    """The length of ``record``'s line numbered 0 (a kept line is not encoded again)."""
    if type(record) is EncodedRecord:
        return len(SEQ_PREFIX) + 1 + len(record.rest)
    return len(encode_line({**record, "seq": 0}))


#: Recorders whose appender thread was started: flushed when the interpreter exits
#: (a script that drains without closing its trigger still leaves its history whole).
_RUNNING: weakref.WeakSet[HistoryRecorder] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for recorder in list(_RUNNING):
        recorder.flush()


__all__ = [
    "FLUSH_SECONDS",
    "MAX_RECORD_BYTES",
    "HistoryRecorder",
    "Outcome",
]
