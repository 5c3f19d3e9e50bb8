"""Dropping a merged partition's floors when an operator moves its checkpoint back.

A merge leaves *floors* in the layout: rows of each parent's buckets at or
below that parent's checkpoint are skipped. They describe the checkpoint
lineage the regroup started; once an operator resets, rewinds or restores the
partition's checkpoint, they would skip rows the operator asked to have
delivered again. ``dbtrigger reset|rewind|bookmark restore`` of a partition
drops them (in one compare-and-swap of the membership document) before
writing the partition's state; members read a floored partition's floors
again before every fetch until its checkpoint has passed them, so no fetch
after the reset uses them. Dropping floors can only cause repeats, never a loss.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from dbtrigger.errors import CasConflictError
from dbtrigger.partitions import layout
from dbtrigger.partitions.recovery import read_membership
from dbtrigger.state.stores.base import CheckpointStore

_PARTITION = re.compile(r"(?P<group>.+)\.(?P<pid>p\d{3}-\d{3})")


def drop_floors(store: CheckpointStore, state_key: str, entry: dict[str, Any]) -> int:
    """Remove the floors of the partition whose state document is ``state_key``.

    Returns how many floors were dropped (0: not a partition of a group's current
    layout, or it has none). ``entry`` is journaled in the membership document.
    """
    match = _PARTITION.fullmatch(state_key)
    if match is None:
        return 0
    key = f"{match['group']}.members"
    pid = match["pid"]
    while True:
        stored = store.read(key)
        doc = read_membership(store, match["group"], key, stored.data) if stored else None
        current = doc.partition(pid) if doc is not None else None
        if stored is None or doc is None or current is None or not current.floors:
            return 0
        partitions = tuple(replace(p, floors=()) if p.id == pid else p for p in doc.partitions)
        journaled = {**entry, "operation": "drop_floors", "partition": pid}
        new = replace(doc, partitions=partitions, journal=(*doc.journal, journaled)[-20:])
        try:
            store.write(key, layout.dumps(new), if_match=stored.etag)
        except CasConflictError:
            continue  # a member's balance cycle wrote meanwhile: read again
        return len(current.floors)
