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
* A lease whose last heartbeat lies more than :data:`SKEW_MARGIN` in the
  caller's future was written by a clock running ahead. Its expiry is then not
  believed as written (an owner that died would lock the poller until its own
  clock time): the lease is taken to last its own span (``expires_at -
  heartbeat_at``) from when the caller first saw it unchanged (``first_seen``,
  which the runtime keeps per etag). A live owner heartbeats, which changes
  the etag and restarts that count, so it is never taken over.
* A lease whose holder the caller has proven dead (``holder_gone``: the
  process recorded in ``lease.process`` is of this host, boot and PID
  namespace and no longer runs, see :mod:`dbtrigger._process`) is free at
  once: nobody can heartbeat or commit under it any more, and the
  conditional write still lets only one taker win.
* Every acquisition increments the fencing token; commits, heartbeats and
  releases must present the token they acquired with.
* A commit by the current owner/token succeeds even after the lease expired:
  the etag proves nobody else wrote in between, so there is no reason to throw
  the work away (a slow handler with no competitor still makes progress).
"""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from dbtrigger._paste import pasteable
from dbtrigger.cursor import Position, canonical_json
from dbtrigger.durations import human_duration
from dbtrigger.errors import FingerprintMismatchError, LostLeaseError
from dbtrigger.redaction import redact
from dbtrigger.state import crashes
from dbtrigger.state.definition import definition_changes, show_changes
from dbtrigger.state.document import (
    DEFAULT_JOURNAL_LIMIT,
    Checkpoint,
    FailureRecord,
    Lease,
    StateDocument,
    evolve,
    format_time,
    known_definition,
)
from dbtrigger.state.fanout_set import recording
from dbtrigger.state.journal import JournalEntry, encode
from dbtrigger.state.window import Window

#: A journal entry as a typed value (what the runtime writes) or an already
#: encoded object (manual operations, tests).
Entry = JournalEntry | Mapping[str, object]


class _Keep:
    """Sentinel: leave the document's window as it is."""


KEEP = _Keep()

#: A new window for the document (None or empty: no window) or :data:`KEEP`.
WindowUpdate = Window | None | _Keep


def _encoded(window: Window | None) -> dict[str, object] | None:
    return window.to_json() if window is not None else None


def _with_window(doc: StateDocument, window: WindowUpdate) -> StateDocument:
    """``doc`` with ``window``; ``doc`` itself when that changes nothing it stores
    (entries, their order and the bound), so a tick that changes nothing
    rewrites nothing."""
    if isinstance(window, _Keep):
        return doc
    new = _encoded(window)
    if new == _encoded(doc.window):
        return doc
    return evolve(doc, window=window if new is not None else None)


def _journaled(doc: StateDocument, entry: Entry | None, limit: int) -> StateDocument:
    if entry is None:
        return doc
    encoded = encode(entry) if isinstance(entry, JournalEntry) else entry
    return doc.with_journal_entry(encoded, limit)


MAX_GRACE = dt.timedelta(seconds=5)

#: How far in our future a lease's heartbeat may lie before the writer's clock
#: is taken to run ahead (beyond ordinary skew between hosts).
SKEW_MARGIN = dt.timedelta(seconds=30)

#: Bounds of a failure record, so that recording a failure never fails for size.
MAX_ERROR_CHARS = 500
MAX_DONE_IDS = 1000


def grace_window(ttl: dt.timedelta) -> dt.timedelta:
    """Extra wait before taking over someone else's expired lease."""
    return min(ttl / 2, MAX_GRACE)


@dataclass(frozen=True)
class Acquired:
    """The lease can be taken: write ``document`` with the etag that was read."""

    document: StateDocument
    fencing_token: int
    #: The lease taken over that its holder neither released nor renewed (it
    #: died or hung mid-tick), when it was counted as a failed attempt
    #: (``decide_acquire(count_deaths=True)``, :mod:`dbtrigger.state.crashes`).
    abandoned: Lease | None = None
    #: The lease of a holder proven dead, taken over at once (before its expiry
    #: and grace window would have freed it).
    taken_early: Lease | None = None


@dataclass(frozen=True)
class Busy:
    """Someone else holds the lease; nothing should be written."""

    holder: str
    fencing_token: int
    free_at: dt.datetime
    reason: str
    #: How far ahead of ours the holder's clock seems, when it seems so at all.
    skew: dt.timedelta | None = None


#: What the fingerprint error prints when nothing names the poller's trigger.
SPEC_FILL_IN = "<module>:<trigger>"


def accept_source_command(poller: str, spec: str | None) -> str:
    """The ``dbtrigger reset --accept-source`` an operator pastes after a definition change.

    ``spec`` names the trigger as ``module:attribute`` (the store is taken from
    it, so no ``--store`` is needed). Without one the command carries the
    fill-in :data:`SPEC_FILL_IN` and says what to put there.
    """
    target = shlex.quote(spec or SPEC_FILL_IN)
    return pasteable(
        f"dbtrigger reset {shlex.quote(poller)} --accept-source {target} "
        "--reason 'source definition changed' --yes"
    )


def what_changed(doc: StateDocument, definition: Mapping[str, Any] | None) -> str:
    """The fields of the source definition that differ from the document's, in words."""
    stored = known_definition(doc)
    if stored is None or definition is None:
        return ""
    changes = definition_changes(stored, definition)
    return show_changes(changes) if changes else ""


def check_fingerprint(
    doc: StateDocument,
    fingerprint: str,
    *,
    spec: str | None = None,
    also: Collection[str] = (),
    definition: Mapping[str, Any] | None = None,
) -> None:
    """Refuse a document written for a different source definition.

    ``also`` lists older fingerprints of the same definition (an earlier
    fingerprint algorithm): a document carrying one of them is accepted as it
    is. The message names the command that accepts the new definition;
    ``spec`` (``module:trigger``) fills it in when the caller knows it.
    ``definition`` is the configured source's readable definition: with the
    document's own, the message says what changed (``port 5432 -> 5499``).
    Callers check first that the configured source can be read at all, so
    the command is never suggested for an endpoint that does not answer.
    """
    if doc.source_fingerprint != fingerprint and doc.source_fingerprint not in also:
        command = accept_source_command(doc.poller_name, spec)
        fill_in = (
            ""
            if spec
            else f", with {SPEC_FILL_IN} replaced by the module:attribute that imports this "
            "PollTrigger (e.g. myapp.pollers:orders), run where that module imports"
        )
        changed = what_changed(doc, definition)
        raise FingerprintMismatchError(
            f"poller {doc.poller_name!r}: the source definition changed since the checkpoint "
            f"was written (stored {doc.source_fingerprint}, configured {fingerprint}"
            f"{': ' + changed if changed else ''}). If the "
            f"checkpoint still means the same rows, accept the new definition with `{command}`"
            f"{fill_in} (without --yes it shows the change first; add --to-beginning to start "
            "over); otherwise use a new poller name",
            poller=doc.poller_name,
            stored_fingerprint=doc.source_fingerprint,
            configured_fingerprint=fingerprint,
        )


def new_document(
    poller: str, fingerprint: str, definition: Mapping[str, Any] | None = None
) -> StateDocument:
    return StateDocument(
        poller_name=poller, source_fingerprint=fingerprint, source_definition=definition
    )


def with_definition(
    doc: StateDocument, fingerprint: str, definition: Mapping[str, Any] | None
) -> StateDocument:
    """``doc`` recording ``definition`` when it is of that very fingerprint and does not yet.

    Documents written before the definition was recorded (or by a source that
    could not describe itself) get it with their next acquisition that is
    written (a tick with work; an idle tick writes nothing), a write that
    happens anyway; a document whose definition is current is returned as is.
    """
    if definition is None or doc.source_fingerprint != fingerprint:
        return doc
    current = doc.source_definition
    if current is not None and canonical_json(dict(current)) == canonical_json(dict(definition)):
        return doc
    return replace(doc, source_definition=definition)


def decide_acquire(
    doc: StateDocument | None,
    *,
    poller: str,
    fingerprint: str,
    owner: str,
    now: dt.datetime,
    ttl: dt.timedelta,
    first_seen: dt.datetime | None = None,
    definition: Mapping[str, Any] | None = None,
    subscribers: Collection[str] | None = None,
    count_deaths: bool = False,
    holder_gone: bool = False,
    process: Mapping[str, Any] | None = None,
) -> Acquired | Busy:
    """Take the lease, or say who holds it until when.

    With ``count_deaths`` (a poller's tick), a lease taken over that its holder
    neither released nor renewed counts as a failed attempt of the batch at the
    checkpoint, in the document written to take it (:mod:`dbtrigger.state.crashes`).

    ``definition`` (the source's readable definition) is recorded in the
    acquired document when it is of ``fingerprint`` (see :func:`with_definition`),
    and so are a fan-out poller's ``subscribers`` (:mod:`dbtrigger.state.fanout_set`).

    ``first_seen`` is when the caller first read this lease unchanged (same
    etag); it only matters for a lease written by a clock running ahead (see
    the module rules). Without it such a lease counts from ``now``.

    ``holder_gone``: the caller proved that the process holding ``doc``'s lease
    no longer runs (:func:`dbtrigger._process.gone`), so its lease is taken at
    once, expired or not. ``process`` is the caller's own record (without the
    token, which is added here), stored in the new lease so that the next
    taker can tell the same of it; None stores none.
    """
    base = doc if doc is not None else new_document(poller, fingerprint, definition)
    lease = base.lease
    early = None
    if lease is not None and not lease.released:
        expires_at, skew = believed_expiry(lease, now, first_seen)
        free_at = expires_at if lease.owner_id == owner else expires_at + grace_window(ttl)
        if holder_gone:
            early = lease if now < free_at else None  # (else free anyway)
        elif now < expires_at:
            reason = "lease is live" if skew is None else "lease is live (holder's clock ahead)"
            return Busy(lease.owner_id, lease.fencing_token, expires_at, reason, skew)
        elif now < free_at:
            return Busy(lease.owner_id, lease.fencing_token, free_at, "lease in grace window", skew)
    token = (lease.fencing_token if lease is not None else 0) + 1
    new_lease = Lease(
        owner_id=owner,
        fencing_token=token,
        acquired_at=now,
        heartbeat_at=now,
        expires_at=now + ttl,
        process={**process, "fencing_token": token} if process is not None else None,
        extra=lease.extra if lease is not None else {},
    )
    base = recording(with_definition(base, fingerprint, definition), subscribers)
    dead = crashes.abandoned(base) if count_deaths else None
    if dead is not None:
        base = crashes.count_death(base, dead, now, early=early is not None)
    return Acquired(replace(base, lease=new_lease), token, dead, early)


def believed_expiry(
    lease: Lease, now: dt.datetime, first_seen: dt.datetime | None = None
) -> tuple[dt.datetime, dt.timedelta | None]:
    """When ``lease`` is taken to expire, and the holder's clock lead if it has one.

    An honest holder writes ``heartbeat_at`` from its own clock, so it is never
    far in our future. When it is (more than :data:`SKEW_MARGIN`), the stored
    expiry is capped at the lease's own span counted from ``first_seen``.
    """
    lead = lease.heartbeat_at - now
    if lead <= SKEW_MARGIN:
        return lease.expires_at, None
    span = max(lease.expires_at - lease.heartbeat_at, dt.timedelta(0))
    start = min(first_seen, now) if first_seen is not None else now
    return min(lease.expires_at, start + span), lead


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


def _committed(
    doc: StateDocument, position: Position, batch_id: str | None, now: dt.datetime, row_count: int
) -> Checkpoint:
    """The checkpoint a batch's commit leaves (fields a newer dbtrigger stored in
    the one it replaces are carried over, as every write does)."""
    return Checkpoint(
        position=position,
        last_successful_batch_id=batch_id,
        updated_at=now,
        row_count=row_count,
        extra=doc.checkpoint.extra if doc.checkpoint is not None else {},
    )


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
    journal_entry: Entry | None = None,
    journal_limit: int = DEFAULT_JOURNAL_LIMIT,
    window: WindowUpdate = KEEP,
) -> StateDocument:
    """Advance the checkpoint, renew (or release) the lease, clear any failure record.

    ``window`` replaces the per-event window (:mod:`dbtrigger.state.window`)
    when given; the checkpoint is then its contiguous settled prefix.

    Raises:
        LostLeaseError: the document's lease is not ``owner``/``token`` any more.
    """
    lease = _require_holder(doc, owner, token, "commit")
    new_lease = evolve(
        lease,
        heartbeat_at=now,
        expires_at=now if release else now + ttl,
        released=release,
    )
    checkpoint = _committed(doc, position, batch_id, now, row_count)
    out = evolve(doc, checkpoint=checkpoint, lease=new_lease, failure=None)
    return _journaled(_with_window(out, window), journal_entry, journal_limit)


def decide_heartbeat(
    doc: StateDocument, *, owner: str, token: int, now: dt.datetime, ttl: dt.timedelta
) -> StateDocument:
    lease = _require_holder(doc, owner, token, "heartbeat")
    return replace(doc, lease=replace(lease, heartbeat_at=now, expires_at=now + ttl))


def decide_probe(
    doc: StateDocument,
    *,
    owner: str,
    token: int,
    now: dt.datetime,
    ttl: dt.timedelta,
    event_id: str | None,
    done: tuple[str, ...],
) -> StateDocument:
    """Renew the lease and record that row ``event_id`` of a batch that killed its
    process is about to be handed over alone (:func:`crashes.probing`): written
    before the call, so that the next owner knows the row if this process dies
    (None: no row is handed over now, the last one passed).

    Raises:
        LostLeaseError: the document's lease is not ``owner``/``token`` any more.
    """
    lease = _require_holder(doc, owner, token, "isolation step")
    renewed = replace(lease, heartbeat_at=now, expires_at=now + ttl)
    return crashes.probing(replace(doc, lease=renewed), now=now, event_id=event_id, done=done)


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
    journal_entry: Entry | None = None,
    journal_limit: int = DEFAULT_JOURNAL_LIMIT,
    batch_end: Position | None = None,
    batch_rows: int | None = None,
    batch_digest: str | None = None,
    window: WindowUpdate = KEEP,
) -> StateDocument:
    """Record a failed attempt at the batch after the checkpoint and release the lease.

    One write does both, so a failing tick costs exactly what a clean release
    would, and every instance sees the same attempt count.

    A partly failed batch may also move the checkpoint: ``advance_to`` is the
    end of the batch's leading run of rows that were processed, and the
    failure record then starts over (attempt 1) at that position, since the
    failing row now heads a new batch. ``done`` names rows after the failed one
    that were processed and must be skipped when the batch is delivered again;
    at most :data:`MAX_DONE_IDS` are kept (the rest come again: duplicates, never
    a loss), so a huge batch cannot make the record too large to store.
    ``batch_end``/``batch_rows``/``batch_digest`` are the failing batch's last
    row, row count and :func:`~dbtrigger.state.document.digest_event_ids`
    (counted from the record's starting position): what ``skip-batch`` skips,
    and how it checks that the source still holds exactly those rows.
    """
    lease = _require_holder(doc, owner, token, "failure record")
    base = doc
    if advance_to is not None and advance_to != doc.position:
        base = replace(doc, checkpoint=_committed(doc, advance_to, batch_id, now, row_count))
        previous = None
    else:
        previous = failure_at(doc, doc.position)
    failure = FailureRecord(
        attempts=(previous.attempts if previous else 0) + 1,
        first_failed_at=previous.first_failed_at if previous else now,
        last_failed_at=now,
        # Handler exception text may quote a connection string or a token.
        last_error=redact(error[: 4 * MAX_ERROR_CHARS])[:MAX_ERROR_CHARS],
        batch_id=batch_id,
        from_position=base.position,
        done=tuple(done)[:MAX_DONE_IDS],
        done_total=len(done),
        batch_end=batch_end,
        batch_rows=batch_rows,
        batch_digest=batch_digest,
        extra=previous.extra if previous else {},
    )
    released = replace(lease, expires_at=now, heartbeat_at=now, released=True)
    out = _with_window(replace(base, lease=released, failure=failure), window)
    return _journaled(out, journal_entry if base is not doc else None, journal_limit)


def lease_state(lease: Lease, now: dt.datetime) -> tuple[str, float]:
    """``(state, seconds since the holder last wrote it)``; state is ``released``,
    ``expired``, ``live`` or ``not_renewed``.

    A holder renews at least every ``heartbeat_interval_seconds``, which must be
    below half the TTL (and every commit renews too), so a lease not renewed for
    half its TTL has missed a renewal: its holder was killed, hangs, or lost the
    store. It still blocks every other instance until it expires, which is what
    an operator on call needs to see instead of ``live``.
    """
    age = max((now - lease.heartbeat_at).total_seconds(), 0.0)
    if lease.released:
        return "released", age
    if now >= lease.expires_at:
        return "expired", age
    ttl = (lease.expires_at - lease.heartbeat_at).total_seconds()
    return ("not_renewed" if age > ttl / 2 else "live"), age


def describe_lease(lease: Lease | None, now: dt.datetime) -> str:
    if lease is None:
        return "no lease"
    if lease.released:
        return f"released by {lease.owner_id} (token {lease.fencing_token})"
    state, age = lease_state(lease, now)
    if state == "not_renewed":
        return (
            f"NOT RENEWED for {human_duration(age)}, held by {lease.owner_id} (token "
            f"{lease.fencing_token}): its holder may be gone; another instance takes it "
            f"over after {format_time(lease.expires_at)}"
        )
    renewed = f", renewed {human_duration(age)} ago" if state == "live" else ""
    return (
        f"{state}, held by {lease.owner_id} (token {lease.fencing_token}) "
        f"until {format_time(lease.expires_at)}{renewed}"
    )
