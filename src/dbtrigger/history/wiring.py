"""Which recorder a trigger or an operator's write gets: none (``history=False``),
or a :class:`~dbtrigger.history.recorder.HistoryRecorder` on the history store
beside the checkpoint store (see :func:`dbtrigger.history.derive.resolve_history`).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from dbtrigger.events import RowChange
from dbtrigger.history import records as rec
from dbtrigger.history.recorder import FLUSH_SECONDS, SETTLE_SECONDS, HistoryRecorder, Outcome
from dbtrigger.history.store import DEFAULT_RETENTION, HistoryStore, Retention
from dbtrigger.state.document import StateDocument, parse_time
from dbtrigger.state.journal import JournalEntry


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

    def flush(self, timeout: float = FLUSH_SECONDS) -> bool:
        del timeout
        return True

    def close(self, timeout: float = FLUSH_SECONDS) -> bool:
        del timeout
        return True


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


#: How long an operator's write waits, at most, for a poller's recent commits to be
#: recorded by their writer (with their per-event detail) before recording them
#: from the journal itself (without).
WRITER_WAIT_SECONDS = 3.0


def record_write(
    store: Any,
    doc: StateDocument,
    *,
    history: HistoryStore | Literal[False] | None = None,
    wait: float | None = None,
) -> str | None:
    """After a manual write of ``doc`` to checkpoint ``store``: append the journal's new
    entries to the history beside it (or ``history``, the poller's own; False: it keeps
    none, so nothing is appended). Returns what went wrong, if
    anything, for the command to say; never raises (the write stands, and the
    poller's next commit fills the history in from the journal).

    A commit the journal holds and the history not yet is usually one a running
    poller's appender is writing right now, with its per-event detail: appending
    it from the journal first would record it without (a replay could then not
    check it). So the write waits, at most ``wait`` seconds (by default
    :data:`WRITER_WAIT_SECONDS`), for the history to
    hold the journal's recent commits; one whose writer died (or whose store is
    down) is then recorded from the journal, as an idle tick would."""
    from dbtrigger.history.derive import history_for  # noqa: PLC0415 - derive imports stores

    if history is False:
        return None  # the poller keeps no history (history=False)
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
        _await_writers(target, doc, WRITER_WAIT_SECONDS if wait is None else wait)
        recorder.sync(doc)
    except Exception as exc:  # noqa: BLE001 - the write stands; said by the caller
        return (
            f"the history ({target.describe()}) could not be appended ({type(exc).__name__}: "
            f"{exc}); the journal holds the entry, and the poller's next commit fills it in"
        )
    return None


def _await_writers(history: HistoryStore, doc: StateDocument, wait: float) -> None:
    """Wait (at most ``wait`` seconds) until ``history`` holds the commits of
    ``doc``'s journal younger than :data:`~dbtrigger.history.recorder.SETTLE_SECONDS`
    (its last entry, the operator's own, aside). A history holding none of the
    journal's entries is not where the poller records (a history of its own
    elsewhere): nothing is waited for."""
    journal = list(doc.journal)
    now = dt.datetime.now(dt.timezone.utc)
    young = set()
    for entry in journal[:-1]:
        if entry.get("type") not in ("commit", "partial_commit"):
            continue
        when = rec.entry_time(entry)
        try:
            age = (now - parse_time(when, "at")).total_seconds() if when else None
        except Exception:  # noqa: BLE001 - an entry without a readable time is not waited for
            age = None
        if age is not None and age < SETTLE_SECONDS:
            young.add(rec.entry_id(entry))
    if not young:
        return
    ids = {rec.entry_id(e) for e in journal}
    deadline = time.monotonic() + wait
    while True:
        held = {str(r.get("id")) for r in history.tail(doc.poller_name, len(journal) + 1)}
        if young <= held or not held & ids or time.monotonic() >= deadline:
            return  # (holding none of the journal: not where the poller records)
        time.sleep(0.02)


__all__ = ["NO_HISTORY", "WRITER_WAIT_SECONDS", "NoHistory", "record_write", "recorder_for"]
