"""Manual state operations as pure functions of (document, now, actor, reason).

These are what an operator does to a poller by hand - start over, move the
checkpoint, restore a backup, copy the state to a new poller name, free a lease,
step past a poison batch - decided without I/O, like the lease transitions in
:mod:`dbtrigger.state.lease`. The CLI reads the document, calls one of these,
shows the before/after, and writes the result with the etag it read.

Two rules hold for every operation:

* **A live lease is never overridden silently.** Unless ``force`` is given,
  an operation on a document whose lease is live raises
  :class:`~dbtrigger.errors.LiveLeaseError`.
* **A lease that is not released is always fenced out.** A holder may still
  commit after its lease expired (the etag, not the clock, is what protects a
  commit), and after a CAS conflict it re-reads and re-applies its commit. So
  a manual change that kept the holder's owner/token would be silently
  overwritten by that holder's next commit. Instead the lease is replaced by a
  *released* lease owned by the operator with the fencing token incremented:
  the old holder's commit, heartbeat and release are then refused with
  ``LostLeaseError``, and the next tick acquires the lease normally. A lease
  that is already released needs no fencing and keeps its token.

Every operation appends one journal entry::

    {"type": "manual", "operation": "reset", "actor": "ana@host",
     "reason": "...", "at": "2026-...Z", "before": <position|null>,
     "after": <position|null>, ...details}

where a position is the state document's cursor JSON and ``null`` means "the
beginning of the source".
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, LiveLeaseError
from dbtrigger.names import validate_name
from dbtrigger.state import document as docmod
from dbtrigger.state import journal
from dbtrigger.state.document import Checkpoint, Lease, StateDocument
from dbtrigger.state.journal import manual as manual_entry
from dbtrigger.state.journal import position_json

#: Journal entries a manual operation keeps (the document's own default bound).
JOURNAL_LIMIT = docmod.DEFAULT_JOURNAL_LIMIT

#: Owner id prefix of a lease written by an operator.
OPERATOR_PREFIX = "operator:"

if TYPE_CHECKING:
    from typing_extensions import NotRequired, TypedDict, Unpack

    class Manual(TypedDict):
        """Who changes a poller's state by hand, when and why: the keyword
        arguments every operation that touches an existing document takes.

        ``now`` (the operator's clock), ``actor`` and ``reason`` go into the
        journal entry; ``force`` acts under a live lease (its holder is fenced
        out either way); ``details`` are more journal fields. Each operation
        also takes ``journal_limit``, the entries kept (:data:`JOURNAL_LIMIT`).
        """

        now: dt.datetime
        actor: str
        reason: str
        force: NotRequired[bool]
        details: NotRequired[Mapping[str, Any] | None]


def current_position(doc: StateDocument) -> Position | None:
    return doc.checkpoint.position if doc.checkpoint is not None else None


def _check_key_fits(doc: StateDocument, definition: Mapping[str, Any]) -> None:
    """A checkpoint kept by ``accept_source`` must name a value for each key column of
    the new definition that breaks ties (the key but the cursor column): kept without
    one, every later fetch failed on it."""
    keys = definition.get("pk_columns")
    position = current_position(doc)
    if not isinstance(keys, list) or position is None or position.is_beginning:
        return
    if {k for k in keys if k != definition.get("cursor_column")} <= set(position.pk):
        return
    had = ", ".join(position.pk) or "none"
    stood = " ".join([str(position.cursor), *(f"{k}={v}" for k, v in position.pk.items())])
    pks = " ".join(f"--pk {k}=VALUE" for k in keys)
    raise ConfigurationError(
        f"poller {doc.poller_name!r}: the key columns changed ({had} -> {', '.join(keys)}), so "
        f"its checkpoint (after {stood}) cannot be kept as "
        "it is: no fetch could start after it. Accept the definition and move the checkpoint "
        f"in the same command: add --to-cursor VALUE {pks} (the row it stopped after, by its "
        "new key; the rows after it are delivered), or --to-beginning (every row again)"
    )


def live_lease(doc: StateDocument, now: dt.datetime) -> Lease | None:
    """The lease if somebody holds it right now (not released, not expired)."""
    lease = doc.lease
    if lease is None or lease.released or now >= lease.expires_at:
        return None
    return lease


def check_lease(doc: StateDocument, *, now: dt.datetime, force: bool, operation: str) -> None:
    """Refuse to touch a document under a live lease unless ``force``.

    Raises:
        LiveLeaseError: naming the holder, its token and when the lease expires.
    """
    lease = live_lease(doc, now)
    if lease is None or force:
        return
    raise LiveLeaseError(
        f"{operation} refused: poller {doc.poller_name!r} is leased by {lease.owner_id} "
        f"(token {lease.fencing_token}) until {docmod.format_time(lease.expires_at)}; "
        "wait for it to expire, or pass --force to fence that owner out "
        "(its in-flight batch will be rejected and redelivered)",
        poller=doc.poller_name,
        fencing_token=lease.fencing_token,
        holder=lease.owner_id,
    )


def force_takeover(doc: StateDocument, *, now: dt.datetime, actor: str) -> StateDocument:
    """Fence out the current lease holder: a released operator lease, token + 1.

    A document without a lease, or whose lease is already released, is
    returned unchanged: nobody can commit on it.
    """
    lease = doc.lease
    if lease is None or lease.released:
        return doc
    fenced = Lease(
        owner_id=f"{OPERATOR_PREFIX}{actor}",
        fencing_token=lease.fencing_token + 1,
        acquired_at=now,
        heartbeat_at=now,
        expires_at=now,
        released=True,
        extra=lease.extra,
    )
    return replace(doc, lease=fenced)


def _fence_details(before: StateDocument, after: StateDocument) -> dict[str, Any]:
    old, new = before.lease, after.lease
    if old is None or new is None or old is new:
        return {}
    return {
        "fenced": {
            "owner_id": old.owner_id,
            "fencing_token": old.fencing_token,
            "new_fencing_token": new.fencing_token,
        }
    }


def _manual_checkpoint(
    position: Position | None, now: dt.datetime, like: Checkpoint | None = None
) -> Checkpoint | None:
    """The checkpoint an operator sets: no batch behind it; None for the beginning.

    Fields a newer dbtrigger stored in ``like`` (the checkpoint it replaces)
    are carried over, as every write does.
    """
    if position is None or position.is_beginning:
        return None
    return Checkpoint(
        position=position,
        last_successful_batch_id=None,
        updated_at=now,
        row_count=0,
        extra=like.extra if like is not None else {},
    )


def _fence_and_journal(
    doc: StateDocument,
    operation: str,
    who: Manual,
    *,
    after: Position | None,
    lease_operation: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> tuple[StateDocument, dict[str, Any]]:
    """The two rules every change to an existing document follows, in one place.

    Refuses a live lease unless ``force``, fences its holder out, and returns
    the fenced document with the journal entry of ``operation`` (``details``,
    by default the operator's, plus who was fenced, if anyone). The caller
    makes its own change to the fenced document and appends the entry.
    """
    now, actor = who["now"], who["actor"]
    check_lease(doc, now=now, force=who.get("force", False), operation=lease_operation or operation)
    fenced = force_takeover(doc, now=now, actor=actor)
    entry = manual_entry(
        operation,
        actor=actor,
        reason=who["reason"],
        now=now,
        before=current_position(doc),
        after=after,
        details={
            **(details if details is not None else who.get("details") or {}),
            **_fence_details(doc, fenced),
        },
    )
    return fenced, entry


def _apply(
    doc: StateDocument,
    operation: str,
    position: Position | None,
    who: Manual,
    journal_limit: int,
    *,
    details: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
    definition: Mapping[str, Any] | None = None,
) -> StateDocument:
    """Move the checkpoint to ``position`` (None: the beginning), fenced and journaled.

    A new ``fingerprint`` comes with its readable ``definition`` (None when the
    source cannot describe itself: the old one is then dropped, not kept
    next to a fingerprint it does not explain).
    """
    fenced, entry = _fence_and_journal(doc, operation, who, after=position, details=details)
    out = replace(
        fenced,
        checkpoint=_manual_checkpoint(position, who["now"], fenced.checkpoint),
        failure=None,
        window=None,  # per-event outcomes belong to the old position
        source_fingerprint=fingerprint or fenced.source_fingerprint,
        source_definition=definition if fingerprint else fenced.source_definition,
    )
    return out.with_journal_entry(entry, journal_limit)


def reset(
    doc: StateDocument,
    *,
    position: Position | None,
    fingerprint: str | None = None,
    definition: Mapping[str, Any] | None = None,
    journal_limit: int = JOURNAL_LIMIT,
    **who: Unpack[Manual],
) -> StateDocument:
    """Set the checkpoint to ``position``; ``None`` starts over from the beginning.

    The failure record is cleared: whatever batch was failing, it is no longer
    the batch after the new checkpoint. ``fingerprint`` (with its readable
    ``definition``) also accepts a new source definition (see :func:`accept_source`).
    """
    details = _fingerprint_details(doc, fingerprint, who.get("details"))
    return _apply(
        doc,
        "reset",
        position,
        who,
        journal_limit,
        details=details,
        fingerprint=fingerprint,
        definition=definition,
    )


def rewind(
    doc: StateDocument,
    *,
    position: Position | None,
    operation: str = "rewind",
    journal_limit: int = JOURNAL_LIMIT,
    **who: Unpack[Manual],
) -> StateDocument:
    """Move the checkpoint back to ``position`` (``dbtrigger rewind``, ``bookmark
    restore``): a reset by another name, so the journal says which it was."""
    return _apply(doc, operation, position, who, journal_limit)


def _fingerprint_details(
    doc: StateDocument, fingerprint: str | None, details: Mapping[str, Any] | None
) -> dict[str, Any]:
    out = dict(details or {})
    if fingerprint is not None and fingerprint != doc.source_fingerprint:
        out["fingerprint_before"] = doc.source_fingerprint
        out["fingerprint_after"] = fingerprint
    return out


def accept_source(
    doc: StateDocument,
    *,
    fingerprint: str,
    definition: Mapping[str, Any] | None = None,
    journal_limit: int = JOURNAL_LIMIT,
    **who: Unpack[Manual],
) -> StateDocument:
    """Adopt a changed source definition, keeping the checkpoint where it is.

    What to run after a deliberate change of the source (a new filter, another
    table name, a moved database) when the position still means the same rows.
    The failure record is cleared: a failing batch of the old definition is not
    a batch of the new one. Fenced and journaled like every manual change, with
    the old and new fingerprints; ``definition`` (the new one, readable) is
    recorded with the new fingerprint.

    Raises:
        ConfigurationError: the fingerprint is already the stored one, or the new
            definition has other key columns than the checkpoint names.
    """
    if fingerprint == doc.source_fingerprint:
        raise ConfigurationError(
            f"poller {doc.poller_name!r} already has this source definition "
            f"({fingerprint}); there is nothing to accept"
        )
    _check_key_fits(doc, definition or {})
    details = _fingerprint_details(doc, fingerprint, who.get("details"))
    return _apply(
        doc,
        "accept_source",
        current_position(doc),
        who,
        journal_limit,
        details=details,
        fingerprint=fingerprint,
        definition=definition,
    )


def restore(
    doc: StateDocument,
    backup: StateDocument,
    *,
    journal_limit: int = JOURNAL_LIMIT,
    **who: Unpack[Manual],
) -> StateDocument:
    """Take the checkpoint (and source fingerprint) from a backup of this poller.

    The current journal is kept (the backup's is older), and the lease is
    fenced like any other manual change.

    Raises:
        ConfigurationError: the backup belongs to another poller (use clone).
    """
    if backup.poller_name != doc.poller_name:
        raise ConfigurationError(
            f"the backup is of poller {backup.poller_name!r}, not {doc.poller_name!r}; "
            "restore it under its own name, then `clone` it"
        )
    return _apply(
        doc,
        "restore",
        current_position(backup),
        who,
        journal_limit,
        fingerprint=backup.source_fingerprint,
        definition=backup.source_definition,
    )


def skip_batch(
    doc: StateDocument,
    *,
    position: Position,
    skipped_rows: int | None = None,
    skipped_keys: list[dict[str, Any]] | None = None,
    journal_limit: int = JOURNAL_LIMIT,
    **who: Unpack[Manual],
) -> StateDocument:
    """Advance past a batch that will never succeed. This is deliberate data loss.

    The journal entry names what was skipped (the failing batch id, its
    attempts and error, how many rows and which keys) so the loss is on record.
    """
    details = dict(who.get("details") or {})
    if doc.failure is not None:
        details["failed_batch_id"] = doc.failure.batch_id
        details["failed_attempts"] = doc.failure.attempts
        details["last_error"] = doc.failure.last_error
    if skipped_rows is not None:
        details["skipped_rows"] = skipped_rows
    if skipped_keys is not None:
        details["skipped_keys"] = skipped_keys
    return _apply(doc, "skip_batch", position, who, journal_limit, details=details)


def release_lease(
    doc: StateDocument, *, journal_limit: int = JOURNAL_LIMIT, **who: Unpack[Manual]
) -> StateDocument:
    """Free the lease now (fencing out its holder); the checkpoint is unchanged.

    Useful after a crashed instance left a long-TTL lease behind.

    Raises:
        ConfigurationError: there is no unreleased lease to release.
    """
    if doc.lease is None or doc.lease.released:
        raise ConfigurationError(f"poller {doc.poller_name!r} holds no lease; nothing to release")
    fenced, entry = _fence_and_journal(
        doc,
        "release_lease",
        who,
        after=current_position(doc),
        lease_operation="release-lease",
    )
    return fenced.with_journal_entry(entry, journal_limit)


def clone(
    doc: StateDocument,
    *,
    new_poller: str,
    now: dt.datetime,
    actor: str,
    reason: str,
    journal_limit: int = JOURNAL_LIMIT,
) -> StateDocument:
    """A new poller's document starting at ``doc``'s checkpoint.

    The copy has no lease, no failure record and a journal of one entry that
    names where it came from; the source document is not changed, so no lease
    check applies to it.
    """
    validate_name(new_poller, "poller name")
    if new_poller == doc.poller_name:
        raise ConfigurationError("clone needs a different poller name")
    position = current_position(doc)
    entry = manual_entry(
        "clone",
        actor=actor,
        reason=reason,
        now=now,
        before=None,
        after=position,
        details={"cloned_from": doc.poller_name},
    )
    checkpoint = replace(doc.checkpoint, updated_at=now) if doc.checkpoint is not None else None
    fresh = StateDocument(
        poller_name=new_poller,
        source_fingerprint=doc.source_fingerprint,
        checkpoint=checkpoint,
        extra=doc.extra,
        window=doc.window,  # same checkpoint: its settled/pending events still apply
        source_definition=doc.source_definition,
    )
    return fresh.with_journal_entry(entry, journal_limit)


def create(
    poller: str,
    *,
    fingerprint: str,
    position: Position | None,
    now: dt.datetime,
    actor: str,
    reason: str,
    operation: str = "create",
    details: Mapping[str, Any] | None = None,
    journal_limit: int = JOURNAL_LIMIT,
    definition: Mapping[str, Any] | None = None,
) -> StateDocument:
    """A new poller's document starting after ``position`` (None: the beginning).

    Used by backfills, which run under their own poller name from a chosen
    cursor; the first journal entry says who started it and why. ``definition``
    is the source's readable definition, recorded with the fingerprint.
    """
    validate_name(poller, "poller name")
    checkpoint = _manual_checkpoint(position, now)
    entry = manual_entry(
        operation,
        actor=actor,
        reason=reason,
        now=now,
        before=None,
        after=position,
        details=details,
    )
    fresh = StateDocument(
        poller_name=poller,
        source_fingerprint=fingerprint,
        checkpoint=checkpoint,
        source_definition=definition,
    )
    return fresh.with_journal_entry(entry, journal_limit)


def batch_position(doc: StateDocument, batch_id: str, *, redeliver: bool = False) -> Position:
    """Where the journal says ``batch_id`` ended (or began, to deliver it again).

    Raises:
        ConfigurationError: the batch is not in the (bounded) journal.
    """
    for entry in reversed(doc.journal):
        if entry.get("type") == journal.COMMIT and entry.get("batch_id") == batch_id:
            raw = entry.get("from") if redeliver else entry.get("to")
            if raw is None:
                return Position()
            return docmod.position_from_json(raw, f"journal[{batch_id}]")
    known = [str(e.get("batch_id")) for e in doc.journal if e.get("type") == journal.COMMIT]
    hint = f"; the journal holds {', '.join(known[-5:])}" if known else "; the journal is empty"
    raise ConfigurationError(f"batch {batch_id!r} is not in the journal{hint}")


__all__ = [
    "OPERATOR_PREFIX",
    "accept_source",
    "batch_position",
    "check_lease",
    "clone",
    "create",
    "current_position",
    "force_takeover",
    "live_lease",
    "manual_entry",
    "position_json",
    "release_lease",
    "reset",
    "restore",
    "rewind",
    "skip_batch",
]
