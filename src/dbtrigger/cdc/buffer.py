"""Whole committed transactions, in commit order, read ahead of the checkpoint.

Reading a log is expensive to start and cheap to continue: PostgreSQL decodes
from its replication slot every time it is asked, a binlog reader replays from
a file position. So a log source reads *ahead*: one read covers many batches,
and the transactions it returned are kept here until the checkpoint has passed
them. ``fetch(after, limit)`` is then answered from memory, for the next batch
as for a retry of the last one, without reading the log again.

What the buffer holds is exactly what one read returned: every change strictly
after ``floor`` (the position the read started after) up to the end of its
last transaction, whole transactions in commit order, each change with its
ordinal (from 1) within its transaction. A read that stopped at its size bound
rather than at the end of the log leaves ``complete`` False. Changes are kept
in whatever raw form the source wants (``R``) and turned into
:class:`~dbtrigger.cdc.changes.Change` records only when handed out, so a
100,000-row transaction costs its raw bytes, not 100,000 dicts.

The buffer also answers the question a slot needs answered after each
checkpoint commit: how far may the log be released? (:meth:`release_point`).
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dbtrigger.cdc.changes import Change
from dbtrigger.cdc.position import LogPosition

R = TypeVar("R")


@dataclass
class Transaction(Generic[R]):
    """One committed transaction: its commit token, where the log may be
    released once it is delivered (``end``, source-specific; PostgreSQL's end
    LSN), and its changes in order: the change at index ``i`` has ordinal
    ``offset + i + 1``.

    ``start`` is where the log may be released while the transaction is only
    partly delivered (PostgreSQL: its commit LSN, which keeps it decodable).
    A read that started inside the transaction keeps only the changes after
    that point (``offset``); one that stopped inside it at its size bound
    leaves ``whole`` False (more changes follow, read next time).
    """

    commit: str
    start: int
    end: int
    commit_time: dt.datetime | None
    transaction_id: Any
    changes: list[R] = field(default_factory=list)
    offset: int = 0
    whole: bool = True

    @property
    def last_ordinal(self) -> int:
        return self.offset + len(self.changes)

    def delivered_by(self, acked: LogPosition) -> bool:
        """Is every change of this transaction at or before ``acked``?"""
        if self.commit != acked.commit:
            return self.commit < acked.commit
        return self.whole and self.last_ordinal <= acked.ordinal


Materialise = Callable[[Transaction[R], int, R], Change]
"""``(transaction, ordinal, raw) -> Change``: the source's own conversion."""


class TransactionBuffer(Generic[R]):
    """See the module docstring. Not thread-safe: the source holds its lock."""

    def __init__(self, materialise: Materialise[R]) -> None:
        self._materialise = materialise
        self._txns: list[Transaction[R]] = []
        self._commits: list[str] = []
        #: Everything strictly after ``floor`` up to the last transaction is here.
        self.floor: LogPosition | None = None
        #: The read reached the end of the log it was bounded by (``through``).
        self.complete = False
        #: Where the read that filled the buffer ended (source-specific, e.g. an LSN).
        self.through: int | None = None
        self.loaded = False

    # --- filling ----------------------------------------------------------------------

    def reset(self, floor: LogPosition | None) -> None:
        """Start afresh for a read of everything after ``floor``."""
        self._txns = []
        self._commits = []
        self.floor = floor
        self.complete = False
        self.through = None
        self.loaded = True

    def append(self, txn: Transaction[R], *, keep_empty: bool = False) -> None:
        """Add the next transaction of the read (in commit order; empty ones are dropped
        unless ``keep_empty``: a stream appends a transaction as it begins).

        The next part of the last transaction (held in part, ``whole`` False, and
        ``txn`` starting at the ordinal where it ends) is added to it: a reader that
        went on reading inside a large transaction instead of reading it again.
        """
        last = self._txns[-1] if self._txns else None
        if (
            last is not None
            and txn.commit == last.commit
            and not last.whole
            and txn.offset == last.last_ordinal
        ):
            last.changes.extend(txn.changes)
            last.whole, last.end = txn.whole, txn.end
            last.commit_time = txn.commit_time or last.commit_time
            return
        if not txn.changes and not keep_empty:
            return
        if self._commits and txn.commit <= self._commits[-1]:
            raise ValueError(f"transaction {txn.commit} out of commit order")
        self._txns.append(txn)
        self._commits.append(txn.commit)

    def finish(self, *, complete: bool, through: int | None) -> None:
        self.complete = complete
        self.through = through

    # --- reading ----------------------------------------------------------------------

    @property
    def changes(self) -> int:
        """Changes held (what the read ahead costs in memory)."""
        return sum(len(t.changes) for t in self._txns)

    @property
    def last(self) -> LogPosition | None:
        """The position of the last change held (None: empty)."""
        if not self._txns:
            return None
        txn = self._txns[-1]
        return LogPosition(txn.commit, txn.last_ordinal)

    def covers(self, after: LogPosition | None) -> bool:
        """Can changes after ``after`` be answered from here (without a new read)?"""
        if not self.loaded:
            return False
        if self.floor is None:
            return True
        return after is not None and after >= self.floor

    def _locate(self, after: LogPosition | None) -> tuple[int, int]:
        """(transaction index, change index) of the first change after ``after``."""
        if after is None:
            return 0, 0
        i = bisect.bisect_left(self._commits, after.commit)
        if i < len(self._txns) and self._txns[i].commit == after.commit:
            txn = self._txns[i]
            index = max(0, after.ordinal - txn.offset)
            if index < len(txn.changes):
                return i, index
            return i + 1, 0
        return i, 0

    def pending(self, after: LogPosition | None) -> int:
        """Changes held after ``after``."""
        i, j = self._locate(after)
        if i >= len(self._txns):
            return 0
        return len(self._txns[i].changes) - j + sum(len(t.changes) for t in self._txns[i + 1 :])

    def take(self, after: LogPosition | None, limit: int) -> list[Change]:
        """Up to ``limit`` changes after ``after``, in log order."""
        out: list[Change] = []
        i, j = self._locate(after)
        while i < len(self._txns) and len(out) < limit:
            txn = self._txns[i]
            stop = min(len(txn.changes), j + limit - len(out))
            materialise = self._materialise
            base = txn.offset + 1
            out.extend(materialise(txn, base + k, txn.changes[k]) for k in range(j, stop))
            i, j = i + 1, 0
        return out

    # --- releasing --------------------------------------------------------------------

    def release_point(self, acked: LogPosition) -> int | None:
        """How far the log may be released once ``acked`` is durably checkpointed.

        Past every transaction delivered whole (its ``end``); into the one the
        checkpoint is inside only up to its ``start``; and, when the read was
        complete and nothing after ``acked`` was found, up to where the read
        ended (``through``): log that held nothing for us must not be retained.
        None when the buffer knows nothing that helps.
        """
        point: int | None = None
        for txn in self._txns:
            if txn.delivered_by(acked) or (txn.whole and not txn.changes):
                point = txn.end
                continue
            if txn.commit == acked.commit:
                point = max(point or 0, txn.start)
            return point
        if self.complete and self.through is not None and self.covers(acked):
            return max(point or 0, self.through)
        return point

    def trim(self, acked: LogPosition) -> None:
        """Forget the transactions the checkpoint has passed (they are never asked for again)."""
        keep = 0
        for txn in self._txns:
            if txn.delivered_by(acked):
                keep += 1
                continue
            break
        if keep:
            del self._txns[:keep]
            del self._commits[:keep]
        if self._txns and self._txns[0].commit == acked.commit:
            first = self._txns[0]  # delivered in part: its delivered changes go too
            done = min(len(first.changes), acked.ordinal - first.offset)
            if done > 0:
                del first.changes[:done]
                first.offset += done
        if self.floor is None or acked > self.floor:
            self.floor = acked


__all__ = ["Materialise", "Transaction", "TransactionBuffer"]
