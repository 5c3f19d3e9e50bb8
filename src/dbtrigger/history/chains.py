"""What an append round of the history recorder writes: the queued commits'
journals read into chains of entries (see :mod:`dbtrigger.history.recorder`).

Nothing here performs I/O.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger.history import records as rec
from dbtrigger.state.document import JournalRecord

#: A record's detail and its JSON (see :func:`dbtrigger.history.records.encoded_detail`).
Detail = tuple[Mapping[str, Any], str]


@dataclass
class Pending:
    """A commit (or an idle tick's check, ``entry`` None) waiting for the appender:
    the journal of the document it read or wrote, and the record's detail."""

    journal: tuple[Mapping[str, Any], ...]
    entry: Mapping[str, Any] | None = None
    #: Makes the record's detail and its JSON (on the appender thread: the digests
    #: of a batch are most of the history's CPU); None: the record goes without.
    detail: Callable[[], Detail] | None = None
    #: About the memory the detail holds until it is made (the batch's events).
    cost: int = 0

    def drop_detail(self) -> int:
        cost, self.detail, self.cost = self.cost, None, 0
        return cost


def made(make: Callable[[], Detail]) -> Detail | None:
    """A detail, or None when it cannot be made (the record goes without it)."""
    try:
        return make()
    except Exception:  # noqa: BLE001 - a digest that cannot be made loses detail, not the record
        return None


#: What one append round writes: entries in journal order, their ids, details by id.
Chain = tuple[list[Mapping[str, Any]], list[str], dict[str, Detail]]


def since(journal: Sequence[Mapping[str, Any]], last: tuple[object, str]) -> tuple[int, list[str]]:
    """Where ``journal`` goes on after ``last`` (an entry, or None, and its id) and
    the ids of the entries from there; -1 and every entry's id when it does not
    hold ``last``. Read from the end: a commit's journal holds one new entry."""
    entry, entry_id = last
    ids: list[str] = []
    for index in range(len(journal) - 1, -1, -1):
        e = journal[index]
        if e is entry:
            break
        eid = rec.entry_id(e)
        if eid == entry_id:
            break
        ids.append(eid)
    else:
        index = -1
    ids.reverse()
    return (index + 1 if index >= 0 else -1), ids


def chains_of(
    batch: Sequence[Pending], known: tuple[str, int] | None, journal_limit: int
) -> list[Chain]:
    """The entries of ``batch``'s journals, each once, in journal order, with their
    ids and the details by entry id. Each document's journal continues the one
    before it (both hold the entry the earlier one ends with), unless more than a
    journal's worth of other writers' entries came between: then a new chain
    starts, and its append finds the hole and marks it with a gap record.

    Only what is new is read: a journal from its end back to the entry the chain
    ends with (usually one entry, the commit's own), and the first one from its
    end back to ``known``, the newest record this process wrote (its id and number),
    when it holds that."""
    chains: list[Chain] = []
    entries: list[Mapping[str, Any]] = []
    ids: list[str] = []
    details: dict[str, Detail] = {}
    seen: set[str] = set()
    last: tuple[object, str] | None = None  # the entry the chain ends with, its id
    for item in batch:
        journal = list(item.journal)
        entry = item.entry
        if entry is not None and not (
            journal and (journal[-1] is entry or rec.entry_id(journal[-1]) == rec.entry_id(entry))
        ):
            journal.append(JournalRecord(entry))  # (no journal: journal_limit=0)
        if not journal:
            continue
        if last is not None:
            start, new = since(journal, last)
            if start < 0 and journal_limit:  # it does not continue the chain
                chains.append((entries, ids, details))
                entries, ids, details, seen = [], [], {}, set()
        elif known is not None:
            start, new = since(journal, (None, known[0]))
            if start > 0:  # from the newest record written (its append finds it there)
                start, new = start - 1, [known[0], *new]
        else:
            start, new = 0, [rec.entry_id(e) for e in journal]
        # (no new entry: the journal ends with the chain's last)
        last = (journal[-1], new[-1] if new or last is None else last[1])
        start = max(start, 0)
        if item.entry is not None and item.detail is not None:
            detail = made(item.detail)
            if detail is not None:
                details[last[1]] = detail
        for e, eid in zip(journal[start:], new, strict=True):
            if eid not in seen:
                seen.add(eid)
                entries.append(e)
                ids.append(eid)
    chains.append((entries, ids, details))
    return chains


def _made(record: Mapping[str, Any]) -> tuple[int, dt.datetime] | None:
    """The fencing token a commit was made under and its time (None: not a commit)."""
    token, at = record.get("fencing_token"), rec.record_time({"at": rec.entry_time(record)})
    return (token, at) if type(token) is int and at is not None else None


def overtaken(tail: Sequence[Mapping[str, Any]], entries: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the history's ``tail`` holds a commit of a later lease than every one of
    ``entries`` (a writer's journal), made after them: that lease's holder read a
    document that holds them all, so it has recorded them (or a gap where it could
    not) before its own commit. Appended now, they would go after newer records:
    copies out of order, the first copy of any it marked by a gap read after commits
    made later. (Both, token and time: a state document made anew - removed by hand -
    starts its tokens again below the history's older records.)"""
    ours = [m for m in map(_made, entries) if m is not None]
    if not ours:
        return False
    token, at = max(t for t, _ in ours), max(a for _, a in ours)
    return any(m[0] > token and m[1] > at for m in map(_made, tail) if m is not None)


__all__ = ["Chain", "Detail", "Pending", "chains_of", "made", "overtaken", "since"]
