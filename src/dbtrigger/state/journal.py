"""The journal's one vocabulary: every kind of entry, and the functions that encode them.

The state document keeps the last ``journal_limit`` commits and manual
operations as JSON objects (``dbtrigger history`` prints them). The
runtime describes what it did with a :class:`JournalEntry`, an operator's
change (reset, skip, accept-source, regroup...) is :func:`manual`; only this
module knows the JSON shapes, so a field cannot be misspelt at one call site
and right at another, and the shapes are tested here, table by table. Readers
tell entries apart by :data:`COMMIT`, :data:`PARTIAL_COMMIT` and :data:`MANUAL`.

The encoded key order is part of the document's bytes (compact JSON, no key
sorting): it stays ``type, batch_id, from, to, rows, owner_id, fencing_token,
committed_at`` followed by the optional fields, as documents written by
earlier versions have it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError
from dbtrigger.state.document import format_time, position_to_json

#: An entry's ``type``: a batch committed whole, a failed batch's leading
#: settled rows committed with its failure record, an operator's change.
COMMIT: Final = "commit"
PARTIAL_COMMIT: Final = "partial_commit"
MANUAL: Final = "manual"

#: ``commit``: a batch committed whole. ``partial_commit``: a failed batch's
#: leading settled rows were committed with the failure record.
EntryType = Literal["commit", "partial_commit"]  # COMMIT, PARTIAL_COMMIT


@dataclass(frozen=True)
class Outcomes:
    """Per-event outcomes of one batch (``ctx.reject`` / ``ctx.retry``).

    ``failed`` counts events the handler asked to retry. Journaled only when a
    batch had a rejected or failed event (without it every row was accepted),
    or when it was fanned out to several subscribers.
    """

    accepted: int
    rejected: int = 0
    failed: int = 0
    #: Fan-out (``subscribers=``): each subscriber's own outcomes over the
    #: batch; journaled on every commit of a fan-out poller.
    subscribers: Mapping[str, Outcomes] = field(default_factory=dict)

    @property
    def mixed(self) -> bool:
        return bool(self.rejected or self.failed)

    def counts(self) -> dict[str, int]:
        return {"accepted": self.accepted, "rejected": self.rejected, "failed": self.failed}


@dataclass(frozen=True)
class JournalEntry:
    """One checkpoint move written by a tick.

    ``duration_ms`` (tick start to commit) is only known for whole commits;
    ``quarantined`` counts rows of the batch set aside into the sink (0 is not
    written, so the common entry stays short); ``outcomes`` the per-event
    outcomes, written when some event was rejected or retried.
    """

    type: EntryType
    batch_id: str
    before: Position
    after: Position
    rows: int
    owner_id: str
    fencing_token: int
    committed_at: dt.datetime
    duration_ms: float | None = None
    quarantined: int = 0
    outcomes: Outcomes | None = None

    @classmethod
    def commit(
        cls,
        *,
        batch_id: str,
        before: Position,
        after: Position,
        rows: int,
        owner_id: str,
        fencing_token: int,
        now: dt.datetime,
        started_at: dt.datetime,
        quarantined: int = 0,
        outcomes: Outcomes | None = None,
    ) -> JournalEntry:
        """A whole batch committed; its duration is measured from ``started_at``."""
        return cls(
            type=COMMIT,
            batch_id=batch_id,
            before=before,
            after=after,
            rows=rows,
            owner_id=owner_id,
            fencing_token=fencing_token,
            committed_at=now,
            duration_ms=round((now - started_at).total_seconds() * 1000, 3),
            quarantined=quarantined,
            outcomes=outcomes,
        )


def encode(entry: JournalEntry) -> dict[str, object]:
    """The JSON object stored in the document's ``journal`` list."""
    out: dict[str, object] = {
        "type": entry.type,
        "batch_id": entry.batch_id,
        "from": position_to_json(entry.before),
        "to": position_to_json(entry.after),
        "rows": entry.rows,
        "owner_id": entry.owner_id,
        "fencing_token": entry.fencing_token,
        "committed_at": format_time(entry.committed_at),
    }
    if entry.duration_ms is not None:
        out["duration_ms"] = entry.duration_ms
    if entry.quarantined:
        out["quarantined"] = entry.quarantined
    outcomes = entry.outcomes
    if outcomes is not None and (outcomes.mixed or outcomes.subscribers):
        encoded: dict[str, object] = dict(outcomes.counts())
        if outcomes.subscribers:
            encoded["subscribers"] = {
                name: sub.counts() for name, sub in sorted(outcomes.subscribers.items())
            }
        out["outcomes"] = encoded
    return out


def position_json(position: Position | None) -> dict[str, Any] | None:
    """A position as journal JSON; ``None`` (and the beginning) stay ``None``."""
    if position is None or position.is_beginning:
        return None
    return position_to_json(position)


def manual(
    operation: str,
    *,
    actor: str,
    reason: str,
    now: dt.datetime,
    before: Position | None,
    after: Position | None,
    details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The journal entry of one manual operation (``details`` are appended).

    Raises:
        ConfigurationError: no reason or no actor: a manual change is always
            signed and explained.
    """
    if not reason or not reason.strip():
        raise ConfigurationError("a manual state change needs a reason (--reason)")
    if not actor or not actor.strip():
        raise ConfigurationError("a manual state change needs an actor")
    entry: dict[str, Any] = {
        "type": MANUAL,
        "operation": operation,
        "actor": actor,
        "reason": reason.strip(),
        "at": format_time(now),
        "before": position_json(before),
        "after": position_json(after),
    }
    entry.update(details or {})
    return entry
