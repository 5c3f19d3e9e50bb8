"""What every log reader does while it reads: assemble transactions, and guard the columns.

PostgreSQL's :class:`~dbtrigger.cdc.pg_reader.Decoder` and the binlog's
:class:`~dbtrigger.cdc.binlog_reader.Assembler` read different bytes, but
each turns one read's stream into :class:`~dbtrigger.cdc.buffer.Transaction`
objects the same way, which lives here once:

* a transaction **before the checkpoint's** is skipped whole; the one the
  checkpoint is *inside of* keeps only the changes after its ordinal (a read
  may start in the middle of a large transaction, never skipping a change
  because several share one commit);
* a read has **room** for so many changes; when it is used up the read stops,
  inside a transaction if it must (:meth:`Assembly.partial`);
* a watched table whose column **changed type** stops the read just before
  the first change of the new shape (:class:`SchemaBreak`), while an added
  column is simply accepted (:class:`SchemaGuard`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dbtrigger.cdc.buffer import Transaction
from dbtrigger.cdc.position import LogPosition

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - a watched table's catalog description


@dataclass
class SchemaBreak:
    """Where a column type changed (the commit token of the transaction), and how."""

    commit: str
    problem: str
    #: Not a type change: a watched table renamed away, dropped or replaced by another
    #: table (:mod:`dbtrigger.cdc.binlog_ddl`), a :class:`~dbtrigger.errors.SourceDefinitionError`.
    table_gone: bool = False


def keyless(table: str, gone: Sequence[str]) -> str:
    """The schema break of a table whose key columns ``gone`` the log no longer has."""
    return (
        f"key column {', '.join(gone)} of {table} is no longer in the table (renamed or "
        "dropped), so its changes would be delivered without their key; a restarted worker "
        "reads the primary key again (a table without one is refused)"
    )


class SchemaGuard(Generic[T]):
    """The accepted columns of each watched table (name -> type, as the log names types).

    The log may add columns (they simply appear in events) but not change the
    type of an accepted one. ``accepted`` starts from what the source persisted
    (its control row); :attr:`added` says new columns wait to be persisted.
    """

    def __init__(
        self, accepted: Mapping[str, Mapping[str, T]], describe: Callable[[T], str] = str
    ) -> None:
        self.accepted: dict[str, dict[str, T]] = {t: dict(c) for t, c in accepted.items()}
        self.describe = describe
        self.added = False

    def check(self, table: str, columns: Iterable[tuple[str, T]]) -> str | None:
        """None when the columns fit what was accepted; else what changed, in words."""
        known = self.accepted.setdefault(table, {})
        columns = list(columns)
        changed = [(n, known[n], t) for n, t in columns if n in known and known[n] != t]
        if changed:
            return "; ".join(
                f"column {n} of {table} changed type ({self.describe(old)} -> {self.describe(new)})"
                for n, old, new in changed
            )
        for name, type_ in columns:
            if name not in known:
                known[name] = type_
                self.added = True
        return None


class Assembly(Generic[I, T]):
    """The transaction one read is assembling, and the room the read has left.

    ``watched`` describes the watched tables (by qualified name), ``guard`` holds
    their accepted columns. A ``TRUNCATE`` of a watched table is kept as a change
    of its own (delivered as a ``truncate``), in its place in its transaction.
    """

    def __init__(self, watched: Mapping[str, I], guard: SchemaGuard[T]) -> None:
        self.watched = watched
        self.guard = guard
        #: The log's id of a table (relation OID, table map id) -> the type change its
        #: latest description in the log showed.
        self._problems: dict[int, str] = {}
        #: The open transaction (also while it is being skipped: see :attr:`delivering`).
        self.current: Transaction[Any] | None = None
        self._skip = False
        self._to_skip = 0
        self.room = 0
        self.full = False
        self.schema_break: SchemaBreak | None = None

    def note_problem(self, table_id: int, problem: str | None) -> None:
        """What the log's latest description of table ``table_id`` showed (None: it fits)."""
        if problem is None:
            self._problems.pop(table_id, None)
        else:
            self._problems[table_id] = problem

    def restart(self, room: int) -> None:
        """A new read that may keep ``room`` changes."""
        self.current = None
        self.room = room
        self.full = False
        self.schema_break = None

    @property
    def delivering(self) -> Transaction[Any] | None:
        """The open transaction unless it is skipped (delivered before the checkpoint)."""
        return None if self._skip else self.current

    @property
    def skipping(self) -> bool:
        return self._skip

    def open(
        self,
        commit: str,
        start: int,
        commit_time: dt.datetime | None,
        transaction_id: Any,
        after: LogPosition | None,
    ) -> None:
        """A transaction begins: skipped whole before ``after``, in part when ``after`` is in it."""
        self._skip = after is not None and commit < after.commit
        offset = after.ordinal if after is not None and commit == after.commit else 0
        self._to_skip = offset
        self.current = Transaction(commit, start, 0, commit_time, transaction_id, offset=offset)

    def close(self) -> Transaction[Any] | None:
        """The transaction committed: it, unless it was skipped."""
        txn, self.current = self.current, None
        if txn is None or self._skip:
            return None
        return txn

    def partial(self) -> Transaction[Any] | None:
        """The transaction the read stopped inside (out of room, or at a type change)."""
        txn = self.close()
        if txn is not None:
            txn.whole = False
        return txn

    def split(self) -> Transaction[Any] | None:
        """The changes of the open transaction read so far, as a part (``whole`` False);
        the transaction stays open and the read may go on with the rest of it."""
        txn = self.delivering
        if txn is None:
            return None
        part = Transaction(
            txn.commit, txn.start, txn.end, txn.commit_time, txn.transaction_id,
            txn.changes, txn.offset, whole=False,
        )  # fmt: skip
        txn.offset += len(txn.changes)
        txn.changes = []
        return part

    def more(self, room: int) -> None:
        """The read goes on (inside the open transaction, if any) with ``room`` more changes."""
        self.room = room
        self.full = False

    @property
    def resumed_inside(self) -> bool:
        """The read started inside the open transaction, and changes of it are still to
        be passed over (delivered before the checkpoint)."""
        return self._to_skip > 0

    def delivered_already(self) -> bool:
        """True for a change the read started after (inside the checkpoint's transaction)."""
        if self._to_skip:
            self._to_skip -= 1
            return True
        return False

    def keep(self, raw: Any) -> None:
        """Keep one change of the open transaction (unless the checkpoint passed it)."""
        if self.delivered_already():
            return
        assert self.current is not None  # noqa: S101 - changes come inside transactions
        self.current.changes.append(raw)
        self.room -= 1
        if self.room <= 0:
            self.full = True


__all__ = ["Assembly", "SchemaBreak", "SchemaGuard"]
