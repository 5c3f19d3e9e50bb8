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
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from dbtrigger.cursor import Position, encoded_pk
from dbtrigger.errors import ReplayRefusedError, SerializationError
from dbtrigger.events import RowChange, event_ids
from dbtrigger.history import images
from dbtrigger.history.images import (
    _image_bytes,  # noqa: F401 - kept importable from here
    _row_texts,  # noqa: F401 - kept importable from here
    _seed,  # noqa: F401 - kept importable from here
    digest_images,
    image_crc,
    image_digest,
    image_text,
    row_batch,
    row_crcs,
)
from dbtrigger.history.store import EncodedRecord, encode_json
from dbtrigger.state.document import JournalRecord, format_time, parse_time, position_to_json

#: Record types besides the journal's (commit, partial_commit, manual).
GAP = "gap"

#: A ``str`` as JSON, as the records are written (``ensure_ascii``): json's own.
_json_str = json.encoder.encode_basestring_ascii


def entry_id(entry: Mapping[str, Any]) -> str:
    """The identity of a journal entry: a digest of its JSON text as stored."""
    text = (
        entry.json_text()
        if isinstance(entry, JournalRecord)
        else json.dumps(dict(entry), separators=(",", ":"), default=str)
    )
    return _text_id(text)


@functools.lru_cache(maxsize=256)
def _text_id(text: str) -> str:
    # An append looks up the ids of a whole journal; one is new, the rest remembered.
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def entry_time(entry: Mapping[str, Any]) -> str | None:
    """The entry's time as written (``committed_at`` or ``at``), if it has one."""
    value = entry.get("committed_at") or entry.get("at")
    return value if isinstance(value, str) else None


def record_of(
    entry: Mapping[str, Any],
    detail: Mapping[str, Any] | None = None,
    *,
    record_id: str | None = None,
    detail_json: str | None = None,
    seq: int = 0,
) -> dict[str, Any]:
    """The history record of a journal ``entry``, numbered ``seq`` (its number in
    the history, set when appended if not known yet); ``record_id`` is the entry's
    :func:`entry_id` and ``detail_json`` the detail's JSON (:func:`encoded_detail`),
    when the caller has them.

    A journal entry as the document holds it keeps its JSON text, so the record's
    line is made from that text and the detail's (an
    :class:`~dbtrigger.history.store.EncodedRecord`): the same bytes as encoding
    the record, with nothing encoded again."""
    rid = record_id if record_id is not None else entry_id(entry)
    at = entry_time(entry)
    out: dict[str, Any] = {"seq": seq, "id": rid, "at": at}
    out.update(entry)
    if detail is not None:
        out["detail"] = dict(detail)
    if not isinstance(entry, JournalRecord) or not _RECORD_KEYS.isdisjoint(entry):
        return out  # (an entry that names a record's own key: the record's value wins)
    text = entry.json_text()
    parts = [',"id":', _json_str(rid), ',"at":', "null" if at is None else _json_str(at)]
    if text != "{}":
        parts += [",", text[1:-1]]
    if detail is not None:
        parts += [',"detail":', detail_json if detail_json is not None else encode_json(detail)]
    parts.append("}\n")
    return EncodedRecord(out, "".join(parts).encode("ascii"))


#: The newest commit detail format this version reads (and writes, for a batch that
#: needs it: :mod:`dbtrigger.history.images`): a newer one is refused, never read
#: as "no lines" (a replay would take that as a batch with nothing to compare).
DETAIL_FORMAT = images.MARSHAL_IMAGES

#: The keys a record puts before and after its entry's.
_RECORD_KEYS = frozenset(("seq", "id", "at", "detail"))


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
        "written for longer than the state document's journal reaches back"
        if after is not None
        else "entries before this time may be missing: the history held no record (it was "
        "removed, or started after the poller's first commits) and the state document's "
        "journal reaches back only this far",
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
    """One delivered event as the history keeps it: its key, its image's CRC-32 and
    its outcome. ``event_id`` is set only in records written before the lines
    became columns (the id is a function of the key and the cursor, which the
    image covers, so a replay that finds the same key and image has the same id)."""

    key: Mapping[str, Any]
    image: str
    outcome: str = "accepted"
    reason: str | None = None
    event_id: str | None = None

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> EventLine:
        """A line of the first format: ``[event id, key, image, outcome, reason]``."""
        return cls(
            key=dict(raw[1] or {}),
            image=str(raw[2]),
            outcome=str(raw[3]) if len(raw) > 3 else "accepted",
            reason=str(raw[4]) if len(raw) > 4 else None,
            event_id=str(raw[0]),
        )


def _columns(
    events: Sequence[RowChange], form: int, *, remake: bool = False
) -> tuple[dict[str, Any], list[int], int]:
    """The batch's keys (one column of values for the common one-column int or text
    key, else one encoded key a row), one image CRC-32 a row, and the detail format
    they are in (see :mod:`dbtrigger.history.images`: the newest up to ``form``, or
    ``form`` itself when a replay makes a record's images again, ``remake``).

    This runs for every delivered batch, so the common case makes no Python call
    per row (:func:`~dbtrigger.history.images.row_crcs`).
    """
    batch = row_batch(events)
    if batch is None:
        if form >= images.MARSHAL_IMAGES and not remake:
            form = images.REPR_IMAGES  # (no row tuple to marshal: its images are format 2's)
        keys = {"keys": [_key(e) for e in events]}
        return keys, [image_crc(e, form) for e in events], form
    shape, rows = batch
    crcs, form = row_crcs(events, shape, rows, form, remake=remake)
    index = shape.single_index
    if index >= 0:
        values = list(map(itemgetter(index), rows))
        kinds = set(map(type, values))
        if kinds in ({int}, {str}):
            kind = "int" if int in kinds else "str"
            return {"column": shape.pk_names[0], "kind": kind, "values": values}, crcs, form
    return {"keys": [_key(e) for e in events]}, crcs, form


def batch_detail(
    events: Sequence[RowChange],
    *,
    rejected: Mapping[str, str] | None = None,
    retried: Mapping[str, str] | None = None,
    waiting: Mapping[str, Any] | None = None,
    source: str | None = None,
    form: int | None = None,
) -> dict[str, Any]:
    """A live commit's ``detail``: the batch's keys and image CRCs as columns, where
    its last event is (``last``), the outcome of each event that was not
    accepted, the retries waiting after it.

    Event ids are computed only for a batch that marked events (the outcomes
    name them): a batch delivered once pays for no id. ``form``: the images made
    again in that detail format (a replay comparing with a record), else in the
    newest the batch needs.
    """
    keys, crcs, made = _columns(events, form or DETAIL_FORMAT, remake=form is not None)
    return _detail(events, keys, crcs, made, rejected, retried, waiting, source)


def encoded_detail(
    events: Sequence[RowChange],
    *,
    rejected: Mapping[str, str] | None = None,
    retried: Mapping[str, str] | None = None,
    waiting: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> tuple[dict[str, Any], str]:
    """:func:`batch_detail` and its JSON as a record holds it (``encode_json``'s
    text), written from what is known of the columns instead of encoded value by
    value: the CRCs and an ``int`` key column are exact ``int`` lists, written by
    one ``%`` format each."""
    keys, crcs, form = _columns(events, DETAIL_FORMAT)
    detail = _detail(events, keys, crcs, form, rejected, retried, waiting, source)
    parts = ['{"format":', str(form), ',"rows":', str(len(events))]
    if "values" in keys:
        kind = keys["kind"]
        values = keys["values"]
        parts += [',"column":', _json_str(keys["column"]), ',"kind":', _json_str(kind)]
        parts += [',"values":', _int_list(values) if kind == "int" else encode_json(values)]
    else:
        parts += [',"keys":', encode_json(keys["keys"])]
    parts += [',"crcs":', _int_list(crcs)]
    for name in ("last", "outcomes", "source", "waiting"):
        if name in detail:
            parts += [',"', name, '":', encode_json(detail[name])]
    parts.append("}")
    return detail, "".join(parts)


def _int_list(values: list[int]) -> str:
    """The JSON of a list of exact ``int``: what ``json`` writes (``int.__repr__``,
    which ``%d`` is, comma-separated), in one format."""
    if not values:
        return "[]"
    return ("[" + "%d," * (len(values) - 1) + "%d]") % tuple(values)


def _detail(
    events: Sequence[RowChange],
    keys: Mapping[str, Any],
    crcs: list[int],
    form: int,
    rejected: Mapping[str, str] | None,
    retried: Mapping[str, str] | None,
    waiting: Mapping[str, Any] | None,
    source: str | None,
) -> dict[str, Any]:
    detail: dict[str, Any] = {"format": form, "rows": len(events), **keys, "crcs": crcs}
    last = _last_position(events)
    if last is not None:
        detail["last"] = last
    if rejected or retried:
        outcomes = []
        for i, eid in enumerate(event_ids(events)):  # (the batch's ids made at once)
            if rejected and eid in rejected:
                outcomes.append([i, "rejected", rejected[eid][:200]])
            elif retried and eid in retried:
                outcomes.append([i, "retried", retried[eid][:200]])
        detail["outcomes"] = outcomes
    if source:
        detail["source"] = source
    if waiting:
        detail["waiting"] = dict(waiting)
    return detail


def _last_position(events: Sequence[RowChange]) -> dict[str, Any] | None:
    """Where the batch's last event is (the position after it), or None.

    A batch's ``to`` is the checkpoint after it, which a retry waiting in the
    window holds below the batch's later events: a replay reads the range up to
    whichever is further, so that it finds every event the batch delivered."""
    if not events:
        return None
    event = events[-1]
    try:
        return position_to_json(Position(cursor=event.cursor, pk=dict(event.pk)))
    except SerializationError:
        return None


def columns_digest(detail: Mapping[str, Any]) -> str:
    """``sha256:...`` over a second-format detail's keys and image CRCs: what a
    record too large to keep its columns keeps instead (see the recorder)."""
    part = {k: detail.get(k) for k in ("column", "kind", "values", "keys", "crcs") if k in detail}
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


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
    """The per-event lines of a commit record, or None when it has none (a commit
    recovered from the journal, or one whose lines were too large to keep)."""
    detail = record.get("detail")
    if not isinstance(detail, Mapping):
        return None
    form = detail.get("format", 1)
    if type(form) is not int or form > DETAIL_FORMAT:
        raise ReplayRefusedError(
            f"history record {record.get('seq')} ({record.get('at')}) holds its events in "
            f"format {form!r}; this dbtrigger reads formats up to {DETAIL_FORMAT}: a newer "
            "dbtrigger wrote it, upgrade dbtrigger to read or replay it"
        )
    if isinstance(detail.get("events"), list):  # the first format: one list a line
        return [
            EventLine.from_json(e) for e in detail["events"] if isinstance(e, list) and len(e) >= 3
        ]
    crcs = detail.get("crcs")
    if not isinstance(crcs, list):
        return None
    if isinstance(detail.get("values"), list):
        column, kind = str(detail.get("column")), str(detail.get("kind"))
        keys: list[Mapping[str, Any]] = [{column: [kind, v]} for v in detail["values"]]
    elif isinstance(detail.get("keys"), list):
        keys = [k if isinstance(k, Mapping) else {} for k in detail["keys"]]
    else:
        return None
    marks = {
        int(o[0]): (str(o[1]), str(o[2]))
        for o in detail.get("outcomes") or ()
        if isinstance(o, list) and len(o) >= 3
    }
    lines = []
    for i, (key, crc) in enumerate(zip(keys, crcs, strict=False)):
        outcome, reason = marks.get(i, ("accepted", None))
        lines.append(EventLine(key=key, image=f"{int(crc):08x}", outcome=outcome, reason=reason))
    return lines


__all__ = [
    "GAP",
    "EventLine",
    "batch_detail",
    "columns_digest",
    "detail_lines",
    "digest_images",
    "encoded_detail",
    "entry_id",
    "entry_time",
    "gap_record",
    "image_crc",
    "image_digest",
    "image_text",
    "record_of",
    "record_time",
    "unique",
    "waiting_of",
]
