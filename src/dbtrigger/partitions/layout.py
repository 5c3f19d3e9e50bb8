"""The membership document: partition layout, members and who owns what.

One JSON document per partitioned poller (key ``<name>.members``) holds

* the **layout**: the partitions as contiguous bucket ranges over the fixed
  space of :data:`~dbtrigger.partitions.buckets.BUCKETS`, a generation number
  bumped by every split or merge, and the base source fingerprint;
* the **members**: each live worker's heartbeat counter and the partitions it
  owns (with the heartbeat at which it took each one).

Every change is a compare-and-swap of this one document, so two members can
never both claim a partition. Ownership only spreads the work: each partition
still has its own state document whose per-tick lease and fencing token make
processing exclusive, so a member acting on a stale view of ownership costs a
skipped tick, never a duplicate or a lost row.

Liveness is judged without comparing clocks: a member's ``beat`` counter goes
up by one every balance cycle, and an observer declares it dead when the
counter has not moved for ``member_ttl`` *on the observer's own monotonic
clock*. A stored wall-clock time is kept only for people reading ``status``.

Everything here is pure: (document, observations, me) -> decision.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, CorruptStateError
from dbtrigger.partitions.buckets import BUCKETS
from dbtrigger.state.document import format_time, parse_time, position_from_json, position_to_json

KIND = "dbtrigger-membership"

#: A partition id (:attr:`Partition.id`), as the suffix of its state document's key
#: (``orders.p000-064``): matched whole, never as a prefix (a group may be named
#: ``orders.pay``).
PARTITION_ID = re.compile(r"p\d{3,}-\d{3,}")
VERSION = 1


@dataclass(frozen=True)
class Floor:
    """Rows of buckets ``[lo, hi)`` at or below ``position`` were delivered already.

    Left by a merge: the merged partition starts from the lowest parent
    checkpoint and skips what each parent had passed in its own range.
    """

    lo: int
    hi: int
    position: Position


@dataclass(frozen=True)
class Partition:
    lo: int
    hi: int
    floors: tuple[Floor, ...] = ()

    @property
    def id(self) -> str:
        """``p000-032``: names the state document ``<poller>.p000-032``."""
        return f"p{self.lo:03d}-{self.hi:03d}"


@dataclass(frozen=True)
class Member:
    """One member's entry: its heartbeat counter and what it owns.

    ``seen_at`` (the member's own clock) and ``host`` are for people reading
    ``status``; liveness is judged from ``beat`` alone.
    """

    beat: int
    owns: Mapping[str, int] = field(default_factory=dict)  # partition id -> beat when taken
    seen_at: dt.datetime | None = None
    host: str | None = None


@dataclass(frozen=True)
class Membership:
    poller: str
    fingerprint: str
    generation: int
    partitions: tuple[Partition, ...]
    members: Mapping[str, Member] = field(default_factory=dict)
    journal: tuple[Mapping[str, Any], ...] = ()

    def owner_of(self, partition_id: str) -> str | None:
        for name, member in self.members.items():
            if partition_id in member.owns:
                return name
        return None

    def partition(self, partition_id: str) -> Partition | None:
        return next((p for p in self.partitions if p.id == partition_id), None)


# --- layouts -------------------------------------------------------------------------


def even_ranges(count: int) -> tuple[Partition, ...]:
    """``count`` contiguous ranges covering every bucket, as equal as integers allow."""
    if not 1 <= count <= BUCKETS:
        raise ConfigurationError(f"partitions must be between 1 and {BUCKETS}, got {count}")
    bounds = [round(i * BUCKETS / count) for i in range(count + 1)]
    return tuple(Partition(bounds[i], bounds[i + 1]) for i in range(count))


def new_membership(poller: str, fingerprint: str, count: int) -> Membership:
    return Membership(poller, fingerprint, 1, even_ranges(count))


@dataclass(frozen=True)
class Regroup:
    """How a new layout relates to the old one, partition by partition.

    ``parents[new_id]`` lists the old partitions a new partition takes its
    rows from: one (a split child, or unchanged) or several (a merge).
    """

    partitions: tuple[Partition, ...]
    parents: Mapping[str, tuple[Partition, ...]]


def regroup(current: Sequence[Partition], count: int) -> Regroup:
    """The layout with ``count`` partitions, if it only splits or merges ranges.

    Each new range must lie inside one old range (split) or be a union of
    whole old ranges (merge). A count that would need a row to change range
    otherwise is refused, with the counts that work.
    """
    target = even_ranges(count)
    old_bounds = {p.lo for p in current} | {BUCKETS}
    parents: dict[str, tuple[Partition, ...]] = {}
    for new in target:
        inside = [p for p in current if p.lo <= new.lo and new.hi <= p.hi]
        covered = [p for p in current if new.lo <= p.lo and p.hi <= new.hi]
        if inside:
            parents[new.id] = (inside[0],)
        elif covered and new.lo in old_bounds and new.hi in old_bounds:
            parents[new.id] = tuple(covered)
        else:
            workable = [
                n for n in range(1, BUCKETS + 1) if _regroups(current, n) and n != len(current)
            ]
            raise ConfigurationError(
                f"{count} partitions would move rows between ranges of the current "
                f"{len(current)}; counts that split or merge cleanly: "
                f"{', '.join(map(str, workable[:12]))}"
            )
    return Regroup(target, parents)


def suggested_count(current: Sequence[Partition], members: int) -> int:
    """The smallest count of at least ``members`` partitions the current layout
    splits into without moving a row (what ``partitions set --count`` accepts)."""
    workable = [n for n in range(max(members, 1), BUCKETS + 1) if _regroups(current, n)]
    return workable[0] if workable else BUCKETS


def _regroups(current: Sequence[Partition], count: int) -> bool:
    old_bounds = {p.lo for p in current} | {BUCKETS}
    new_bounds = {p.lo for p in even_ranges(count)} | {BUCKETS}
    return new_bounds <= old_bounds or old_bounds <= new_bounds


# --- balancing -------------------------------------------------------------------------


def shares(members: Mapping[str, Member], partitions: Sequence[Partition]) -> dict[str, int]:
    """Each member's fair share, by rank: ``P // N`` each, one more for the first ``P % N``.

    Rank is by partitions held now (most first), then by name, so the extra
    partitions stay where they are instead of moving: with 4 partitions and 3
    members the shares are 2/1/1 (never 2/2/0, where ``ceil(P / N)`` for
    everyone lets two members sit at the target and starve the third), with 8
    and 3 they are 3/3/2. Every member computes the same shares from the same
    document (the write that follows is a compare-and-swap on it), so they
    agree without talking; only their views of who is alive may differ, and
    only until the member TTL has passed.
    """
    if not members:
        return {}
    valid = {p.id for p in partitions}
    held = {name: sum(1 for pid in m.owns if pid in valid) for name, m in members.items()}
    ranked = sorted(members, key=lambda name: (-held[name], name))
    base, extra = divmod(len(partitions), len(ranked))
    return {name: base + (1 if rank < extra else 0) for rank, name in enumerate(ranked)}


@dataclass(frozen=True)
class BalanceDecision:
    """What one member does this cycle. ``document`` is None when nothing changes.

    ``shares`` is every live member's fair share as this cycle computed it;
    ``settled`` is True when every member holds exactly its share and no
    partition is free: the group has converged and the member may slow down.
    """

    document: Membership | None
    owned: tuple[str, ...]
    claimed: tuple[str, ...] = ()
    stolen: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    shares: Mapping[str, int] = field(default_factory=dict)
    settled: bool = False

    @property
    def changed(self) -> bool:
        """This cycle moved ownership (claimed, stole, released or dropped a member)."""
        return bool(self.claimed or self.stolen or self.released or self.dead)


def balance(
    doc: Membership,
    *,
    me: str,
    live: frozenset[str],
    min_hold_beats: int,
    now: dt.datetime,
    leaving: bool = False,
    joining: bool = False,
    host: str | None = None,
) -> BalanceDecision:
    """One balance cycle of member ``me`` (always writes its own heartbeat).

    ``live`` is the set of other members this observer saw beating within the
    member TTL (``me`` is live by definition). Members not in it are removed,
    and their partitions become free. Then, with every member's share from
    :func:`shares`:

    * a member above its share releases the excess at once (the partitions it
      took last), so a member that sees a new heartbeat makes room in the same
      cycle instead of waiting for the newcomer to steal;
    * a member below its share claims free partitions up to it, all at once;
    * if none are free, it steals **one** partition per cycle from the member
      most above its own share, and only one that member has held for
      ``min_hold_beats`` of its own beats (no ping-pong).

    ``joining`` writes the heartbeat without claiming anything: a member that
    has just started waits a short join window so that members started
    together see each other before anyone takes a partition.
    """
    members = {name: m for name, m in doc.members.items() if name in live or name == me}
    dead = tuple(sorted(set(doc.members) - set(members)))
    mine = members.get(me, Member(beat=0))
    beat = mine.beat + 1
    owns = dict(mine.owns)
    if leaving:
        members.pop(me, None)
        return BalanceDecision(
            replace(doc, members=members), (), released=tuple(sorted(owns)), dead=dead
        )
    valid = {p.id for p in doc.partitions}
    released = [p for p in owns if p not in valid]  # the layout changed under us
    for p in released:
        owns.pop(p)
    others = {
        name: replace(m, owns={p: b for p, b in m.owns.items() if p in valid})
        for name, m in members.items()
        if name != me
    }
    fair = shares({**others, me: replace(mine, owns=owns)}, doc.partitions)
    share = fair[me]
    claimed: list[str] = []
    stolen: list[str] = []
    if not joining:
        owned_elsewhere = {p for m in others.values() for p in m.owns}
        for pid in (p.id for p in doc.partitions):
            if len(owns) >= share:
                break
            if pid not in owned_elsewhere and pid not in owns:
                owns[pid] = beat
                claimed.append(pid)
        if len(owns) < share:
            victim = _victim(others, fair, min_hold_beats)
            if victim is not None:
                name, pid = victim
                held = others[name]
                others[name] = replace(held, owns={k: v for k, v in held.owns.items() if k != pid})
                owns[pid] = beat
                stolen.append(pid)
    if len(owns) > share:
        # The partitions taken last go first: the older ones have warm state.
        for pid in sorted(owns, key=lambda k: (owns[k], k))[share:]:
            owns.pop(pid)
            released.append(pid)
    members = {**others, me: Member(beat=beat, owns=owns, seen_at=now, host=host or mine.host)}
    taken = [p for m in members.values() for p in m.owns]
    settled = (
        not joining
        and len(taken) == len(valid)
        and all(len(members[name].owns) == fair[name] for name in members)
    )
    return BalanceDecision(
        replace(doc, members=members),
        tuple(sorted(owns)),
        claimed=tuple(claimed),
        stolen=tuple(stolen),
        released=tuple(sorted(released)),
        dead=dead,
        shares=fair,
        settled=settled,
    )


def _victim(
    others: Mapping[str, Member], fair: Mapping[str, int], min_hold_beats: int
) -> tuple[str, str] | None:
    """The partition to steal: from the member most above its share, held long enough."""
    above = sorted(
        (
            (len(m.owns) - fair.get(name, 0), name)
            for name, m in others.items()
            if len(m.owns) > fair.get(name, 0)
        ),
        reverse=True,
    )
    for _, name in above:
        member = others[name]
        candidates = sorted(
            (pid for pid, since in member.owns.items() if member.beat - since >= min_hold_beats),
            key=lambda pid: (member.owns[pid], pid),
        )
        if candidates:
            return name, candidates[0]
    return None


# --- serialisation -----------------------------------------------------------------------


def to_json(doc: Membership) -> dict[str, Any]:
    return {
        "kind": KIND,
        "version": VERSION,
        "poller": doc.poller,
        "source_fingerprint": doc.fingerprint,
        "generation": doc.generation,
        "bucket_space": BUCKETS,
        "partitions": [
            {
                "lo": p.lo,
                "hi": p.hi,
                **(
                    {
                        "floors": [
                            {"lo": f.lo, "hi": f.hi, "position": position_to_json(f.position)}
                            for f in p.floors
                        ]
                    }
                    if p.floors
                    else {}
                ),
            }
            for p in doc.partitions
        ],
        "members": {
            name: {
                "beat": m.beat,
                "owns": dict(m.owns),
                "seen_at": format_time(m.seen_at) if m.seen_at else None,
                **({"host": m.host} if m.host else {}),
            }
            for name, m in sorted(doc.members.items())
        },
        "journal": [dict(e) for e in doc.journal],
    }


def dumps(doc: Membership) -> bytes:
    return json.dumps(to_json(doc), separators=(",", ":")).encode()


def _int(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CorruptStateError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def loads(data: bytes | str) -> Membership:
    """Parse a membership document; anything malformed is :class:`CorruptStateError`."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptStateError(f"membership document is not valid JSON: {exc}") from exc
    if not isinstance(raw, Mapping) or raw.get("kind") != KIND:
        raise CorruptStateError("not a dbtrigger membership document")
    if raw.get("version") != VERSION:
        raise CorruptStateError(f"membership document version {raw.get('version')!r} is not 1")
    if raw.get("bucket_space") != BUCKETS:
        raise CorruptStateError(
            f"membership document uses {raw.get('bucket_space')!r} buckets, "
            f"this dbtrigger {BUCKETS}"
        )
    partitions = []
    for index, item in enumerate(raw.get("partitions") or []):
        where = f"partitions[{index}]"
        if not isinstance(item, Mapping):
            raise CorruptStateError(f"{where} must be an object")
        floors = tuple(
            Floor(
                _int(f, "lo", f"{where}.floors"),
                _int(f, "hi", f"{where}.floors"),
                position_from_json(f.get("position"), f"{where}.floors.position"),
            )
            for f in item.get("floors") or []
            if isinstance(f, Mapping)
        )
        partitions.append(Partition(_int(item, "lo", where), _int(item, "hi", where), floors))
    _check_cover(partitions)
    members = {}
    raw_members = raw.get("members") or {}
    if not isinstance(raw_members, Mapping):
        raise CorruptStateError("members must be an object")
    for name, item in raw_members.items():
        if not isinstance(item, Mapping) or not isinstance(item.get("owns", {}), Mapping):
            raise CorruptStateError(f"members[{name!r}] is malformed")
        owns = {str(k): int(v) for k, v in item["owns"].items() if isinstance(v, int)}
        seen = item.get("seen_at")
        host = item.get("host")
        members[str(name)] = Member(
            beat=_int(item, "beat", f"members[{name!r}]"),
            owns=owns,
            seen_at=parse_time(seen, "seen_at") if seen else None,
            host=host if isinstance(host, str) else None,
        )
    poller = raw.get("poller")
    fingerprint = raw.get("source_fingerprint")
    if not isinstance(poller, str) or not isinstance(fingerprint, str):
        raise CorruptStateError("membership document lacks poller or source_fingerprint")
    journal = raw.get("journal") or []
    if not isinstance(journal, list):
        raise CorruptStateError("journal must be a list")
    return Membership(
        poller=poller,
        fingerprint=fingerprint,
        generation=_int(raw, "generation", "document"),
        partitions=tuple(partitions),
        members=members,
        journal=tuple(e for e in journal if isinstance(e, Mapping)),
    )


def _check_cover(partitions: Sequence[Partition]) -> None:
    """Partitions must tile the bucket space exactly: a gap would never be polled."""
    expected = 0
    for p in sorted(partitions, key=lambda p: p.lo):
        if p.lo != expected or p.hi <= p.lo:
            raise CorruptStateError(
                f"partition ranges do not tile the bucket space: expected one starting at "
                f"{expected}, found [{p.lo}, {p.hi})"
            )
        expected = p.hi
    if expected != BUCKETS:
        raise CorruptStateError(f"partition ranges end at {expected}, not {BUCKETS}")
