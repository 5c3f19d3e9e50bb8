"""History records: what one commit or manual operation leaves in the history.

The state document's journal keeps the last ``journal_limit`` entries and is
written in the same conditional write that moves the checkpoint: it is the
truth about what was committed, but a short one. The history keeps every
entry for as long as its retention says, in a store beside the state document
(:mod:`dbtrigger.history.stores`). A history record is a journal entry, as
the document holds it, plus:

* ``seq``: the record's number in this poller's history (1, 2, ...), assigned
  when it is appended; a number is never given twice, so a missing one is a
  visible hole, never a silent one.
* ``id``: a digest of the journal entry's own text. The same entry appended
  twice (by the repair after a crash and by a late writer) has the same id,
  and readers keep the first (:func:`unique`).
* ``at``: the entry's time (``committed_at``, or ``at`` for manual entries).
* For commits written by a live tick, ``detail``: digests of the delivered
  event ids and of their images, one line per event (id, key, image digest,
  outcome when not accepted), and the retries waiting after the commit.
  A commit recovered from the journal after a crash between the commit and
  its append has no ``detail``; ``recovered`` says so.

Nothing here performs I/O; the shapes are tested table by table.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from operator import attrgetter, itemgetter
from typing import Any

from dbtrigger.cursor import encoded_pk
from dbtrigger.errors import SerializationError
from dbtrigger.events import RowChange, batch_shape, event_ids
from dbtrigger.state.document import JournalRecord, digest_event_ids, format_time, parse_time

#: Record types besides the journal's (commit, partial_commit, manual).
GAP = "gap"


def entry_id(entry: Mapping[str, Any]) -> str:
    """The identity of a journal entry: a digest of its JSON text as stored."""
    text = (
        entry.json_text()
        if isinstance(entry, JournalRecord)
        else json.dumps(dict(entry), separators=(",", ":"), default=str)
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def entry_time(entry: Mapping[str, Any]) -> str | None:
    """The entry's time as written (``committed_at`` or ``at``), if it has one."""
    value = entry.get("committed_at") or entry.get("at")
    return value if isinstance(value, str) else None


def record_of(entry: Mapping[str, Any], detail: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The history record of a journal ``entry`` (``seq`` is set when appended)."""
    out: dict[str, Any] = {"seq": 0, "id": entry_id(entry), "at": entry_time(entry)}
    out.update(entry)
    if detail is not None:
        out["detail"] = dict(detail)
    return out


def gap_record(
    *, after: Mapping[str, Any] | None, now: dt.datetime, missing_from: str | None
) -> dict[str, Any]:
    """A marker: entries between the history's last record and the journal's oldest
    may be missing (the history could not be written for longer than the journal
    reaches back)."""
    return {
        "seq": 0,
        "id": hashlib.sha256(f"gap:{(after or {}).get('id')}:{missing_from}".encode()).hexdigest()[
            :24
        ],
        "at": format_time(now),
        "type": GAP,
        "after_id": (after or {}).get("id"),
        "after_at": (after or {}).get("at"),
        "journal_from": missing_from,
        "note": "entries between these times may be missing: the history could not be "
        "written for longer than the state document's journal reaches back",
    }


def unique(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records in order, each id once (the first copy kept)."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for record in records:
        rid = str(record.get("id"))
        if rid in seen:
            continue
        seen.add(rid)
        out.append(dict(record))
    return out


def record_time(record: Mapping[str, Any]) -> dt.datetime | None:
    """The record's time, or None when it has none that parses."""
    value = record.get("at")
    if not isinstance(value, str):
        return None
    try:
        return parse_time(value, "at")
    except Exception:  # noqa: BLE001 - a foreign or damaged record simply has no time
        return None


# --- images ---------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A JSON-able stand-in for a row value, the same for the same value in any process."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return list(value)
    return str(value)


def image_text(event: RowChange) -> str:
    """The event's image as canonical JSON: operation, before and after.

    Two reads of an unchanged row (or of an immutable change-log row) give the
    same text; any change to a column changes it.
    """
    before = event.before
    after = event.after
    return json.dumps(
        [
            event.op,
            None if before is None else dict(before),
            None if after is None else dict(after),
        ],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        default=_plain,
    )


def _image_key(event: RowChange) -> str:
    """What the image digest hashes: the same text for the same image, in any
    process reading the source the same way, and cheap (this runs for every
    delivered event). An event over a fetched row tuple hashes the tuple's
    ``repr`` with the column names; any other, its images' items. Values whose
    ``repr`` would name a memory address fall back to :func:`image_text`.
    """
    row = getattr(event, "_row", None)
    shape = getattr(event, "_shape", None)
    if row is not None and shape is not None:
        text = repr((shape.op, shape.columns, tuple(row)))
    else:
        before, after = event.before, event.after
        text = repr(
            (
                event.op,
                None if before is None else tuple(before.items()),
                None if after is None else tuple(after.items()),
            )
        )
    return image_text(event) if " at 0x" in text else text


def _image_bytes(event: RowChange) -> bytes:
    return _image_key(event).encode("utf-8", "surrogatepass")


def image_digest(event: RowChange) -> str:
    """The image's CRC-32, 8 hex digits: tells a changed row (a changed row keeps
    its digest once in four billion times; the batch's ``images`` digest, a
    SHA-256 over the images themselves, has no such chance)."""
    return f"{zlib.crc32(_image_bytes(event)):08x}"


def digest_images(events: Iterable[RowChange]) -> str:
    """``sha256:...`` over the events' images, in order."""
    h = hashlib.sha256()
    for event in events:
        h.update(_image_bytes(event))
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def _key(event: RowChange) -> Any:
    """The event's key as ``{name: [kind, value]}`` (the state document's encoding),
    with the common one-column int or text key done without the general encoder."""
    shape = getattr(event, "_shape", None)
    if shape is not None and shape.single_index >= 0:
        value = event._row[shape.single_index]  # type: ignore[attr-defined]
        kind = type(value)
        if kind is int or kind is str:
            return {shape.pk_names[0]: ["int" if kind is int else "str", value]}
    try:
        return encoded_pk(event.pk)
    except SerializationError:
        return {k: repr(v) for k, v in event.pk.items()}


@dataclass(frozen=True)
class EventLine:
    """One delivered event as the history keeps it."""

    event_id: str
    key: Mapping[str, Any]
    image: str
    outcome: str = "accepted"
    reason: str | None = None

    def to_json(self) -> list[Any]:
        """``[event id, key, image digest]``, then outcome and reason when not accepted."""
        out: list[Any] = [self.event_id, dict(self.key), self.image]
        if self.outcome != "accepted":
            out += [self.outcome, (self.reason or "")[:200]]
        return out

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> EventLine:
        return cls(
            event_id=str(raw[0]),
            key=dict(raw[1] or {}),
            image=str(raw[2]),
            outcome=str(raw[3]) if len(raw) > 3 else "accepted",
            reason=str(raw[4]) if len(raw) > 4 else None,
        )


def event_lines(
    events: Sequence[RowChange],
    *,
    rejected: Mapping[str, str] | None = None,
    retried: Mapping[str, str] | None = None,
    images: Any = None,
) -> list[list[Any]]:
    """The delivered events as the record's ``events`` lines (see :class:`EventLine`),
    with their outcomes (``rejected`` / ``retried``: id -> reason). ``images``: a
    hash object fed every image on the way (the batch's ``images`` digest)."""
    fast = _batch_lines(events)
    out, blob = fast if fast is not None else _lines_one_by_one(events)
    if images is not None:
        images.update(blob)
    if rejected or retried:
        for line in out:
            eid = line[0]
            if rejected and eid in rejected:
                line += ["rejected", rejected[eid][:200]]
            elif retried and eid in retried:
                line += ["retried", retried[eid][:200]]
    return out


def _batch_lines(events: Sequence[RowChange]) -> tuple[list[list[Any]], bytes] | None:
    """:func:`event_lines` of a batch made by ``events_from_rows`` with a one-column
    int or text key (the common table), a column at a time, and the bytes the
    batch's ``images`` digest hashes; None for any other batch.

    The lines are those the per-event path makes, value for value: an image
    text is ``repr((op, columns, tuple(row)))``, which is the constant
    ``(op, columns, `` prefix, the row tuple's ``repr`` and ``)``; the images
    digest hashes each image followed by a newline, i.e. the images joined by
    newlines with one more at the end. Only the way of computing them changes:
    per row, one ``repr`` and one CRC at C speed instead of a dozen Python calls.
    """
    shape = batch_shape(events)
    if shape is None or shape.single_index < 0:
        return None
    rows = list(map(tuple, map(_row_of, events)))
    index = shape.single_index
    keys = list(map(itemgetter(index), rows))
    kinds = set(map(type, keys))
    if kinds == {int}:
        kind = "int"
    elif kinds == {str}:
        kind = "str"
    else:
        return None
    prefix = "(" + repr(shape.op) + ", " + repr(shape.columns) + ", "
    texts = [prefix + text + ")" for text in map(repr, rows)]
    blob = "\n".join(texts) + "\n"
    if " at 0x" in blob:
        return None  # a repr naming an address: those images are rendered as JSON
    try:
        encoded = list(map(str.encode, texts))
    except UnicodeEncodeError:
        return None  # a lone surrogate: the per-event path encodes it as it always did
    # The CRCs as 8 hex digits each: packed big-endian, hexed and split in C.
    crcs = struct.pack(f">{len(encoded)}I", *map(zlib.crc32, encoded)).hex(" ", 4).split(" ")
    name = shape.pk_names[0]
    ids = event_ids(events)
    lines = [[eid, {name: [kind, key]}, crc] for eid, key, crc in zip(ids, keys, crcs, strict=True)]
    return lines, blob.encode("utf-8")


def _lines_one_by_one(events: Sequence[RowChange]) -> tuple[list[list[Any]], bytes]:
    """:func:`event_lines` of any batch, event by event (the reference the batch
    path :func:`_batch_lines` must equal), and the bytes of the images digest."""
    out = []
    images = []
    for event in events:
        image = _image_bytes(event)
        images.append(image)
        out.append([event.event_id, _key(event), f"{zlib.crc32(image):08x}"])
    return out, b"".join(image + b"\n" for image in images)


_row_of = attrgetter("_row")


def batch_detail(
    events: Sequence[RowChange],
    *,
    rejected: Mapping[str, str] | None = None,
    retried: Mapping[str, str] | None = None,
    waiting: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """A live commit's ``detail``: digests of the event ids and images, one line
    per event (:func:`event_lines`), the retries waiting after it."""
    images = hashlib.sha256()
    lines = event_lines(events, rejected=rejected, retried=retried, images=images)
    detail: dict[str, Any] = {
        "event_ids": digest_event_ids(line[0] for line in lines),
        "images": "sha256:" + images.hexdigest(),
        "events": lines,
    }
    if source:
        detail["source"] = source
    if waiting:
        detail["waiting"] = dict(waiting)
    return detail


def waiting_of(window: Any) -> dict[str, Any] | None:
    """Retries waiting in a state document's window: count, oldest due time, owed subscribers.

    ``window`` is the document's typed window (or its stored JSON); None when
    nothing waits.
    """
    if window is None:
        return None
    if isinstance(window, Mapping):
        from dbtrigger.state.window import Window  # noqa: PLC0415 - only for stored JSON

        window = Window.from_json(window)
    pending = getattr(window, "pending", ())
    if not pending:
        return None
    owed: dict[str, int] = {}
    for p in pending:
        for name in p.owed or {}:
            owed[str(name)] = owed.get(str(name), 0) + 1
    out: dict[str, Any] = {
        "count": len(pending),
        "oldest_due": format_time(min(p.not_before for p in pending)),
    }
    if owed:
        out["owed"] = dict(sorted(owed.items()))
    return out


def detail_lines(record: Mapping[str, Any]) -> list[EventLine] | None:
    """The per-event lines of a commit record, or None when it has none."""
    detail = record.get("detail")
    if not isinstance(detail, Mapping) or not isinstance(detail.get("events"), list):
        return None
    return [EventLine.from_json(e) for e in detail["events"] if isinstance(e, list) and len(e) >= 3]


__all__ = [
    "GAP",
    "EventLine",
    "batch_detail",
    "detail_lines",
    "digest_images",
    "entry_id",
    "entry_time",
    "event_lines",
    "gap_record",
    "image_digest",
    "image_text",
    "record_of",
    "record_time",
    "unique",
    "waiting_of",
]
