"""What ``status`` and ``partitions show`` print about a partitioned poller: read-only.

Nothing here writes: the membership document and each partition's state
document are read through the store, and the rows pending are counted on the
source when asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dbtrigger.cursor import BEGINNING
from dbtrigger.partitions.layout import Membership
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.runtime.poller import PollTrigger


@dataclass(frozen=True)
class PartitionState:
    """One row of ``status``: a partition, its owner and how far behind it is."""

    id: str
    lo: int
    hi: int
    owner: str | None
    checkpoint: Any
    lag_rows: int | None


def partition_states(
    doc: Membership, triggers: Mapping[str, PollTrigger], *, lag: bool
) -> list[PartitionState]:
    """Every partition of ``doc`` with its owner, checkpoint and (``lag``) rows pending."""
    out = []
    for p in doc.partitions:
        trigger = triggers[p.id]
        state = trigger.read_state()
        position = state.position if state else None
        pending = None
        if lag:
            source = trigger.source
            assert isinstance(source, PartitionSource)  # noqa: S101 - built by the member
            pending = source.count_after(position if position is not None else BEGINNING)
        out.append(
            PartitionState(
                p.id,
                p.lo,
                p.hi,
                doc.owner_of(p.id),
                position.cursor if position else None,
                pending,
            )
        )
    return out
