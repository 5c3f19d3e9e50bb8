"""Changing the partition count of a running group without losing or repeating rows.

``dbtrigger partitions set --count N`` (and ``split`` / ``merge``) run this. It
never rehashes a row: the bucket space is fixed, so a new layout only splits
ranges or merges whole ranges (:func:`~dbtrigger.partitions.layout.regroup`).

The order makes every crash point safe:

1. **Lock the parents.** Each partition that goes away gets a live operator
   lease on its state document (fencing token + 1), so no member can process
   it while its checkpoint is copied. A member's tick already in flight is
   waited for (``wait``), or fenced out with ``force`` (its batch is then
   delivered again by the child: the only duplicates a regroup causes).
2. **Write the children** (unconditionally: an earlier, interrupted run may
   have left stale ones). A split child starts at its parent's checkpoint. A
   merged child starts at the lowest parent checkpoint and gets a *floor* per
   parent: rows of that parent's buckets at or below its checkpoint are
   skipped, compared in SQL with the source's own keyset order.
3. **Switch the layout**: one compare-and-swap of the membership document
   (generation + 1, ownership cleared: members claim the new partitions at
   their next balance cycle).
4. **Retire the parents.** Their documents stay, still under the operator
   lease, so a member that has not yet seen the new layout cannot tick them
   (members also compare the layout generation before every round of ticks).
   The next regroup deletes retired documents whose lease has long expired.
   A backup of every document changed is written first.

A crash before 3 leaves the old layout in force (parents unlock when the
operator lease expires); after 3 the children are complete.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import (
    CasConflictError,
    ConfigurationError,
    DbTriggerError,
    LiveLeaseError,
)
from dbtrigger.partitions import inherit, layout
from dbtrigger.partitions.layout import Floor, Membership, Partition
from dbtrigger.partitions.member import PartitionedPoller, membership_key, partition_poller
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.state import document as docmod
from dbtrigger.state import fanout_set, journal
from dbtrigger.state import operations as ops
from dbtrigger.state.document import Checkpoint, Lease, StateDocument

#: How long the operator lease on a parent lives: it must outlast the regroup.
LOCK_SECONDS = 120


@dataclass
class RegroupPlan:
    """What a regroup does; filled in further when it is applied."""

    poller: str
    before: int
    after: int
    moves: list[tuple[Partition, tuple[Partition, ...]]]
    starts: dict[str, Position | None] = field(default_factory=dict)
    backups: dict[str, bytes] = field(default_factory=dict)

    def describe(self) -> list[str]:
        lines = [f"poller {self.poller}: {self.before} -> {self.after} partitions"]
        for child, parents in self.moves:
            kind = "split from" if len(parents) == 1 else "merged from"
            names = ", ".join(p.id for p in parents)
            start = self.starts.get(child.id)
            where = f", starts after {_show(start)}" if child.id in self.starts else ""
            lines.append(f"  {child.id}: {kind} {names}{where}")
        return lines


def _show(position: Position | None) -> str:
    if position is None or position.is_beginning:
        return "the beginning"
    keys = " ".join(f"{k}={v}" for k, v in position.pk.items())
    return f"cursor={position.cursor} {keys}".strip()


def plan(poller: PartitionedPoller, count: int) -> tuple[RegroupPlan, Membership, str | None]:
    doc, etag = poller.load_membership()
    regrouped = layout.regroup(doc.partitions, count)
    moves = []
    for child in regrouped.partitions:
        parents = regrouped.parents[child.id]
        if len(parents) == 1 and (parents[0].lo, parents[0].hi) == (child.lo, child.hi):
            continue
        moves.append((child, parents))
    return RegroupPlan(poller.name, len(doc.partitions), count, moves), doc, etag


def _comparable(position: Position) -> bool:
    """Values whose Python order is the database's (no collation can disagree)."""
    values = [position.cursor, *position.pk.values()]
    kinds = (int, float, decimal.Decimal, dt.datetime, dt.date)
    return all(isinstance(v, kinds) for v in values) and not any(
        isinstance(v, bool) for v in values
    )


def _start(parents: list[tuple[Partition, Position | None]]) -> Position | None:
    """Where a merged child starts: at or below every parent's checkpoint."""
    positions = [pos for _, pos in parents]
    if any(pos is None for pos in positions):
        return None  # some parent never committed: start from the beginning
    known = [pos for pos in positions if pos is not None]
    if all(_comparable(pos) for pos in known):
        return min(known, key=lambda p: (p.cursor, tuple(p.pk.values())))
    # Text keys or cursors: only the database knows their order (collations);
    # start from the beginning, the floors exclude what the parents delivered.
    return None


def _clip(floors: tuple[Floor, ...], child: Partition) -> tuple[Floor, ...]:
    out = []
    for floor in floors:
        lo, hi = max(floor.lo, child.lo), min(floor.hi, child.hi)
        if lo < hi:
            out.append(Floor(lo, hi, floor.position))
    return tuple(out)


def apply(
    poller: PartitionedPoller,
    count: int,
    *,
    actor: str,
    reason: str,
    force: bool = False,
    wait_seconds: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    now: Callable[[], dt.datetime] | None = None,
) -> RegroupPlan:
    """Regroup ``poller``'s partitions into ``count`` (see the module docstring)."""
    clock = now or poller.clock
    regroup_plan, doc, _ = plan(poller, count)
    if not regroup_plan.moves:
        return regroup_plan
    regroup_plan.backups[membership_key(poller.name)] = layout.dumps(doc)

    # 1. lock every parent that goes away
    parents = {p.id: p for _, group in regroup_plan.moves for p in group}
    positions: dict[str, Position | None] = {}
    locked: dict[str, str] = {}
    for pid in sorted(parents):
        positions[pid], locked[pid] = _lock(
            poller,
            parents[pid],
            actor=actor,
            force=force,
            wait=wait_seconds,
            sleep=sleep,
            clock=clock,
            backups=regroup_plan.backups,
        )

    # 2. the children
    at = clock()
    children: dict[str, Partition] = {}
    for child, group in regroup_plan.moves:
        floors: list[Floor] = []
        for parent in group:
            floors.extend(_clip(parent.floors, child))
        if len(group) == 1:
            start = positions[group[0].id]
        else:
            start = _start([(p, positions[p.id]) for p in group])
            for parent in group:
                pos = positions[parent.id]
                if pos is not None and pos != start:
                    floors.append(Floor(parent.lo, parent.hi, pos))
        full = Partition(child.lo, child.hi, tuple(floors))
        children[child.id] = full
        regroup_plan.starts[child.id] = start
        _write_child(poller, full, start, group, actor=actor, reason=reason, now=at)

    # 3. switch the layout (members heartbeat into the same document: retry the CAS)
    _switch(poller, doc.generation, children, regroup_plan, actor=actor, reason=reason, now=at)

    # 4. the parents stay locked (retired); older retired documents go
    _delete_retired(poller, keep={p.id for p in layout.even_ranges(count)} | set(locked), now=at)
    return regroup_plan


def _delete_retired(poller: PartitionedPoller, *, keep: set[str], now: dt.datetime) -> None:
    """Delete partition documents of earlier layouts whose operator lease expired."""
    prefix = f"{poller.name}."
    for key in poller.store.list_keys():
        # Exactly '<name>.pLLL-HHH': a group named 'orders.pay' shares the prefix
        # 'orders.p' (its membership document failed this loop as a corrupt state
        # document, its retired partitions were deleted as if they were ours).
        pid = key[len(prefix) :] if key.startswith(prefix) else ""
        if not layout.PARTITION_ID.fullmatch(pid) or pid in keep:
            continue
        stored = poller.store.read(key)
        if stored is None:
            continue
        lease = docmod.loads(stored.data).lease
        retired = (  # a regroup's lock, never released (a new child's lease is)
            lease is not None
            and lease.owner_id.startswith(ops.OPERATOR_PREFIX)
            and not lease.released
        )
        if retired and lease is not None and lease.expires_at < now:
            with contextlib.suppress(CasConflictError):
                poller.store.delete(key, if_match=stored.etag)


def _lock(
    poller: PartitionedPoller,
    parent: Partition,
    *,
    actor: str,
    force: bool,
    wait: float,
    sleep: Callable[[float], None],
    clock: Callable[[], dt.datetime],
    backups: dict[str, bytes],
) -> tuple[Position | None, str]:
    """Hold a live operator lease on one parent; its position and our etag.

    A parent that has no document yet (no member has ticked it) gets one that
    holds only the lock: otherwise a member could commit its first batch after
    we read "nothing delivered", and the children would deliver it again.
    """
    pid = parent.id
    key = partition_poller(poller.name, pid)
    deadline = time.monotonic() + wait
    while True:
        stored = poller.store.read(key)
        now = clock()
        if stored is None:
            fingerprint = PartitionSource(poller.source, parent, poller=poller.name).fingerprint()
            empty = StateDocument(poller_name=key, source_fingerprint=fingerprint)
            try:
                etag = poller.store.write(
                    key,
                    docmod.dumps(replace(empty, lease=_operator_lease(actor, 1, now))),
                    if_match=None,
                )
            except CasConflictError:
                continue  # a member created it meanwhile: lock that one
            return None, etag
        current = docmod.loads(stored.data)
        holder = ops.live_lease(current, now)
        if holder is not None and not holder.owner_id.startswith(ops.OPERATOR_PREFIX) and not force:
            if time.monotonic() < deadline:
                sleep(0.2)
                continue
            raise LiveLeaseError(
                f"partition {pid} of {poller.name!r} is being processed by {holder.owner_id} "
                f"(token {holder.fencing_token}); retry, or pass --force to fence it out "
                "(its batch in flight is then delivered again)",
                poller=key,
            )
        token = (current.lease.fencing_token if current.lease else 0) + 1
        lease = _operator_lease(actor, token, now)
        try:
            etag = poller.store.write(
                key, docmod.dumps(replace(current, lease=lease)), if_match=stored.etag
            )
        except CasConflictError:
            continue
        backups[key] = stored.data
        return current.position if current.checkpoint else None, etag


def _operator_lease(actor: str, token: int, now: dt.datetime) -> Lease:
    """The live lease that keeps members off a partition while it is regrouped."""
    return Lease(
        owner_id=f"{ops.OPERATOR_PREFIX}{actor}",
        fencing_token=token,
        acquired_at=now,
        heartbeat_at=now,
        expires_at=now + dt.timedelta(seconds=LOCK_SECONDS),
    )


def _write_child(
    poller: PartitionedPoller,
    child: Partition,
    start: Position | None,
    parents: tuple[Partition, ...],
    *,
    actor: str,
    reason: str,
    now: dt.datetime,
) -> None:
    key = partition_poller(poller.name, child.id)
    fingerprint = PartitionSource(poller.source, child, poller=poller.name).fingerprint()
    entry = ops.manual_entry(
        "split" if len(parents) == 1 else "merge",
        actor=actor,
        reason=reason,
        now=now,
        before=None,
        after=start,
        details={"from_partitions": [p.id for p in parents], "floors": len(child.floors)},
    )
    checkpoint = (
        Checkpoint(position=start, last_successful_batch_id=None, updated_at=now)
        if start is not None
        else None
    )
    parent_docs = [_read(poller, partition_poller(poller.name, p.id)) for p in parents]
    parents_read = [d for d in parent_docs if d is not None]
    held = inherit.window(child, parents_read, poller.source.pk_columns)
    while True:
        existing = poller.store.read(key)
        token = inherit.token([*parent_docs, _read_stored(existing.data if existing else None)])
        lease = None
        if token:  # a released lease carries it: the first owner takes token + 1
            lease = replace(_operator_lease(actor, token, now), expires_at=now, released=True)
        fresh = StateDocument(
            poller_name=key,
            source_fingerprint=fingerprint,
            checkpoint=checkpoint,
            lease=lease,
            window=held,
            failure=inherit.failure(start, parents_read),
        )
        fresh = fanout_set.recording(fresh, inherit.subscribers(parents_read))
        data = docmod.dumps(fresh.with_journal_entry(entry))
        try:
            poller.store.write(key, data, if_match=existing.etag if existing else None)
            return
        except CasConflictError:
            continue


def _read(poller: PartitionedPoller, key: str) -> StateDocument | None:
    stored = poller.store.read(key)
    return _read_stored(stored.data if stored else None)


def _read_stored(data: bytes | None) -> StateDocument | None:
    """A partition's document (None: none, or unreadable: it is replaced, its
    window and tokens are lost, as a reset from a backup would lose them)."""
    if data is None:
        return None
    try:
        return docmod.loads(data)
    except DbTriggerError:
        return None


def _switch(
    poller: PartitionedPoller,
    generation: int,
    children: dict[str, Partition],
    regroup_plan: RegroupPlan,
    *,
    actor: str,
    reason: str,
    now: dt.datetime,
) -> None:
    entry: dict[str, Any] = {
        "type": journal.MANUAL,
        "operation": "regroup",
        "actor": actor,
        "reason": reason,
        "at": docmod.format_time(now),
        "from": regroup_plan.before,
        "to": regroup_plan.after,
    }
    target = layout.even_ranges(regroup_plan.after)
    for _ in range(50):
        doc, etag = poller.load_membership()
        if doc.generation != generation:
            raise ConfigurationError(
                f"the partitions of {poller.name!r} were regrouped by someone else meanwhile "
                f"(generation {doc.generation}, expected {generation}); run the command again"
            )
        kept = {p.id: p for p in doc.partitions}
        partitions = tuple(children.get(p.id) or kept[p.id] for p in target)
        members = {name: replace(m, owns={}) for name, m in doc.members.items()}
        new = replace(
            doc,
            generation=generation + 1,
            partitions=partitions,
            members=members,
            journal=(*doc.journal, entry)[-20:],
        )
        try:
            poller.store.write(membership_key(poller.name), layout.dumps(new), if_match=etag)
            return
        except CasConflictError:
            continue
    raise ConfigurationError(
        f"could not switch the layout of {poller.name!r}: the membership document kept "
        "changing; run the command again (children are written, parents stay locked "
        f"for {LOCK_SECONDS}s)"
    )
