"""Reading a poller's history as an operator sees it: the durable records, then
whatever the journal holds that the history does not have yet.

A commit's record is appended after the commit (see
:mod:`dbtrigger.history.recorder`), so for a moment - or, after a crash, until
the poller's next write - the journal knows an entry the history lacks. The
view shows it too, marked ``"pending": true``, so ``dbtrigger history`` never
misses a committed batch.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dbtrigger.errors import ConfigurationError, ReplayRefusedError
from dbtrigger.history import records as rec
from dbtrigger.history.store import DAMAGED, HistoryStore
from dbtrigger.state.document import StateDocument

_log = logging.getLogger("dbtrigger.history")


def load(
    history: HistoryStore | None,
    poller: str,
    doc: StateDocument | None = None,
    *,
    details: bool = True,
) -> list[dict[str, Any]]:
    """Every record of ``poller``, oldest first, each once, with the journal's newer
    entries; numbers missing between two records are a ``gap`` record (:func:`holes_marked`).

    ``details=False`` leaves out the commits' per-event detail (``detail_unread``
    True instead; :func:`with_detail` reads one back): what a rewind's plan needs
    of a long history is its ranges, and the details are most of its memory."""
    if history is None:
        return merged([], doc.journal if doc is not None else ())
    read = history.read(poller)
    if not details:
        read = (_without_detail(r) for r in read)
    stored = rec.unique(holes_marked(poller, read))
    return merged(stored, doc.journal if doc is not None else ())


def _without_detail(record: dict[str, Any]) -> dict[str, Any]:
    if "detail" not in record:
        return record
    out = {k: v for k, v in record.items() if k != "detail"}
    out["detail_unread"] = True
    return out


def with_detail(
    history: HistoryStore | None, poller: str, record: Mapping[str, Any]
) -> dict[str, Any]:
    """``record`` (of :func:`load` with ``details=False``) with its detail, read again."""
    seq = record.get("seq")
    if history is None or not record.get("detail_unread") or not isinstance(seq, int):
        return dict(record)
    for found in history.read(poller, since_seq=seq - 1):
        if found.get("id") == record.get("id"):
            return dict(found)
        break
    raise ReplayRefusedError(
        f"record {seq} of the history of {poller!r} (batch {record.get('batch_id')}) is gone "
        "since it was read (pruned by retention?): run the command again"
    )


def with_details(
    history: HistoryStore | None, poller: str, records: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``records`` (of :func:`load` with ``details=False``, oldest first) with their
    details, read again in one pass over the stretch of history they span (a
    replay's chosen batches: not one read of a whole segment each)."""
    unread = {
        str(r.get("id")): int(r["seq"])
        for r in records
        if r.get("detail_unread") and isinstance(r.get("seq"), int)
    }
    found: dict[str, dict[str, Any]] = {}
    if history is not None and unread:
        last = max(unread.values())
        for stored in history.read(poller, since_seq=min(unread.values()) - 1):
            rid = str(stored.get("id"))
            if unread.get(rid) == stored.get("seq"):
                found[rid] = dict(stored)
            if int(stored.get("seq") or 0) >= last:
                break
    out = []
    for record in records:
        rid = str(record.get("id"))
        if rid in unread and rid not in found:
            return [with_detail(history, poller, r) for r in records]  # (raises: gone)
        out.append(found.get(rid) or dict(record))
    return out


def load_last(
    history: HistoryStore | None,
    poller: str,
    doc: StateDocument | None,
    count: int,
) -> tuple[list[dict[str, Any]], int]:
    """The last ``count`` records of :func:`load` (at least; the caller cuts), and
    how many the history keeps before them, reading only the newest ones.

    ``dbtrigger history`` shows the last 20 records by default: reading the whole
    history for them (up to its retention, 256 MiB by default) took 10 s and 1.8 GB
    of memory at 128 MiB."""
    journal = doc.journal if doc is not None else ()
    if history is None:
        return merged([], journal)[-count:], 0
    newest = history.tail(poller, 1)
    if not newest:
        return merged([], journal)[-count:], 0
    # Twice as many as asked for: an entry appended twice takes two numbers.
    since = max(0, int(newest[-1].get("seq") or 0) - 2 * count)
    stored = rec.unique(holes_marked(poller, history.read(poller, since_seq=since)))
    out = merged(stored, journal)[-count:]
    earlier = 0
    if since > 0:
        first = next(iter(history.read(poller)), None)
        held = [r for r in out if isinstance(r.get("seq"), int)]
        if first is not None and held:
            earlier = max(0, int(held[0]["seq"]) - int(first.get("seq") or 0))
    else:
        earlier = len(merged(stored, journal)) - len(out)
    return out, earlier


def holes_marked(poller: str, records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``records`` (a history's ``read``) with a ``gap`` record where numbers are
    missing between two of them, naming the damaged lines found there.

    Appends number the records without a hole and retention removes only the
    oldest, so a number missing in the middle is a record lost: a damaged line
    of a file or blob (a disk that filled, a machine that died before the write
    reached the disk), a row edited or removed by hand. Read past silently, a
    replay or rewind of a range across it would take the records on either side
    for adjacent; as a gap it is refused, naming where. When the commit after
    the hole begins where the one before it ended, nothing a replay needs was
    lost there (a batch or a checkpoint move breaks that chain; a damaged last
    record is written again from the journal after its number): then, as for a
    damaged line with no number missing, it is logged at WARNING
    (``history_line_damaged``) and no gap is marked."""
    out: list[dict[str, Any]] = []
    damaged: list[str] = []
    last: dict[str, Any] | None = None
    reached: Any = None  # where the last commit read ended (its ``to``)
    for record in records:
        if record.get("type") == DAMAGED:
            damaged.append(str(record.get("where")))
            continue
        seq = record.get("seq")
        commit = record.get("type") in ("commit", "partial_commit")
        if isinstance(seq, int) and seq > 0:
            if last is None and damaged and seq > len(damaged):
                # Damaged lines before the first record (a first segment damaged in
                # every line keeps their numbers): the records just before it, lost.
                start = {"seq": seq - len(damaged) - 1, "at": record.get("at")}
                out.append(_hole(poller, start, seq, damaged))
            elif last is not None and seq > int(last["seq"]) + 1:
                if commit and reached is not None and record.get("from") == reached:
                    _said_damaged(poller, [*damaged] or [f"records {last['seq'] + 1}-{seq - 1}"])
                else:
                    out.append(_hole(poller, last, seq, damaged))
            elif damaged:
                _said_damaged(poller, damaged)
            damaged, last = [], dict(record)
        if commit:
            reached = record.get("to")
        out.append(dict(record))
    if damaged:
        _said_damaged(poller, damaged)
    return out


def _hole(poller: str, before: Mapping[str, Any], seq: int, damaged: list[str]) -> dict[str, Any]:
    first, last = int(before["seq"]) + 1, seq - 1
    numbers = f"record {first}" if first == last else f"records {first}-{last}"
    if damaged:
        why = (
            f"{', '.join(damaged)} {'is not a record' if len(damaged) == 1 else 'are not records'}"
            " (damaged: a disk that filled, a machine that died before the write reached the "
            "disk, an edit)"
        )
    else:
        why = "not in the store (removed by hand?)"
    return {
        "seq": first,
        "id": f"hole:{poller}:{first}-{last}",
        "at": before.get("at"),
        "type": rec.GAP,
        "missing": [first, last],
        "damaged": list(damaged),
        "note": f"{numbers} of the history lost: {why}; the batches or operations recorded "
        "there are unknown. Restore the history from a backup to replay across it",
    }


def _said_damaged(poller: str, damaged: list[str]) -> None:
    _log.warning(
        "the history of %s has lost a record, %s; the records around it continue "
        "without a hole in what was committed (it was written again after, or it moved "
        "no checkpoint), so replays across it are as recorded",
        poller,
        ", ".join(damaged),
        extra={"event": "history_line_damaged", "poller": poller, "where": damaged},
    )


def merged(
    stored: Sequence[Mapping[str, Any]], journal: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``stored`` records, then the journal entries after the newest one they hold."""
    out = [dict(r) for r in stored]
    entries = list(journal)
    ids = [rec.entry_id(e) for e in entries]
    present = {str(r.get("id")) for r in out}
    held = [i for i, rid in enumerate(ids) if rid in present]
    start = held[-1] + 1 if held else 0
    for entry in entries[start:]:
        out.append({**rec.record_of(entry), "seq": None, "pending": True})
    return out


def since(records: Iterable[Mapping[str, Any]], when: dt.datetime) -> list[dict[str, Any]]:
    """The records at or after ``when`` (records without a time are kept)."""
    out = []
    for record in records:
        at = rec.record_time(record)
        if at is None or at >= when:
            out.append(dict(record))
    return out


def find_batch(records: Sequence[Mapping[str, Any]], batch_id: str) -> dict[str, Any]:
    """The (last) commit record of ``batch_id``.

    Raises:
        ConfigurationError: no such batch in the history, naming what it holds.
    """
    for record in reversed(records):
        if (
            record.get("type") in ("commit", "partial_commit")
            and record.get("batch_id") == batch_id
        ):
            return dict(record)
    commits = [r for r in records if r.get("type") in ("commit", "partial_commit")]
    if not commits:
        raise ConfigurationError(f"batch {batch_id!r} is not in the history: it holds no commits")
    lost = [str(r.get("note")) for r in records if r.get("type") == rec.GAP and r.get("missing")]
    raise ConfigurationError(
        f"batch {batch_id!r} is not in the history, which holds {len(commits)} commit(s) from "
        f"{commits[0].get('batch_id')} ({commits[0].get('at')}) to {commits[-1].get('batch_id')} "
        f"({commits[-1].get('at')}); older batches were pruned by retention or predate it"
        + "".join(f"; or it was on a record lost since: {note}" for note in lost)
    )


def batch_range(
    records: Sequence[Mapping[str, Any]], first: str, last: str
) -> list[dict[str, Any]]:
    """The commit records from batch ``first`` to batch ``last``, in order.

    Raises:
        ConfigurationError: either is not in the history, or ``last`` comes first.
        ReplayRefusedError: a gap in the history lies between them.
    """
    start, end = find_batch(records, first), find_batch(records, last)
    commits = [dict(r) for r in records if r.get("type") in ("commit", "partial_commit")]
    i, j = commits.index(start), commits.index(end)
    if j < i:
        raise ConfigurationError(f"batch {last!r} was committed before {first!r}; swap them")
    _no_gap_between(records, commits[i : j + 1])
    return commits[i : j + 1]


def positions_of(records: Sequence[Mapping[str, Any]]) -> dict[Any, int]:
    """Where each record id first is in ``records`` (a list's ``index`` for every
    record of a range read the whole history once per record: minutes at 40,000)."""
    out: dict[Any, int] = {}
    for i, record in enumerate(records):
        out.setdefault(record.get("id"), i)
    return out


def _no_gap_between(
    records: Sequence[Mapping[str, Any]], chosen: Sequence[Mapping[str, Any]]
) -> None:
    """Refuse a range with a ``gap`` record inside: the batches committed while the
    history could not be written are not recorded, so the range would be replayed
    without them, silently.

    Raises:
        ReplayRefusedError: naming the gap and the recorded ranges on either side.
    """
    at = positions_of(records)
    low, high = at[chosen[0].get("id")], at[chosen[-1].get("id")]
    for k in range(low, high):
        gap = records[k]
        if gap.get("type") != rec.GAP:
            continue
        before = [c for c in chosen if at[c.get("id")] < k]
        after = [c for c in chosen if at[c.get("id")] > k]
        why = (
            f"{gap.get('note')}"
            if gap.get("missing")
            else f"it could not be written for longer than the state document's journal "
            f"reaches back, until {gap.get('at')}"
        )
        raise ReplayRefusedError(
            f"the history has a gap between batch {before[-1].get('batch_id')} and batch "
            f"{after[0].get('batch_id')} ({why}): the batches committed "
            "then are not recorded, so this range cannot be replayed as it was delivered. "
            f"Replay the recorded batches on either side of it: --from-batch "
            f"{chosen[0].get('batch_id')} --to-batch {before[-1].get('batch_id')}, and "
            f"--from-batch {after[0].get('batch_id')} --to-batch {chosen[-1].get('batch_id')}"
        )


__all__ = [
    "batch_range",
    "find_batch",
    "holes_marked",
    "load",
    "load_last",
    "merged",
    "positions_of",
    "since",
    "with_detail",
    "with_details",
]
