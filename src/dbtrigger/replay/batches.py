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
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dbtrigger import _process
from dbtrigger.cursor import Position, canonical_json
from dbtrigger.errors import CasConflictError, ReplayRefusedError
from dbtrigger.events import RowChange
from dbtrigger.history import records as rec
from dbtrigger.history.store import HistoryStore
from dbtrigger.history.wiring import record_write
from dbtrigger.replay.compare import (
    BatchReplay,
    DriftRow,
    ReplayPlan,
    batch_end,
    compare,
    earlier_lines,
    reach,
    read_range,
    recorded_lines,
)
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.tick import wants_context
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument, parse_time, position_from_json
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.history")  # a logger the redacting filter is on

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


def plan(
    trigger: PollTrigger,
    records: Sequence[Mapping[str, Any]],
    history: Sequence[Mapping[str, Any]] | None = None,
    read_detail: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> ReplayPlan:
    """Read each recorded batch's range again and compare it with the record
    (``history``: every record kept, whose commits before a batch tell a row of
    its range they delivered from one the batch missed; by default ``records``).
    ``read_detail`` reads the detail of a record of ``history`` loaded without details
    (:func:`~dbtrigger.history.view.load`, ``details=False``), for the few
    commits before a batch that are looked at: ``records`` come with theirs.

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
    kept = list(history) if history is not None else list(records)
    index_of = {str(r.get("id")): i for i, r in enumerate(kept)}
    for record in records:
        if record.get("type") not in ("commit", "partial_commit"):
            raise ReplayRefusedError(f"record {record.get('seq')} is not a commit")
        start = position_from_json(record.get("from"), "from")
        end = batch_end(record)
        index = index_of.get(str(record.get("id")), 0)

        def elsewhere(index: int = index, start: Position = start) -> set[tuple[str, str]]:
            return earlier_lines(kept, index, start, read_detail)

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
        detail = record.get("detail")
        if exact and isinstance(detail, Mapping) and "last" not in detail:
            missing = [r for r in batch.drift if r.kind == "gone"]
            lines = rec.detail_lines(record) or []
            gone = {_key_of(r.key) for r in missing}
            further = (
                reach(
                    source,
                    trigger.name,
                    batch_id,
                    record,
                    end,
                    [line for line in lines if _key_of(line.key) in gone],
                )
                if missing
                else None
            )
            if further is not None:
                events = read_range(
                    source, trigger.name, batch_id, start, further, int(record.get("rows") or 0)
                )
                batch = compare(record, events, source, trigger.name, elsewhere)
        if exact and batch.identical and not batch.compared:
            batch = BatchReplay(dict(record), list(events), [], compared=True, identical=True)
        replay_hint = getattr(source, "replay_hint", None)
        if exact and not batch.identical and callable(replay_hint):
            batch.hint = replay_hint(end) or ""
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
        # A replay killed mid-way (its process gone, on this machine) holds nothing.
        gone = _process.gone(doc.lease if doc is not None else None)
        decision = leasemod.decide_acquire(
            doc,
            poller=key,
            fingerprint=trigger.fingerprint,
            owner=owner,
            now=now,
            ttl=max(trigger.lease_ttl, dt.timedelta(minutes=10)),
            holder_gone=gone is not None,
            process=_process.this_process(),
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
        dead = decision.taken_early
        if dead is not None:
            log.warning(
                "the replay of %r by %s (token %s) is no longer running (%s): its lease on %r, "
                "valid until %s, taken over at once",
                trigger.name,
                dead.owner_id,
                dead.fencing_token,
                gone,
                key,
                docmod.format_time(dead.expires_at),
                extra={"event": "lease_holder_gone", "poller": key, "dead_owner": dead.owner_id},
            )
        return cls(store, key, decision.document, etag, decision.fencing_token, owner)

    def release(self, entry: Mapping[str, Any] | None, now: dt.datetime) -> None:
        """Give the lease up, journaling ``entry`` (what the replay did) if there is one."""
        released = leasemod.decide_release(self.doc, owner=self.owner, token=self.token, now=now)
        doc = released or self.doc
        if entry is not None:
            doc = doc.with_journal_entry(entry)
        self.store.write(self.key, docmod.dumps(doc), if_match=self.etag)


def _key_of(key: Mapping[str, Any]) -> str:
    return canonical_json(dict(key))


def journal_live(
    store: CheckpointStore,
    poller: str,
    entry: Mapping[str, Any],
    history: HistoryStore | Literal[False] | None = None,
) -> str | None:
    """Add ``entry`` to the live poller's journal (nothing else changes) and its history
    (``history``: the poller's own, False for none; by default the one beside ``store``).

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
        return record_write(store, doc, history=history)
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
