"""Journal entries as typed values, and the one function that encodes them.

The state document keeps the last ``journal_limit`` commits and manual
operations as JSON objects (``dbtrigger state history`` prints them). The
runtime describes what it did with a :class:`JournalEntry`; only
:func:`encode` knows the JSON shape, so a field cannot be misspelt at one call
site and right at another, and the shape is tested here, table by table.

The encoded key order is part of the document's bytes (compact JSON, no key
sorting): it stays ``type, batch_id, from, to, rows, owner_id, fencing_token,
committed_at`` followed by the optional fields, as documents written by
earlier versions have it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dbtrigger.cursor import Position
from dbtrigger.state.document import format_time, position_to_json

#: ``commit``: a batch committed whole. ``partial_commit``: a failed batch's
#: leading settled rows were committed with the failure record.
EntryType = Literal["commit", "partial_commit"]


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
            type="commit",
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
