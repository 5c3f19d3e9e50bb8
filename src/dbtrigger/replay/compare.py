"""Comparing a recorded batch with its range read again: what a replay delivers
and how it differs from the record (see :mod:`dbtrigger.replay.batches`).

Each recorded event is found by its key, the one with its recorded image first
(a change log may hold several changes of one row), in the range read or, when
it has moved (a polled row updated since), wherever it is now. The batch is
delivered in recorded order; a row of the range it did not deliver is ``added``
unless an earlier recorded batch delivered it as it is (with a retry waiting,
a batch's range holds rows earlier batches delivered).

Nothing here writes; the source is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dbtrigger.cursor import Position, canonical_json, decode_value, encoded_pk
from dbtrigger.events import RowChange
from dbtrigger.history import images as images_mod
from dbtrigger.history import records as rec
from dbtrigger.sources.base import position_of
from dbtrigger.state import document as docmod
from dbtrigger.state.document import position_from_json

Mode = Literal["exact", "reread"]


@dataclass(frozen=True)
class DriftRow:
    """One recorded row that is not now what it was (or a row the batch did not have)."""

    kind: Literal["changed", "gone", "added"]
    key: Mapping[str, Any]
    recorded_id: str | None
    current_id: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "pk": dict(self.key),
            "recorded_event_id": self.recorded_id,
            "current_event_id": self.current_id,
        }


@dataclass
class BatchReplay:
    """One recorded batch: what the replay delivers and how it differs from the record."""

    record: dict[str, Any]
    events: list[RowChange]
    drift: list[DriftRow] = field(default_factory=list)
    #: The record has per-event lines to compare against (else only its digest).
    compared: bool = True
    #: The events' id and image digests match the recorded ones.
    identical: bool = False
    #: Why the source cannot give this batch back, when it says (else the plan's hint).
    hint: str = ""

    @property
    def recovered(self) -> bool:
        """The record has no detail: it was recorded from the journal after its own
        append was lost (a crash after the commit, a history store down), so
        nothing but its range and row count can be checked."""
        return not isinstance(self.record.get("detail"), Mapping)

    @property
    def whole(self) -> bool:
        """A recovered batch's range gives back as many events as it delivered."""
        return len(self.events) == int(self.record.get("rows") or 0)

    @property
    def batch_id(self) -> str:
        return str(self.record.get("batch_id"))


@dataclass
class ReplayPlan:
    poller: str
    mode: Mode
    batches: list[BatchReplay]
    #: What makes the source's log stop holding a range (for a refusal).
    hint: str = ""

    @property
    def drift(self) -> list[DriftRow]:
        return [row for b in self.batches for row in b.drift]

    @property
    def events(self) -> int:
        return sum(len(b.events) for b in self.batches)

    def refusals(self) -> list[str]:
        """Why an ``exact`` replay cannot deliver (a batch the log no longer gives
        back as recorded); empty when it can."""
        if self.mode != "exact":
            return []
        hint = self.hint or "the source no longer holds those changes"
        out = []
        for b in self.batches:
            if b.identical or (b.recovered and b.whole):
                continue
            if b.recovered:
                out.append(
                    f"batch {b.batch_id} was recorded from the journal (its history append "
                    "was lost), so it has no per-event record, and the log gives back "
                    f"{len(b.events)} event(s) in its range, not the {b.record.get('rows')} it "
                    "delivered (a retry waiting in the window, or the log pruned): it cannot "
                    "be replayed as it was. dbtrigger rewind --to-batch has the poller deliver "
                    "its range again"
                )
                continue
            gone = sum(1 for r in b.drift if r.kind == "gone")
            out.append(
                f"batch {b.batch_id} cannot be replayed as it was: the log gives back "
                f"{len(b.events)} of its {b.record.get('rows')} recorded event(s)"
                + (f" ({gone} no longer in the log)" if gone else "")
                + f" and they differ from the record: {b.hint or hint}"
            )
        return out


def _key_text(key: Mapping[str, Any]) -> str:
    return canonical_json(dict(key))


def _event_key(event: RowChange) -> str:
    return _key_text(encoded_pk(event.pk))


def beyond(position: Position, end: Position) -> bool:
    """Is ``position`` after ``end`` in keyset order (as far as Python can compare)?"""
    names = list(end.pk)
    try:
        mine = (position.cursor, *(position.pk.get(n) for n in names))
        theirs = (end.cursor, *(end.pk.get(n) for n in names))
        return bool(mine > theirs)
    except TypeError:
        try:
            return bool(position.cursor > end.cursor)
        except TypeError:
            return False


def read_range(
    source: Any, poller: str, batch_id: str, start: Position, end: Position, expected: int
) -> list[RowChange]:
    """The source's events after ``start`` up to and including ``end``, now."""
    out: list[RowChange] = []
    after = start
    limit = max(expected, 1) + 1
    while True:
        rows = source.fetch(after, limit)
        if not rows:
            return out
        events = source.to_events(rows, poller=poller, batch_id=batch_id)
        for event in events:
            where = position_of(event)
            if beyond(where, end):
                return out
            out.append(event)
            if where == end:
                return out
        after = position_of(events[-1])


#: How far past a record's ``to`` a replay reads, at most, for a record that does not
#: say where its last event is: this many times its rows (and at least READ_ON_MIN).
READ_ON_ROWS = 10
READ_ON_MIN = 1000


def reach(
    source: Any,
    poller: str,
    batch_id: str,
    record: Mapping[str, Any],
    end: Position,
    missing: Sequence[rec.EventLine],
) -> Position | None:
    """Where the last of the ``missing`` recorded events is past ``end``, read on
    (bounded by :data:`READ_ON_ROWS`): for a record written before records said
    where their last event is (``last``), whose batch reached past its ``to``
    while a retry waited. None when none of them is found."""
    wanted = {(_key_text(line.key), line.image) for line in missing}
    cap = max(READ_ON_ROWS * int(record.get("rows") or 0), READ_ON_MIN)
    after, seen, furthest = end, 0, None
    while wanted and seen < cap:
        rows = source.fetch(after, 500)
        if not rows:
            break
        events = source.to_events(rows, poller=poller, batch_id=batch_id)
        crcs = rec.batch_detail(events, form=_form(record))["crcs"]
        for event, crc in zip(events, crcs, strict=True):
            key = (_event_key(event), f"{crc:08x}")
            if key in wanted:
                wanted.discard(key)
                furthest = position_of(event)
        seen += len(events)
        after = position_of(events[-1])
    return furthest


def compare(
    record: Mapping[str, Any],
    events: Sequence[RowChange],
    source: Any,
    poller: str,
    elsewhere: Callable[[], set[tuple[str, str]]] | None = None,
) -> BatchReplay:
    """What the replay of ``record`` delivers, given the range read now (``events``).

    Each recorded event is found by its key (the one with its recorded image
    first: a change log may hold several changes of one row), in the range or,
    when it has moved, wherever it is now; the batch is delivered in recorded
    order. A row of the range the batch did not deliver is ``added`` unless
    another recorded batch delivered it as it is (``elsewhere``: key and image
    of the other batches' events): with a retry waiting, a batch's range holds
    rows earlier batches delivered."""
    lines = rec.detail_lines(record)
    raw = record.get("detail")
    detail: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    first_format = isinstance(detail.get("events"), list) or "event_ids" in detail
    if first_format:
        # The first format: event ids and images digested, one list a line.
        now_images = [rec.image_digest(e) for e in events]
        identical = docmod.digest_event_ids(e.event_id for e in events) == detail.get(
            "event_ids"
        ) and rec.digest_images(events) == detail.get("images")
    else:
        now = rec.batch_detail(events, form=_form(record))
        now_images = [f"{crc:08x}" for crc in now["crcs"]]
        recorded = _recorded_digest(detail)
        identical = recorded is not None and rec.columns_digest(now) == recorded
    if lines is None:
        return BatchReplay(dict(record), list(events), [], compared=False, identical=identical)
    found, taken = _matched(lines, events, now_images)
    moved = [line for line, hit in zip(lines, found, strict=True) if hit is None]
    current: dict[str, RowChange] = {}
    if moved:
        current = _lookup(source, poller, str(record.get("batch_id")), moved)
    deliver: list[RowChange] = []
    drift: list[DriftRow] = []
    for line, hit in zip(lines, found, strict=True):
        if hit is not None:
            event, image = hit
        else:
            elsewhere_now = current.get(_key_text(line.key))
            if elsewhere_now is None:
                drift.append(DriftRow("gone", line.key, line.event_id, None))
                continue
            event = elsewhere_now
            image = (
                rec.image_digest(event)
                if first_format
                else f"{rec.image_crc(event, _form(record)):08x}"
            )
        if image != line.image or line.event_id not in (None, event.event_id):
            drift.append(DriftRow("changed", line.key, line.event_id, event.event_id))
        deliver.append(event)
    drift += _added(events, now_images, taken, elsewhere, None if first_format else _form(record))
    if not first_format:
        # The batch as it would be delivered is the batch recorded (rows of the
        # range other batches delivered are not part of it).
        recorded = _recorded_digest(detail)
        remade = rec.batch_detail(deliver, form=_form(record))
        identical = recorded is not None and rec.columns_digest(remade) == recorded
    return BatchReplay(dict(record), deliver, drift, compared=True, identical=identical)


def _matched(
    lines: Sequence[rec.EventLine], events: Sequence[RowChange], images: Sequence[str]
) -> tuple[list[tuple[RowChange, str] | None], set[int]]:
    """Each recorded line's event in the range read now (and its image), by key,
    the one with the recorded image first; None for a line not there. And the
    events taken (by ``id``)."""
    pool: dict[str, list[tuple[RowChange, str]]] = {}
    for e, img in zip(events, images, strict=True):
        pool.setdefault(_event_key(e), []).append((e, img))
    taken: set[int] = set()
    found: list[tuple[RowChange, str] | None] = []
    for line in lines:
        candidates = [c for c in pool.get(_key_text(line.key), ()) if id(c[0]) not in taken]
        same = [c for c in candidates if c[1] == line.image]
        pick = (same or candidates)[0] if (same or candidates) else None
        if pick is not None:
            taken.add(id(pick[0]))
        found.append(pick)
    return found, taken


def _added(
    events: Sequence[RowChange],
    images: Sequence[str],
    taken: set[int],
    elsewhere: Callable[[], set[tuple[str, str]]] | None,
    form: int | None,
) -> list[DriftRow]:
    """The range's rows the batch did not deliver, nor another recorded batch as they are.

    ``images`` are in the detail format ``form`` of the record compared (None:
    the first format); another batch's record may be in the other of formats 2
    and 3 (written before and after an upgrade), so a row not found there by its
    image in ``form`` is looked for by its image in that one too."""
    out: list[DriftRow] = []
    others: set[tuple[str, str]] | None = None
    for e, img in zip(events, images, strict=True):
        if id(e) in taken:
            continue
        if others is None:
            others = elsewhere() if elsewhere is not None else set()
        key = _event_key(e)
        if (key, img) in others:
            continue
        if form is not None and any(
            (key, f"{rec.image_crc(e, other):08x}") in others
            for other in _OTHER_FORMS.get(form, ())
        ):
            continue
        out.append(DriftRow("added", encoded_pk(e.pk), None, e.event_id))
    return out


#: The image formats a row may have been recorded in by another batch (format 3
#: only where this Python makes its images: images.MARSHAL_STABLE).
_OTHER_FORMS = {
    images_mod.REPR_IMAGES: (images_mod.MARSHAL_IMAGES,) if images_mod.MARSHAL_STABLE else (),
    images_mod.MARSHAL_IMAGES: (images_mod.REPR_IMAGES,),
}


def _form(record: Mapping[str, Any]) -> int:
    """The detail format of a (second format or later) commit record: how its images
    are made again (:mod:`dbtrigger.history.images`)."""
    detail = record.get("detail")
    form = detail.get("format") if isinstance(detail, Mapping) else None
    return form if type(form) is int and form >= images_mod.REPR_IMAGES else images_mod.REPR_IMAGES


def _recorded_digest(detail: Mapping[str, Any]) -> str | None:
    recorded = detail.get("digest")
    if recorded is None and "crcs" in detail:
        recorded = rec.columns_digest(detail)
    return str(recorded) if recorded is not None else None


def recorded_lines(records: Sequence[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """The key and image of every event the commit ``records`` hold lines for."""
    out: set[tuple[str, str]] = set()
    for record in records:
        if record.get("type") not in ("commit", "partial_commit"):
            continue
        for line in rec.detail_lines(record) or ():
            out.add((_key_text(line.key), line.image))
    return out


def batch_end(record: Mapping[str, Any]) -> Position:
    """Up to where a commit record's range reaches: its ``to``, or its last event
    when that is further (a retry waiting in the window held ``to`` back)."""
    end = position_from_json(record.get("to"), "to")
    detail = record.get("detail")
    last = detail.get("last") if isinstance(detail, Mapping) else None
    if last is not None:
        last_position = position_from_json(last, "last")
        if beyond(last_position, end):
            return last_position
    return end


#: How many records back :func:`earlier_lines` looks at most.
EARLIER_MAX = 10_000


def earlier_lines(
    history: Sequence[Mapping[str, Any]],
    index: int,
    start: Position,
    read_detail: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> set[tuple[str, str]]:
    """The events the commits before ``history[index]`` delivered that may lie in its
    range (after ``start``): back to the first commit whose range ends at or
    before ``start`` (the rows of a range were settled by its own batch or by
    those before it, while the checkpoint stayed below them). ``read_detail`` reads a
    record's detail when ``history`` was loaded without (only those walked)."""
    chosen: list[Mapping[str, Any]] = []
    for record in reversed(history[max(0, index - EARLIER_MAX) : index]):
        if record.get("type") not in ("commit", "partial_commit"):
            continue
        if read_detail is not None:
            record = read_detail(record)  # noqa: PLW2901 - the same record, its detail read
        chosen.append(record)
        detail = record.get("detail")
        if isinstance(detail, Mapping) and "crcs" in detail and "last" not in detail:
            continue  # (written before records said where their batch ended: unknown)
        try:
            if not beyond(batch_end(record), start):
                break
        except Exception:  # noqa: BLE001 - a record without a readable range ends the walk
            break
    return recorded_lines(chosen)


def _lookup(source: Any, poller: str, batch_id: str, lines: Sequence[Any]) -> dict[str, RowChange]:
    """The rows with these recorded keys now, wherever their cursor is (key -> event)."""
    finder = getattr(source, "rows_with_keys", None)
    if finder is None:
        return {}
    keys = [
        {name: decode_value(str(value[0]), value[1]) for name, value in line.key.items()}
        for line in lines
    ]
    rows = finder(keys)
    return {_event_key(e): e for e in source.to_events(rows, poller=poller, batch_id=batch_id)}


__all__ = [
    "BatchReplay",
    "DriftRow",
    "Mode",
    "ReplayPlan",
    "batch_end",
    "beyond",
    "compare",
    "earlier_lines",
    "reach",
    "read_range",
    "recorded_lines",
]
