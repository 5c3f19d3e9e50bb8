"""Lease and checkpoint transitions as pure functions of (document, now, owner).

Nothing here performs I/O or reads a clock: each function takes the document as
read, the time and the caller's identity, and returns either the document to
write (with the caller's etag) or a refusal. The runtime does the reads and
conditional writes; a lost compare-and-swap simply means "decide again on what
is there now".

Rules (checkpoint/lease spec, sections 6-8):

* A live lease (``now < expires_at``) is never taken over, not even by its own
  owner: two overlapping ticks in one process must not both run.
* A *released* lease is free for anyone at once.
* An *expired* lease is free for its own owner at once, and for anyone else
  only after a grace window of ``min(ttl / 2, 5 s)``, which absorbs clock skew
  between instances.
* Every acquisition increments the fencing token; commits, heartbeats and
  releases must present the token they acquired with.
* A commit by the current owner/token succeeds even after the lease expired:
  the etag proves nobody else wrote in between, so there is no reason to throw
  the work away (a slow handler with no competitor still makes progress).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace

from dbtrigger.cursor import Position
from dbtrigger.errors import FingerprintMismatchError, LostLeaseError
from dbtrigger.state.document import Checkpoint, FailureRecord, Lease, StateDocument, format_time

MAX_GRACE = dt.timedelta(seconds=5)


def grace_window(ttl: dt.timedelta) -> dt.timedelta:
    """Extra wait before taking over someone else's expired lease."""
    return min(ttl / 2, MAX_GRACE)


@dataclass(frozen=True)
class Acquired:
    """The lease can be taken: write ``document`` with the etag that was read."""

    document: StateDocument
    fencing_token: int


@dataclass(frozen=True)
class Busy:
    """Someone else holds the lease; nothing should be written."""

    holder: str
    fencing_token: int
    free_at: dt.datetime
    reason: str


def check_fingerprint(doc: StateDocument, fingerprint: str) -> None:
    """Refuse a document written for a different source definition."""
    if doc.source_fingerprint != fingerprint:
        raise FingerprintMismatchError(
            f"poller {doc.poller_name!r}: the source definition changed since the checkpoint "
            f"was written (stored {doc.source_fingerprint}, configured {fingerprint}); "
            "use a new poller name, or `dbtrigger reset` to start this one over",
            poller=doc.poller_name,
            stored_fingerprint=doc.source_fingerprint,
            configured_fingerprint=fingerprint,
        )


def new_document(poller: str, fingerprint: str) -> StateDocument:
    return StateDocument(poller_name=poller, source_fingerprint=fingerprint)


def decide_acquire(
    doc: StateDocument | None,
    *,
    poller: str,
    fingerprint: str,
    owner: str,
    now: dt.datetime,
    ttl: dt.timedelta,
) -> Acquired | Busy:
    base = doc if doc is not None else new_document(poller, fingerprint)
    lease = base.lease
    if lease is not None and not lease.released:
        if now < lease.expires_at:
            return Busy(lease.owner_id, lease.fencing_token, lease.expires_at, "lease is live")
        free_at = (
            lease.expires_at if lease.owner_id == owner else lease.expires_at + grace_window(ttl)
        )
        if now < free_at:
            return Busy(lease.owner_id, lease.fencing_token, free_at, "lease in grace window")
    token = (lease.fencing_token if lease is not None else 0) + 1
    new_lease = Lease(
        owner_id=owner,
        fencing_token=token,
        acquired_at=now,
        heartbeat_at=now,
        expires_at=now + ttl,
    )
    return Acquired(replace(base, lease=new_lease), token)


def _require_holder(doc: StateDocument, owner: str, token: int, action: str) -> Lease:
    lease = doc.lease
    if lease is None or lease.owner_id != owner or lease.fencing_token != token:
        holder = f"{lease.owner_id} (token {lease.fencing_token})" if lease else "nobody"
        raise LostLeaseError(
            f"{action} refused: lease is now held by {holder}, not {owner} (token {token})",
            poller=doc.poller_name,
            fencing_token=token,
        )
    if lease.released:
        raise LostLeaseError(
            f"{action} refused: the lease (token {token}) was already released",
            poller=doc.poller_name,
            fencing_token=token,
        )
    return lease


def decide_commit(
    doc: StateDocument,
    *,
    owner: str,
    token: int,
    position: Position,
    batch_id: str,
    row_count: int,
    now: dt.datetime,
    ttl: dt.timedelta,
    release: bool,
    journal_entry: dict[str, object] | None = None,
    journal_limit: int = 50,
) -> StateDocument:
    """Advance the checkpoint, renew (or release) the lease, clear any failure record.

    Raises:
        LostLeaseError: the document's lease is not ``owner``/``token`` any more.
    """
    lease = _require_holder(doc, owner, token, "commit")
    new_lease = replace(
        lease,
        heartbeat_at=now,
        expires_at=now if release else now + ttl,
        released=release,
    )
    checkpoint = Checkpoint(
        position=position,
        last_successful_batch_id=batch_id,
        updated_at=now,
        row_count=row_count,
    )
    out = replace(doc, checkpoint=checkpoint, lease=new_lease, failure=None)
    if journal_entry is not None:
        out = out.with_journal_entry(journal_entry, journal_limit)
    return out


def decide_heartbeat(
    doc: StateDocument, *, owner: str, token: int, now: dt.datetime, ttl: dt.timedelta
) -> StateDocument:
    lease = _require_holder(doc, owner, token, "heartbeat")
    return replace(doc, lease=replace(lease, heartbeat_at=now, expires_at=now + ttl))


def decide_release(
    doc: StateDocument, *, owner: str, token: int, now: dt.datetime
) -> StateDocument | None:
    """The document with our lease released, or None when it is no longer ours."""
    lease = doc.lease
    if lease is None or lease.owner_id != owner or lease.fencing_token != token or lease.released:
        return None
    return replace(doc, lease=replace(lease, expires_at=now, heartbeat_at=now, released=True))


def failure_at(doc: StateDocument | None, position: Position) -> FailureRecord | None:
    """The failure record that applies to the batch starting at ``position``.

    A record written for another starting position (the checkpoint was moved by
    hand since) is stale and ignored: its attempts and done rows belong to a
    different batch.
    """
    if doc is None or doc.failure is None:
        return None
    record = doc.failure
    if record.from_position is not None and record.from_position != position:
        return None
    return record


def decide_failure(
    doc: StateDocument,
    *,
    owner: str,
    token: int,
    now: dt.datetime,
    error: str,
    batch_id: str | None,
    advance_to: Position | None = None,
    row_count: int = 0,
    done: tuple[str, ...] = (),
    journal_entry: dict[str, object] | None = None,
    journal_limit: int = 50,
) -> StateDocument:
    """Record a failed attempt at the batch after the checkpoint and release the lease.

    One write does both, so a failing tick costs exactly what a clean release
    would, and every instance sees the same attempt count.

    A partly failed batch may also move the checkpoint: ``advance_to`` is the
    end of the batch's leading run of rows that were processed, and the
    failure record then starts over (attempt 1) at that position, since the
    failing row now heads a new batch. ``done`` names rows after the failed one
    that were processed and must be skipped when the batch is delivered again.
    """
    lease = _require_holder(doc, owner, token, "failure record")
    base = doc
    if advance_to is not None and advance_to != doc.position:
        base = replace(
            doc,
            checkpoint=Checkpoint(
                position=advance_to,
                last_successful_batch_id=batch_id,
                updated_at=now,
                row_count=row_count,
            ),
        )
        previous = None
    else:
        previous = failure_at(doc, doc.position)
    failure = FailureRecord(
        attempts=(previous.attempts if previous else 0) + 1,
        first_failed_at=previous.first_failed_at if previous else now,
        last_failed_at=now,
        last_error=error[:500],
        batch_id=batch_id,
        from_position=base.position,
        done=tuple(done),
    )
    released = replace(lease, expires_at=now, heartbeat_at=now, released=True)
    out = replace(base, lease=released, failure=failure)
    if journal_entry is not None and base is not doc:
        out = out.with_journal_entry(journal_entry, journal_limit)
    return out


def describe_lease(lease: Lease | None, now: dt.datetime) -> str:
    if lease is None:
        return "no lease"
    if lease.released:
        return f"released by {lease.owner_id} (token {lease.fencing_token})"
    state = "live" if now < lease.expires_at else "expired"
    return (
        f"{state}, held by {lease.owner_id} (token {lease.fencing_token}) "
        f"until {format_time(lease.expires_at)}"
    )
