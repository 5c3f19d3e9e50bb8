"""The ``HistoryStore`` port: numbered records appended beside the state document.

A history store holds, per poller, a sequence of JSON records numbered 1, 2,
3, ... (``seq``). Its guarantees, held by one contract suite for every
adapter (``tests/test_history_stores.py``):

* ``append(poller, records, after_seq=n)`` stores records numbered ``n + 1``
  ... in one go, and only if the history's last number is ``n``; otherwise
  it raises :class:`~dbtrigger.errors.CasConflictError` and stores nothing
  of them. Two writers can therefore never give one number twice.
* ``tail(poller, count)`` returns the last ``count`` records, oldest first,
  and ``read(poller, since_seq=...)`` every record after a number, in order.
* ``prune(poller, retention, now)`` removes records older than the retention
  allows, oldest first, never the last record (the next number is read from it).

Errors are those of the checkpoint stores (:class:`~dbtrigger.errors.StoreError`
and below), translated at each adapter's edge.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar, runtime_checkable

from dbtrigger import options as opt
from dbtrigger.errors import CasConflictError, HistoryPrunedError

_log = logging.getLogger("dbtrigger.history")

#: Records are kept for this many days by default.
DEFAULT_MAX_AGE_DAYS = 30.0
#: ... and at most this many bytes per poller (oldest dropped first).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Retention:
    """How long a poller's history is kept: records older than ``max_age_days``
    and, beyond ``max_bytes`` in all, the oldest records are pruned (None: no
    limit of that kind). The last record is always kept."""

    max_age_days: float | None = DEFAULT_MAX_AGE_DAYS
    max_bytes: int | None = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        opt.optional_seconds("max_age_days", self.max_age_days)
        opt.optional_whole("max_bytes", self.max_bytes, minimum=1024)

    def cutoff(self, now: dt.datetime) -> dt.datetime | None:
        """Records at or before this time may go (None: no age limit)."""
        if self.max_age_days is None:
            return None
        return now - dt.timedelta(days=self.max_age_days)


DEFAULT_RETENTION = Retention()


@runtime_checkable
class HistoryStore(Protocol):
    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        """Store ``records`` (numbered ``after_seq + 1``...) if the last number is ``after_seq``."""
        ...

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        """The last ``count`` records, oldest first (fewer when the history is shorter)."""
        ...

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        """Every record numbered above ``since_seq``, in order."""
        ...

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        """Remove what ``retention`` lets go; how many records were removed (or an estimate)."""
        ...

    def describe(self) -> str:
        """Where the history lives, for logs and the CLI; never contains a secret."""
        ...


#: How a record is written: compact, ASCII, values JSON cannot take as their ``str``.
encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, default=str).encode

#: What every record's line starts with before its number (``seq`` is its first key).
SEQ_PREFIX = b'{"seq":'


class EncodedRecord(dict[str, Any]):
    """A record that keeps its JSON line but for its number: everything after
    ``{"seq":N`` (``rest``). :func:`encode_line` writes the number and the kept
    rest, so a record is encoded once, by the recorder that made it, whatever the
    store and whatever number it is given (:func:`numbered`).

    ``rest`` must be what :func:`encode_line` would write after the number for
    these items, ``seq`` the first of them; like a journal entry, the record is
    read-only so that it stays so (copy it with ``dict(record)`` to change it).
    """

    __slots__ = ("_rest",)

    def __init__(self, record: Mapping[str, Any], rest: bytes) -> None:
        super().__init__(record)
        self._rest = rest

    @property
    def rest(self) -> bytes:
        return self._rest

    def numbered(self, seq: int) -> EncodedRecord:
        """The same record numbered ``seq``."""
        out = EncodedRecord(self, self._rest)
        dict.__setitem__(out, "seq", seq)
        return out

    def __reduce__(self) -> tuple[type[EncodedRecord], tuple[dict[str, Any], bytes]]:
        return (EncodedRecord, (dict(self), self._rest))

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("history records are read-only (their JSON line is kept); copy with dict()")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One record as a JSON line (compact, ASCII, newline-terminated)."""
    if type(record) is EncodedRecord:
        seq = record["seq"]
        if type(seq) is int:
            return SEQ_PREFIX + str(seq).encode("ascii") + record.rest
    return (encode_json(dict(record)) + "\n").encode("ascii")


def decode_lines(data: bytes, *, complete_only: bool = True) -> list[dict[str, Any]]:
    """The records in ``data``; a last line without its newline (a torn write) is
    skipped when ``complete_only``, as is any line that is not a JSON object (a
    read says so: :func:`numbered_lines`)."""
    return [record for _, record in numbered_lines(data, complete_only) if record is not None]


def numbered_lines(
    data: bytes, complete_only: bool = True
) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(line number, record)`` of each non-blank line of ``data`` (from 1); the
    record is None for a line that is not a JSON object: damaged (a disk that
    filled, a machine that died before its write reached the disk, an edit)."""
    lines = data.split(b"\n")
    if complete_only:
        lines = lines[:-1]  # after the last newline: empty, or a torn line
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        yield number, value if isinstance(value, dict) else None


#: The type of what a read gives for a damaged line (:func:`damaged_line`).
DAMAGED = "damaged_line"


def decoded_row(text: Any, seq: int, where: Callable[[], str]) -> dict[str, Any]:
    """A record stored as one row or entity (SQL, Table storage), numbered ``seq``; a
    text that is not one (edited by hand) is :func:`damaged_line` naming
    ``where()`` and the row, with its number: the number is taken, so that the
    next append goes after it rather than conflict with it forever."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if isinstance(value, dict):
        return value
    return {**damaged_line(f"{where()} row {seq}"), "seq": seq}


def row_texts(
    records: Sequence[Mapping[str, Any]], after_seq: int
) -> Iterator[tuple[dict[str, Any], str]]:
    """``records`` numbered from ``after_seq + 1`` (:func:`numbered`), each with its
    text as one row or entity stores it (SQL, Table storage: :func:`decoded_row`
    reads it back)."""
    for record in numbered(records, after_seq):
        yield record, encode_line(record).decode("ascii").rstrip("\n")


def damaged_line(where: str) -> dict[str, Any]:
    """What a read gives in place of a line that is not a record: not a record
    either (no number), so that the reader of the whole history can say which
    numbers it lost and where (:func:`dbtrigger.history.view.load`)."""
    return {"seq": None, "id": f"{DAMAGED}:{where}", "type": DAMAGED, "where": where}


def last_number(poller: str, where: str, record: Mapping[str, Any]) -> int:
    """The number of ``record``, the last an append found in the newest segment
    ``where``; the segment is kept when it is damaged in every line
    (:func:`kept_unreadable`)."""
    last = int(record.get("seq") or 0)
    if is_damaged(record):
        kept_unreadable(poller, where, last)
    return last


def kept_unreadable(poller: str, where: str, last: int) -> None:
    """Say that an append found the newest segment ``where`` damaged in every line
    and kept it (it used to be removed, as if it held only a torn line, and every
    record in it with it, unsaid). Its lines keep their numbers, up to ``last``
    (:func:`last_records`); readers report them as a gap."""
    _log.warning(
        "the history of %s: segment %s holds no line that can be read (damaged: a disk "
        "that filled, a machine that died before the write reached the disk, an edit); it "
        "is kept as it is, the records it held (up to number %d) are a gap in the history, "
        "and new records go on after it. Restore it from a backup to replay across it",
        poller,
        where,
        last,
        extra={"event": "history_segment_damaged", "poller": poller, "segment": where},
    )


def expect_end(poller: str, last: int, after_seq: int) -> None:
    """An append's compare-and-swap: the history of ``poller`` ends at record
    ``last``, and records may go on after it only if that is ``after_seq``.

    Raises:
        CasConflictError: another writer appended first (or the caller's count is off).
    """
    if last != after_seq:
        raise CasConflictError(f"the history of {poller!r} ends at record {last}, not {after_seq}")


def numbered(records: Sequence[Mapping[str, Any]], after_seq: int) -> list[dict[str, Any]]:
    """``records`` with ``seq`` set to ``after_seq + 1``, ``+ 2``, ..."""
    out: list[dict[str, Any]] = []
    for seq, r in enumerate(records, start=after_seq + 1):
        if type(r) is EncodedRecord:  # (read-only: one numbered so already is itself)
            out.append(r if r["seq"] == seq else r.numbered(seq))
        else:
            out.append({**r, "seq": seq})
    return out


def segment_name(first_seq: int) -> str:
    """A segment of a file or blob history, named by its first record's number."""
    return f"{first_seq:012d}.jsonl"


def segment_seq(name: str) -> int | None:
    stem = name.rsplit("/", 1)[-1].split(".", 1)[0]
    return int(stem) if stem.isdigit() else None


S = TypeVar("S")

#: How much of a segment's end is read first to find its last records (x4 until found).
TAIL_CHUNK = 64 * 1024


def last_records(
    read: Callable[[int, int], bytes],
    size: int,
    count: int,
    first_seq: int = 0,
    where: str = "",
) -> tuple[list[dict[str, Any]], int]:
    """The last ``count`` complete records of a segment of ``size`` bytes, and where
    its complete lines end (bytes; anything after that is a torn write).

    ``read(start, length)`` reads the segment: its end is read in a chunk that
    grows fourfold until it holds ``count`` records or the whole segment.

    A segment of whole lines none of which is a record (damaged in every line)
    gives one :func:`damaged_line` for its last line, numbered as the record
    there was: ``first_seq`` (its name's) plus its lines, less one. The numbers
    are taken, as a damaged row's are (:func:`decoded_row`): the next append goes
    after them, and readers find them missing - a gap naming the lines - rather
    than given again to other records, or the segment taken for a torn one."""
    if size == 0:
        return [], 0
    chunk = TAIL_CHUNK
    while True:
        start = max(0, size - chunk)
        data = read(start, size - start)
        end = data.rfind(b"\n") + 1
        body = data[:end]
        if start > 0:
            body = body[body.find(b"\n") + 1 :]  # the first line may be cut
        records = decode_lines(body)
        if len(records) >= count or start == 0:
            if not records and first_seq and count:
                lines = [number for number, _ in numbered_lines(body)]
                if lines:
                    seq = first_seq + len(lines) - 1
                    return [{**damaged_line(f"{where} line {lines[-1]}"), "seq": seq}], end
            return records[-count:] if count else [], start + end
        chunk *= 4


def is_damaged(record: Mapping[str, Any]) -> bool:
    """Is ``record`` a damaged line's stand-in (:func:`damaged_line`)?"""
    return record.get("type") == DAMAGED


def newest_records(
    segments: Iterable[S], last: Callable[[S, int], list[dict[str, Any]]], count: int
) -> list[dict[str, Any]]:
    """The last ``count`` records of a history, oldest first: ``segments`` newest
    first, ``last(segment, n)`` the last ``n`` records of one (a history's ``tail``)."""
    out: list[dict[str, Any]] = []
    if count <= 0:
        return out
    for segment in segments:
        out = last(segment, count - len(out)) + out
        if len(out) >= count:
            break
    return out[-count:]


def pruned_while_read(poller: str, last: int) -> HistoryPrunedError:
    """The error of a read that found records after ``last`` (the last it gave) pruned
    since it began: it stops there rather than go on past a hole."""
    return HistoryPrunedError(
        f"retention pruned records of the history of {poller!r} after record {last} while "
        "they were being read; nothing was skipped, the read stopped there. Read again (the "
        "history now starts later), or keep records longer (retention=Retention(...))"
    )


def read_segments(
    poller: str,
    segments: Sequence[S],
    first_seq: Callable[[S], int],
    load: Callable[[S], bytes | None],
    since_seq: int,
    where: Callable[[S], str] = str,
) -> Iterator[dict[str, Any]]:
    """The records after ``since_seq`` in a history's ``segments`` (oldest first), in
    order (a history's ``read``). A segment whose successor starts at or below
    ``since_seq + 1`` holds none of them and is not read. ``load(segment)`` reads
    one whole; None: it is gone, pruned since it was listed. Before a record was
    given that only means the history starts later; after one, the read stops
    with :func:`pruned_while_read` rather than go on past a hole. A damaged line
    gives :func:`damaged_line` naming ``where(segment)`` and its line number
    (unless the read starts later and has given nothing yet: it may lie before)."""
    given: int | None = None  # the last record this read gave
    for i, segment in enumerate(segments):
        if i + 1 < len(segments) and first_seq(segments[i + 1]) <= since_seq + 1:
            continue
        data = load(segment)
        if data is None:
            if given is None:
                continue
            raise pruned_while_read(poller, given)
        for number, record in numbered_lines(data):
            if record is None:
                if given is not None or not since_seq:
                    yield damaged_line(f"{where(segment)} line {number}")
                continue
            seq = int(record.get("seq") or 0)
            if seq > since_seq:
                given = seq
                yield record


def prune_segments(
    segments: Sequence[S],
    described: Sequence[tuple[S, int, dt.datetime | None]],
    first_seq: Callable[[S], int],
    delete: Callable[[S], None],
    retention: Retention,
    now: dt.datetime,
) -> int:
    """Delete the segments :func:`prunable_segments` picks among ``described`` (those
    of the listed ``segments`` whose size and first record's time were read);
    the number of records removed: a segment holds those up to the first of the
    segment listed after it (a history's ``prune``)."""
    removed = 0
    for segment in prunable_segments(described, retention, now):
        i = segments.index(segment)
        first_here = first_seq(segment)
        first_next = first_seq(segments[i + 1]) if i + 1 < len(segments) else first_here
        delete(segment)
        removed += first_next - first_here
    return removed


def prunable_segments(
    segments: Sequence[tuple[S, int, dt.datetime | None]],
    retention: Retention,
    now: dt.datetime,
) -> list[S]:
    """Which whole segments may go: ``segments`` are ``(name, bytes, first record's
    time)`` oldest first. A segment goes when the one after it starts before the
    age cutoff (so every record in it is older), or while the segments after it
    still exceed ``max_bytes``. The last segment never goes."""
    cutoff = retention.cutoff(now)
    total = sum(size for _, size, _ in segments)
    out = []
    for i, (name, size, _) in enumerate(segments[:-1]):
        following = segments[i + 1][2]
        old = cutoff is not None and following is not None and following <= cutoff
        big = retention.max_bytes is not None and total > retention.max_bytes
        if not (old or big):
            break
        out.append(name)
        total -= size
    return out


__all__ = [
    "DAMAGED",
    "DEFAULT_RETENTION",
    "TAIL_CHUNK",
    "EncodedRecord",
    "HistoryStore",
    "Retention",
    "damaged_line",
    "decode_lines",
    "decoded_row",
    "encode_json",
    "encode_line",
    "expect_end",
    "is_damaged",
    "kept_unreadable",
    "last_number",
    "last_records",
    "newest_records",
    "numbered",
    "numbered_lines",
    "prunable_segments",
    "prune_segments",
    "pruned_while_read",
    "read_segments",
    "row_texts",
    "segment_name",
    "segment_seq",
]
