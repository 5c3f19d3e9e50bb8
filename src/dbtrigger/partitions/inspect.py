"""What ``status`` and ``partitions show`` print about a partitioned poller: read-only.

A group is two kinds of documents in the store: the membership document
(layout, members, who owns what) and one state document per partition
(checkpoint, lease, retries waiting). :func:`group_state` reads them all and,
when given the partitions' sources, counts the rows behind each checkpoint and
ages the oldest. Nothing here writes.

A member's last heartbeat age compares the time the member wrote (its own
clock) with the reader's clock: it is for people, and says so. Whether a
member is alive is never judged from it (see :mod:`dbtrigger.partitions.cadence`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.durations import human_duration
from dbtrigger.errors import CorruptStateError, DbTriggerError
from dbtrigger.health import measure_lag
from dbtrigger.partitions.layout import PARTITION_ID, Membership, shares
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.state import document as docmod
from dbtrigger.state.document import Lease
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.window import Window


def partition_key(poller: str, partition_id: str) -> str:
    """The state document of one partition: ``<poller>.<partition id>``."""
    return f"{poller}.{partition_id}"


@dataclass(frozen=True)
class LeaseView:
    """A partition's lease as ``status`` shows it."""

    state: str  # live, expired, released
    holder: str
    token: int
    expires_at: dt.datetime

    @classmethod
    def of(cls, lease: Lease | None, now: dt.datetime) -> LeaseView | None:
        if lease is None:
            return None
        state = "released" if lease.released else ("live" if now < lease.expires_at else "expired")
        return cls(state, lease.owner_id, lease.fencing_token, lease.expires_at)

    def describe(self) -> str:
        if self.state == "released":
            return f"released (t{self.token})"
        return f"{self.state} {self.holder} t{self.token}"


@dataclass(frozen=True)
class PartitionState:
    """One partition: its range, owner, checkpoint, lease, and how far behind it is.

    ``lag_rows`` and ``lag_seconds`` (the age of the oldest row behind the
    checkpoint) are None when not measured or not measurable; ``note`` says why.
    """

    id: str
    lo: int
    hi: int
    owner: str | None
    checkpoint: Any
    lag_rows: int | None
    position: Position | None = None
    lease: LeaseView | None = None
    lag_seconds: float | None = None
    pending_retries: int = 0
    failing_attempts: int = 0
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "buckets": [self.lo, self.hi],
            "owner": self.owner,
            "checkpoint": None if self.position is None else show_position(self.position),
            "lease": None
            if self.lease is None
            else {
                "state": self.lease.state,
                "holder": self.lease.holder,
                "fencing_token": self.lease.token,
                "expires_at": docmod.format_time(self.lease.expires_at),
            },
            "lag_rows": self.lag_rows,
            "lag_seconds": None if self.lag_seconds is None else round(self.lag_seconds, 3),
            "pending_retries": self.pending_retries,
            "failing_attempts": self.failing_attempts,
            **({"note": self.note} if self.note else {}),
        }


@dataclass(frozen=True)
class MemberState:
    """One member: who and where it is, when it last beat, what it owns and should own."""

    id: str
    host: str | None
    beat: int
    heartbeat_age_seconds: float | None
    partitions: tuple[str, ...]
    share: int

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.host,
            "beat": self.beat,
            "last_heartbeat_seconds_ago": None
            if self.heartbeat_age_seconds is None
            else round(self.heartbeat_age_seconds, 1),
            "partitions": list(self.partitions),
            "fair_share": self.share,
        }


@dataclass(frozen=True)
class GroupState:
    """A partitioned poller as the store holds it, at ``checked_at``."""

    poller: str
    generation: int
    checked_at: dt.datetime
    members: tuple[MemberState, ...]
    partitions: tuple[PartitionState, ...]
    retired: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "poller": self.poller,
            "partitioned": True,
            "generation": self.generation,
            "checked_at": docmod.format_time(self.checked_at),
            "members": [m.to_json() for m in self.members],
            "partitions": [p.to_json() for p in self.partitions],
            **({"retired_partitions": list(self.retired)} if self.retired else {}),
        }

    def render(self) -> list[str]:
        """The text ``status`` and ``partitions show`` print: members, then partitions."""
        lines = [
            f"partitioned poller {self.poller}: {len(self.partitions)} partitions, "
            f"{len(self.members)} member(s), generation {self.generation}"
        ]
        if self.members:
            rows = [["MEMBER", "HOST", "LAST HEARTBEAT", "OWNS", "SHARE"]]
            for m in self.members:
                age = m.heartbeat_age_seconds
                ago = "?" if age is None else f"{human_duration(age)} ago"
                rows.append([m.id, m.host or "-", ago, str(len(m.partitions)), str(m.share)])
            lines.extend("  " + line for line in table(rows))
            lines.append("  (heartbeat ages compare the member's clock with this one's)")
        else:
            lines.append("  no members: nobody is processing these partitions")
        rows = [["PARTITION", "OWNER", "LEASE", "CHECKPOINT", "LAG", "OLDEST", "RETRIES"]]
        for p in self.partitions:
            rows.append(
                [
                    p.id,
                    p.owner or "(unowned)",
                    p.lease.describe() if p.lease else "-",
                    "(beginning)" if p.position is None else show_position(p.position),
                    "-" if p.lag_rows is None else str(p.lag_rows),
                    "-" if p.lag_seconds is None else human_duration(p.lag_seconds),
                    str(p.pending_retries)
                    + (f", failing x{p.failing_attempts}" if p.failing_attempts else ""),
                ]
            )
        lines.extend("  " + line for line in table(rows))
        if self.retired:
            lines.append(
                f"  retired by a regroup (locked; the next one deletes them): "
                f"{', '.join(self.retired)}"
            )
        return lines


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def show_position(position: Position) -> str:
    """``1046 id=17``, or ``(beginning)``."""
    if position.is_beginning:
        return "(beginning)"
    return " ".join([str(position.cursor), *(f"{k}={v}" for k, v in position.pk.items())])


def group_state(
    store: CheckpointStore,
    doc: Membership,
    *,
    now: dt.datetime,
    sources: Mapping[str, PartitionSource] | None = None,
) -> GroupState:
    """Read every partition's state document of ``doc``'s layout, and measure the lag
    of those ``sources`` has (partition id -> its source)."""
    partitions = tuple(
        _partition(store, doc, p.id, p.lo, p.hi, now, (sources or {}).get(p.id))
        for p in doc.partitions
    )
    fair = shares(doc.members, doc.partitions)
    members = tuple(
        MemberState(
            id=name,
            host=m.host,
            beat=m.beat,
            heartbeat_age_seconds=None
            if m.seen_at is None
            else max(0.0, (now - m.seen_at).total_seconds()),
            partitions=tuple(sorted(m.owns)),
            share=fair.get(name, 0),
        )
        for name, m in sorted(doc.members.items())
    )
    current = {partition_key(doc.poller, p.id) for p in doc.partitions}
    prefix = f"{doc.poller}."
    retired = tuple(  # exactly '<poller>.pLLL-HHH': not a group named '<poller>.pay'
        sorted(
            key[len(prefix) :]
            for key in store.list_keys()
            if key.startswith(prefix)
            and PARTITION_ID.fullmatch(key[len(prefix) :])
            and key not in current
        )
    )
    return GroupState(doc.poller, doc.generation, now, members, partitions, retired)


def _partition(
    store: CheckpointStore,
    doc: Membership,
    pid: str,
    lo: int,
    hi: int,
    now: dt.datetime,
    source: PartitionSource | None,
) -> PartitionState:
    owner = doc.owner_of(pid)
    try:
        stored = store.read(partition_key(doc.poller, pid))
        state = docmod.loads(stored.data) if stored is not None else None
        window = (state.window if state is not None else None) or Window()
    except CorruptStateError as exc:
        return PartitionState(pid, lo, hi, owner, None, None, note=f"{type(exc).__name__}: {exc}")
    position = state.checkpoint.position if state is not None and state.checkpoint else None
    rows: int | None = None
    seconds: float | None = None
    note = ""
    if source is not None:
        try:
            lag = measure_lag(source, position or Position(), now, poller=doc.poller)
            rows, seconds, note = lag.rows, lag.seconds, lag.note
        except DbTriggerError as exc:
            note = f"lag unknown: {type(exc).__name__}: {exc}"
    return PartitionState(
        id=pid,
        lo=lo,
        hi=hi,
        owner=owner,
        checkpoint=position.cursor if position is not None else None,
        lag_rows=rows,
        position=position,
        lease=LeaseView.of(state.lease if state is not None else None, now),
        lag_seconds=seconds,
        pending_retries=len(window.pending),
        failing_attempts=state.failure.attempts if state is not None and state.failure else 0,
        note=note,
    )
