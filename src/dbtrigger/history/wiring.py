"""Which recorder a trigger or an operator's write gets: none (``history=False``),
or a :class:`~dbtrigger.history.recorder.HistoryRecorder` on the history store
beside the checkpoint store (see :func:`dbtrigger.history.derive.resolve_history`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from dbtrigger.events import RowChange
from dbtrigger.history.recorder import FLUSH_SECONDS, HistoryRecorder, Outcome
from dbtrigger.history.store import DEFAULT_RETENTION, HistoryStore, Retention
from dbtrigger.state.document import StateDocument
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


__all__ = ["NO_HISTORY", "NoHistory", "record_write", "recorder_for"]
