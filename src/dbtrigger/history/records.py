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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from dbtrigger.cursor import encoded_pk
from dbtrigger.errors import SerializationError
from dbtrigger.events import RowChange
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


def image_digest(event: RowChange) -> str:
    """16 hex digits of the image's SHA-256: enough to tell a changed row."""
    return hashlib.sha256(image_text(event).encode("utf-8")).hexdigest()[:16]


def digest_images(digests: Iterable[str]) -> str:
    """``sha256:...`` over the per-event image digests, in order."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.encode("ascii"))
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def _key(event: RowChange) -> Any:
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

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.event_id, "pk": dict(self.key), "img": self.image}
        if self.outcome != "accepted":
            out["o"] = self.outcome
            if self.reason:
                out["reason"] = self.reason[:200]
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EventLine:
        return cls(
            event_id=str(raw.get("id")),
            key=dict(raw.get("pk") or {}),
            image=str(raw.get("img")),
            outcome=str(raw.get("o") or "accepted"),
            reason=raw.get("reason"),
        )


def event_lines(
    events: Sequence[RowChange],
    *,
    rejected: Mapping[str, str] | None = None,
    retried: Mapping[str, str] | None = None,
) -> list[EventLine]:
    """The delivered events with their outcomes (``rejected`` / ``retried``: id -> reason)."""
    rejected = rejected or {}
    retried = retried or {}
    out = []
    for event in events:
        eid = event.event_id
        outcome, reason = "accepted", None
        if eid in rejected:
            outcome, reason = "rejected", rejected[eid]
        elif eid in retried:
            outcome, reason = "retried", retried[eid]
        out.append(EventLine(eid, _key(event), image_digest(event), outcome, reason))
    return out


def batch_detail(
    lines: Sequence[EventLine],
    *,
    waiting: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """A live commit's ``detail``: digests, per-event lines, waiting retries."""
    detail: dict[str, Any] = {
        "event_ids": digest_event_ids(line.event_id for line in lines),
        "images": digest_images(line.image for line in lines),
        "events": [line.to_json() for line in lines],
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
    return [EventLine.from_json(e) for e in detail["events"] if isinstance(e, Mapping)]


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
