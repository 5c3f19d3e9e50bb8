"""Deterministic replay: hand a handler exactly the batches the history recorded.

**What "exactly" can mean.** A poller's history records, per commit, the range
it covered (``from``, ``to``), the ids of the events it delivered and a digest
of each event's image (operation, before, after). A replay reads that range
from the source again and compares:

* A source that *keeps images* - the change log (a row of the log never
  changes), and the log-based sources while their log still holds the range -
  gives the events back as they were: same ids, same images, byte for byte.
  The replay delivers them (mode ``exact``). If the source no longer holds
  them all (the log was pruned or purged), the replay is refused, naming what
  is gone: it cannot be exact, and the source cannot say what was there.
* A plain polled table is a cursor, not a history: an updated row has moved
  to a later cursor with new values, a deleted row is gone. The replay reads
  the recorded keys as they are *now* (the range, then the keys that moved,
  by key) and **reports drift** before delivering anything (mode ``reread``):
  ``changed`` (same key, different image now), ``gone`` (no row with that key
  now), ``added`` (a row in the range now that the batch did not have). The
  recorded keys that still exist are delivered in their current state;
  ``gone`` rows cannot be, and ``added`` rows were never part of the batch.

``--verify`` does the comparison and delivers nothing.

**Where it runs.** Under a lease of its own (the state document
``{poller}.replay`` in the same store), so two replays of one poller never
overlap, and it never writes the live poller's checkpoint, lease or window.
What it did is journaled in the replay document and, as a manual entry
(``operation: replay``), in the live poller's journal and history.

**What the handler sees.** The recorded batch id, the recorded event ids,
``ctx.replay`` True and ``ctx.now`` the recorded commit time (the same value a
handler written against ``ctx.now`` saw the first time is not the commit time
but the tick's start; see :attr:`~dbtrigger.runtime.context.BatchContext.now`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dbtrigger.cursor import Position, canonical_json, decode_value, encoded_pk
from dbtrigger.errors import CasConflictError, ReplayRefusedError
from dbtrigger.events import RowChange
from dbtrigger.history import records as rec
from dbtrigger.history.wiring import record_write
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.tick import wants_context
from dbtrigger.sources.base import position_of
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument, parse_time, position_from_json
from dbtrigger.state.stores.base import CheckpointStore

Mode = Literal["exact", "reread"]

#: Log-based sources replay their log's own images while the log holds them;
#: what makes a log stop holding a range, per source, for a refusal to say.
_LOG_SOURCES = {
    "ChangeLogSource": "the change log deletes what every reader passed (prune_passed_by, "
    "changelog prune): keep it longer with prune_keep_seconds to replay",
    "PgLogicalSource": "a replication slot hands out each change once: once the poller's "
    "checkpoint confirmed it, the server keeps it no longer (a slot cannot be rewound); the "
    "changes can no longer be read as they were",
    "BinlogSource": "the server purged the binary log files that held it "
    "(binlog_expire_logs_seconds / PURGE BINARY LOGS): keep them longer to replay",
}


def retention_hint(source: Any) -> str:
    """What makes ``source``'s log stop holding a recorded range."""
    return _LOG_SOURCES.get(type(source).__name__, "the source no longer holds those changes")


def keeps_images(source: Any) -> bool:
    """Can ``source`` give a recorded range back as it was (a log of changes)?"""
    declared = getattr(source, "keeps_images", None)
    if isinstance(declared, bool):
        return declared
    return type(source).__name__ in _LOG_SOURCES


def replay_key(poller: str) -> str:
    """The state document a replay of ``poller`` holds its lease in."""
    return f"{poller}.replay"


# --- comparing -----------------------------------------------------------------------


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
                + f" and they differ from the record: {hint}"
            )
        return out


def _key_text(key: Mapping[str, Any]) -> str:
    return canonical_json(dict(key))


def _event_key(event: RowChange) -> str:
    return _key_text(encoded_pk(event.pk))


def _beyond(position: Position, end: Position) -> bool:
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
            if _beyond(where, end):
                return out
            out.append(event)
            if where == end:
                return out
        after = position_of(events[-1])


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
        now = rec.batch_detail(events)
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
            image = rec.image_digest(event) if first_format else f"{rec.image_crc(event):08x}"
        if image != line.image or line.event_id not in (None, event.event_id):
            drift.append(DriftRow("changed", line.key, line.event_id, event.event_id))
        deliver.append(event)
    drift += _added(events, now_images, taken, elsewhere)
    if not first_format:
        # The batch as it would be delivered is the batch recorded (rows of the
        # range other batches delivered are not part of it).
        recorded = _recorded_digest(detail)
        identical = recorded is not None and rec.columns_digest(rec.batch_detail(deliver)) == (
            recorded
        )
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
) -> list[DriftRow]:
    """The range's rows the batch did not deliver, nor another recorded batch as they are."""
    out: list[DriftRow] = []
    others: set[tuple[str, str]] | None = None
    for e, img in zip(events, images, strict=True):
        if id(e) in taken:
            continue
        if others is None:
            others = elsewhere() if elsewhere is not None else set()
        if (_event_key(e), img) not in others:
            out.append(DriftRow("added", encoded_pk(e.pk), None, e.event_id))
    return out


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


def plan(
    trigger: PollTrigger,
    records: Sequence[Mapping[str, Any]],
    history: Sequence[Mapping[str, Any]] | None = None,
) -> ReplayPlan:
    """Read each recorded batch's range again and compare it with the record
    (``history``: every record kept, which tells a row another batch delivered
    from one the batch missed; by default ``records``).

    A source that keeps images but no longer gives a range back as recorded
    makes a plan whose :meth:`ReplayPlan.refusals` say so (``--verify``
    reports them; a delivery refuses).

    Raises:
        ReplayRefusedError: a record is not a commit, or a log-based source can
            no longer read the range at all (purged).
    """
    source = trigger.source
    exact = keeps_images(source)
    batches = []
    known: list[set[tuple[str, str]]] = []

    def elsewhere() -> set[tuple[str, str]]:
        if not known:
            known.append(recorded_lines(history if history is not None else records))
        return known[0]

    for record in records:
        if record.get("type") not in ("commit", "partial_commit"):
            raise ReplayRefusedError(f"record {record.get('seq')} is not a commit")
        start = position_from_json(record.get("from"), "from")
        end = position_from_json(record.get("to"), "to")
        detail = record.get("detail")
        last = detail.get("last") if isinstance(detail, Mapping) else None
        if last is not None:
            # The batch's last event, past ``to`` when a retry held the checkpoint back.
            last_position = position_from_json(last, "last")
            if _beyond(last_position, end):
                end = last_position
        batch_id = str(record.get("batch_id"))
        try:
            events = read_range(
                source, trigger.name, batch_id, start, end, int(record.get("rows") or 0)
            )
        except ReplayRefusedError:
            raise
        except Exception as exc:
            if not exact:
                raise
            raise ReplayRefusedError(
                f"the source no longer holds batch {batch_id} ({type(exc).__name__}: {exc}): "
                f"{retention_hint(source)}"
            ) from exc
        batch = compare(record, events, source, trigger.name, elsewhere)
        if exact and batch.identical and not batch.compared:
            batch = BatchReplay(dict(record), list(events), [], compared=True, identical=True)
        batches.append(batch)
    return ReplayPlan(trigger.name, "exact" if exact else "reread", batches, retention_hint(source))


# --- delivering ----------------------------------------------------------------------


@dataclass
class Delivered:
    batch_id: str
    events: int
    rejected: dict[str, str]
    retried: dict[str, str]


def _call(handler: Callable[..., Any], events: list[RowChange], ctx: BatchContext) -> None:
    result = handler(events, ctx) if wants_context(handler) else handler(events)
    if inspect.isawaitable(result):

        async def wait() -> Any:
            return await result

        asyncio.run(wait())


def deliver_batch(
    trigger: PollTrigger,
    batch: BatchReplay,
    handler: Callable[..., Any],
    *,
    token: int,
    owner: str,
    subscriber: str | None = None,
    started_at: dt.datetime,
) -> Delivered:
    """Hand one planned batch to ``handler`` with a replay context; what it marked."""
    record = batch.record
    recorded_at = parse_time(record.get("committed_at") or record.get("at"), "committed_at")
    events = batch.events
    marks = EventMarks(events, can_reject=True)
    ctx = BatchContext(
        poller_name=trigger.name,
        batch_id=batch.batch_id,
        batch_index=0,
        fencing_token=token,
        owner_id=owner,
        source_name=trigger.source.name,
        checkpoint_before=position_from_json(record.get("from"), "from"),
        checkpoint_after=position_from_json(record.get("to"), "to"),
        tick_started_at=started_at,
        lease_lost=threading.Event(),
        marks=marks,
        subscriber=subscriber,
        replay=True,
        recorded_at=recorded_at,
    )
    if events:
        _call(handler, list(events), ctx)
    marks.close()
    rejected, retried = marks.snapshot()
    return Delivered(batch.batch_id, len(events), rejected, retried)


@dataclass
class ReplayLease:
    """The lease of a replay, held in ``{poller}.replay``."""

    store: CheckpointStore
    key: str
    doc: StateDocument
    etag: str
    token: int
    owner: str

    @classmethod
    def take(
        cls, store: CheckpointStore, trigger: PollTrigger, owner: str, now: dt.datetime
    ) -> ReplayLease:
        key = replay_key(trigger.name)
        stored = store.read(key)
        doc = docmod.loads(stored.data) if stored is not None else None
        decision = leasemod.decide_acquire(
            doc,
            poller=key,
            fingerprint=trigger.fingerprint,
            owner=owner,
            now=now,
            ttl=max(trigger.lease_ttl, dt.timedelta(minutes=10)),
        )
        if isinstance(decision, leasemod.Busy):
            raise ReplayRefusedError(
                f"another replay of {trigger.name!r} holds {key!r} ({decision.holder}, until "
                f"{docmod.format_time(decision.free_at)}); wait for it to finish. If its "
                "process is gone (killed, its machine lost), free it: dbtrigger release-lease "
                f"{key} --force --reason ... --yes (with the store options)"
            )
        try:
            etag = store.write(
                key,
                docmod.dumps(decision.document),
                if_match=stored.etag if stored is not None else None,
            )
        except CasConflictError as exc:
            raise ReplayRefusedError(
                f"another replay of {trigger.name!r} started just now"
            ) from exc
        return cls(store, key, decision.document, etag, decision.fencing_token, owner)

    def release(self, entry: Mapping[str, Any] | None, now: dt.datetime) -> None:
        """Give the lease up, journaling ``entry`` (what the replay did) if there is one."""
        released = leasemod.decide_release(self.doc, owner=self.owner, token=self.token, now=now)
        doc = released or self.doc
        if entry is not None:
            doc = doc.with_journal_entry(entry)
        self.store.write(self.key, docmod.dumps(doc), if_match=self.etag)


def journal_live(store: CheckpointStore, poller: str, entry: Mapping[str, Any]) -> str | None:
    """Add ``entry`` to the live poller's journal (nothing else changes) and its history.

    A journal-only write: it moves no checkpoint and fences nobody; a poller
    committing meanwhile re-reads and re-applies its own commit (the CAS rule).
    Returns a problem to report, or None.
    """
    for _ in range(5):
        stored = store.read(poller)
        if stored is None:
            return f"poller {poller!r} has no state document; the replay was journaled in its own"
        doc = docmod.loads(stored.data).with_journal_entry(entry, ops.JOURNAL_LIMIT)
        try:
            store.write(poller, docmod.dumps(doc), if_match=stored.etag)
        except CasConflictError:
            continue
        return record_write(store, doc)
    return (
        f"the state of {poller!r} kept changing; the replay is journaled in "
        f"{replay_key(poller)!r} only"
    )


def manual_entry(
    operation: str,
    *,
    doc_position: Position | None,
    actor: str,
    reason: str,
    now: dt.datetime,
    details: Mapping[str, Any],
) -> dict[str, Any]:
    """A manual journal entry that moves nothing (before == after)."""
    return ops.manual_entry(
        operation,
        actor=actor,
        reason=reason,
        now=now,
        before=doc_position,
        after=doc_position,
        details=details,
    )


def current_position(store: CheckpointStore, poller: str) -> Position | None:
    stored = store.read(poller)
    if stored is None:
        return None
    doc = docmod.loads(stored.data)
    return doc.position if doc.checkpoint is not None else None


__all__ = [
    "BatchReplay",
    "Delivered",
    "DriftRow",
    "ReplayLease",
    "ReplayPlan",
    "compare",
    "deliver_batch",
    "journal_live",
    "keeps_images",
    "plan",
    "read_range",
    "recorded_lines",
    "replay_key",
]
