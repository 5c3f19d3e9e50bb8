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

**What it costs.** One append per commit. The recorder remembers the last
record it wrote; only when the journal does not continue from it (the first
commit of a process, another instance committed in between) does it read the
history's tail first. An idle tick appends nothing, unless the journal's last
entry has stood for a while without this process knowing it recorded (a
crash right after a commit): then it reads the tail once and fills it in.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from dbtrigger.errors import CasConflictError
from dbtrigger.events import RowChange
from dbtrigger.history import records as rec
from dbtrigger.history.store import DEFAULT_RETENTION, HistoryStore, Retention, encode_line
from dbtrigger.state.document import JournalRecord, StateDocument, parse_time
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


class Outcome(Protocol):
    """What a delivered batch's outcome says about each event (runtime ``Delivered``)."""

    @property
    def rejected(self) -> Mapping[str, str]: ...

    @property
    def retried(self) -> Mapping[str, str]: ...


class HistoryRecorder:
    """Keeps one poller's history up with its journal; see the module docstring.

    ``emit`` is the poller's telemetry (``Telemetry.emit``); ``journal_limit``
    tells a hole the journal cannot fill from one it can.
    """

    def __init__(
        self,
        store: HistoryStore,
        poller: str,
        *,
        emit: Emit,
        clock: Callable[[], dt.datetime],
        journal_limit: int,
        source: str | None = None,
        retention: Retention = DEFAULT_RETENTION,
        prune_every_seconds: float = 3600.0,
    ) -> None:
        self.store = store
        self.poller = poller
        self.emit = emit
        self.clock = clock
        self.journal_limit = journal_limit
        self.source = source
        self.retention = retention
        self.prune_every = prune_every_seconds
        #: The newest record this process knows the history holds: (id, seq).
        self._known: tuple[str, int] | None = None
        self._checked: str | None = None
        self._failing = 0
        self._next_prune = 0.0
        self._lock = threading.Lock()

    # --- the runtime's calls (never raise) -------------------------------------------

    def committed(
        self,
        doc: StateDocument,
        entry: JournalEntry | Mapping[str, Any],
        events: Sequence[RowChange],
        outcome: Outcome | None = None,
    ) -> None:
        """A commit landed: ``doc`` is the document written, ``entry`` its journal entry."""
        if isinstance(entry, JournalEntry):
            entry = encode(entry)
        try:
            detail: dict[str, Any] | None = self._detail(doc, events, outcome)
        except Exception:  # noqa: BLE001 - a digest that cannot be made loses detail, not the record
            detail = None
        self._guarded(lambda: self.sync(doc, entry=entry, detail=detail))

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
        self._guarded(lambda: self.sync(doc))

    def _detail(
        self, doc: StateDocument, events: Sequence[RowChange], outcome: Outcome | None
    ) -> dict[str, Any]:
        return rec.batch_detail(
            events,
            rejected=outcome.rejected if outcome is not None else None,
            retried=outcome.retried if outcome is not None else None,
            waiting=rec.waiting_of(doc.window),
            source=self.source,
        )

    def _guarded(self, work: Callable[[], int]) -> None:
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
                return
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

    def _maybe_prune(self) -> None:
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + self.prune_every
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

    def sync(
        self,
        doc: StateDocument,
        *,
        entry: Mapping[str, Any] | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> int:
        """Append what ``doc``'s journal has and the history lacks; how many records.

        ``entry`` is the newest journal entry when the caller just wrote it
        (recorded even with ``journal_limit=0``); ``detail`` goes with it.

        Raises:
            StoreError: the history store failed (nothing is lost: the journal
                still holds the entries, and the next call appends them).
        """
        entries: list[Mapping[str, Any]] = list(doc.journal)
        newest = JournalRecord(entry) if entry is not None else None
        if newest is not None and (not entries or dict(entries[-1]) != dict(newest)):
            entries.append(newest)
        if not entries:
            return 0
        ids = [rec.entry_id(e) for e in entries]
        for _ in range(_ROUNDS):
            missing, after, gap = self._missing(entries, ids)
            if not missing:
                return 0
            records = []
            if gap is not None:
                records.append(gap)
            for e in missing:
                with_detail = detail if newest is not None and e is entries[-1] else None
                records.append(self._fitted(rec.record_of(e, with_detail)))
            try:
                self.store.append(self.poller, records, after_seq=after)
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
            self._known = (records[-1]["id"], after + len(records))
            return len(records)
        raise CasConflictError(
            f"the history of {self.poller!r} kept changing under this writer; tried {_ROUNDS} times"
        )

    def _missing(
        self, entries: Sequence[Mapping[str, Any]], ids: Sequence[str]
    ) -> tuple[list[Mapping[str, Any]], int, dict[str, Any] | None]:
        """The entries to append, the number after which they go, and a gap record."""
        known = self._known
        if known is not None and known[0] in ids:
            return list(entries[ids.index(known[0]) + 1 :]), known[1], None
        if known is not None and len(entries) == 1 and self.journal_limit == 0:
            return list(entries), known[1], None  # no journal to repair from: just append
        tail = self.store.tail(self.poller, len(entries) + 1)
        after = int(tail[-1].get("seq") or 0) if tail else 0
        present = {str(r.get("id")) for r in tail}
        found = [i for i, rid in enumerate(ids) if rid in present]
        if found:
            self._known = (ids[found[-1]], after) if found[-1] == len(ids) - 1 else None
            return list(entries[found[-1] + 1 :]), after, None
        gap = None
        if tail and len(entries) >= self.journal_limit > 0:
            gap = rec.gap_record(
                after=tail[-1], now=self.clock(), missing_from=rec.entry_time(entries[0])
            )
        return list(entries), after, gap

    @staticmethod
    def _fitted(record: dict[str, Any]) -> dict[str, Any]:
        """``record``, its per-event lines dropped when they would make it too large."""
        detail = record.get("detail")
        if not isinstance(detail, dict):
            return record
        lines = ("events", "column", "kind", "values", "keys", "crcs")
        slim = {k: v for k, v in detail.items() if k not in lines}
        bound = rec.columns_size_bound(detail)
        if bound is not None and len(encode_line({**record, "detail": slim})) + bound <= (
            MAX_RECORD_BYTES
        ):
            return record  # fits, told without encoding the columns (most batches)
        if len(encode_line(record)) > MAX_RECORD_BYTES:
            slim["events_omitted"] = len(detail.get("events") or detail.get("crcs") or [])
            if "crcs" in detail:
                slim["digest"] = rec.columns_digest(detail)
            record = {**record, "detail": slim}
        return record


class NoHistory:
    """The recorder of a poller without a history: does nothing."""

    store = None

    def committed(
        self,
        doc: StateDocument,
        entry: JournalEntry | Mapping[str, Any],
        events: Sequence[RowChange],
        outcome: Outcome | None = None,
    ) -> None:
        del doc, entry, events, outcome

    def idle(self, doc: StateDocument | None) -> None:
        del doc


#: The recorder of a trigger without a history (the StateWriter's default).
NO_HISTORY: HistoryRecorder | NoHistory = NoHistory()


def recorder_for(
    option: object, trigger: Any
) -> tuple[HistoryStore | None, HistoryRecorder | NoHistory]:
    """``PollTrigger(history=option)``: the history store and the recorder that
    keeps it (see :func:`dbtrigger.history.derive.resolve_history`)."""
    from dbtrigger.history.derive import resolve_history  # noqa: PLC0415 - derive imports stores

    store = resolve_history(option, trigger.store)
    if store is None:
        return None, NO_HISTORY
    retention = getattr(store, "retention", None)
    recorder = HistoryRecorder(
        store,
        trigger.name,
        emit=trigger.telemetry.emit,
        clock=trigger.clock,
        journal_limit=trigger.journal_limit,
        retention=retention if isinstance(retention, Retention) else DEFAULT_RETENTION,
    )
    return store, recorder


def record_write(
    store: Any, doc: StateDocument, *, history: HistoryStore | None = None
) -> str | None:
    """After a manual write of ``doc`` to checkpoint ``store``: append the journal's new
    entries to the history beside it (or ``history``). Returns what went wrong, if
    anything, for the command to say; never raises (the write stands, and the
    poller's next commit fills the history in from the journal)."""
    from dbtrigger.history.derive import history_for  # noqa: PLC0415 - derive imports stores

    target = history if history is not None else history_for(store)
    if target is None:
        return None
    recorder = HistoryRecorder(
        target,
        doc.poller_name,
        emit=lambda *args, **kwargs: None,
        clock=lambda: dt.datetime.now(dt.timezone.utc),
        journal_limit=max(len(doc.journal), 1),
    )
    try:
        recorder.sync(doc)
    except Exception as exc:  # noqa: BLE001 - the write stands; said by the caller
        return (
            f"the history ({target.describe()}) could not be appended ({type(exc).__name__}: "
            f"{exc}); the journal holds the entry, and the poller's next commit fills it in"
        )
    return None


__all__ = [
    "MAX_RECORD_BYTES",
    "NO_HISTORY",
    "HistoryRecorder",
    "NoHistory",
    "record_write",
    "recorder_for",
]
