"""A partitions membership document nobody can read: the error, and the way out.

Every member of a partitioned poller reads ``<poller>.members`` each balance
cycle; one that does not parse stops them all. The error names the poller, the
store and key, and ``dbtrigger partitions reset-layout``, which replaces it:

* ``--from-state`` rebuilds the layout from the partitions' own state documents
  (``<poller>.pLLL-HHH``: each names its bucket range, and its checkpoint says
  that every row of those buckets up to it was delivered). Those of the
  configured source are chosen to cover the whole bucket space exactly once,
  the current ones before those a regroup retired (which only repeat rows);
  buckets no document covers get a partition from the beginning. Merge floors,
  kept only in the lost document, are dropped: rows a merge would have skipped
  are delivered again, none is skipped.
* ``--from-file BACKUP`` puts a saved membership document back (the backups
  ``partitions set|split|merge`` write): its ranges and floors as they were.

Either way ownership starts empty (members claim at their next cycle) and the
generation jumps to the rebuild's Unix time, so no member mistakes the new
layout for one it saw before. Only an unreadable document is replaced.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dbtrigger.errors import ConfigurationError, CorruptStateError
from dbtrigger.partitions import layout
from dbtrigger.partitions.buckets import BUCKETS
from dbtrigger.partitions.layout import Membership, Partition
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.redaction import redact
from dbtrigger.state import document as docmod
from dbtrigger.state import journal
from dbtrigger.state import operations as ops
from dbtrigger.state.stores.base import CheckpointStore

_PARTITION = re.compile(r"p(\d{3,})-(\d{3,})")


def unreadable_membership(
    store: CheckpointStore, poller: str, key: str, exc: CorruptStateError
) -> CorruptStateError:
    """``exc`` again, naming the poller, the store and key, and the way out."""
    return CorruptStateError(
        f"the partitions membership document {key!r} of poller {poller!r} in "
        f"{redact(store.describe())} cannot be read: {exc}. Nothing was changed; every member "
        "stops until it is replaced. To rebuild it from the partitions' own state documents: "
        "dbtrigger partitions reset-layout --trigger MODULE:ATTR --from-state --force "
        "--reason WHY --yes (or --from-file BACKUP, a membership backup of "
        "`dbtrigger partitions set|split|merge`); see docs/scale-out.md",
        poller=poller,
    )


def unreadable_key(
    store: CheckpointStore, key: str, exc: CorruptStateError, stored: object
) -> CorruptStateError:
    """The error for ``key``, a ``GROUP.members`` key met where a state document was
    expected (``dbtrigger status``, ``reset``): the membership's own way out, or, when
    the document reads as a membership, that it is one and which commands change it.
    ``stored`` is kept as the error's ``stored`` attribute, as for a state document."""
    group = key.removesuffix(".members")
    error = unreadable_membership(store, group, key, exc)
    data = getattr(stored, "data", None)
    if isinstance(data, bytes):
        try:
            layout.loads(data)
        except CorruptStateError:
            pass
        else:
            error = CorruptStateError(
                f"{key!r} is the partitions membership document of poller {group!r}, not "
                "a state document: `dbtrigger partitions show|set|split|merge --trigger "
                "MODULE:ATTR` read and change it",
                poller=key,
            )
    error.stored = stored  # type: ignore[attr-defined]
    return error


def read_membership(store: CheckpointStore, poller: str, key: str, data: bytes) -> Membership:
    """The membership document ``data``, parsed; :func:`unreadable_membership` if not."""
    try:
        return layout.loads(data)
    except CorruptStateError as exc:
        raise unreadable_membership(store, poller, key, exc) from exc


@dataclass
class Rebuilt:
    """A membership document to write, and what the operator is told about it."""

    doc: Membership
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # partition id -> where it came from


@dataclass(frozen=True)
class _Candidate:
    partition: Partition
    retired: bool
    updated: str
    checkpoint: str


def _candidates(poller: Any) -> list[_Candidate]:
    """The partition state documents of the configured source in the store."""
    prefix = f"{poller.name}."
    found = []
    for key in poller.store.list_keys():
        match = _PARTITION.fullmatch(key[len(prefix) :]) if key.startswith(prefix) else None
        if match is None:
            continue
        lo, hi = int(match.group(1)), int(match.group(2))
        if not 0 <= lo < hi <= BUCKETS or f"p{lo:03d}-{hi:03d}" != match.group(0):
            continue
        part = Partition(lo, hi)
        stored = poller.store.read(key)
        if stored is None:
            continue
        try:
            state = docmod.loads(stored.data)
        except CorruptStateError as exc:
            raise ConfigurationError(
                f"the state document {key!r} cannot be read either ({exc}): replace it first "
                f"(dbtrigger reset {key} --from-file BACKUP --force), or restore the layout "
                "with --from-file"
            ) from exc
        expected = PartitionSource(poller.source, part, poller=poller.name).fingerprint()
        if state.source_fingerprint != expected:
            continue  # another source definition's: not this poller's layout
        lease = state.lease
        # A regroup's lock (an operator's lease never released); a regrouped partition's
        # first document carries its token in a released one, and is current.
        retired = (
            lease is not None
            and lease.owner_id.startswith(ops.OPERATOR_PREFIX)
            and not lease.released
        )
        updated = docmod.format_time(state.checkpoint.updated_at) if state.checkpoint else ""
        checkpoint = str(state.position) if state.checkpoint else "the beginning"
        found.append(_Candidate(part, retired, updated, checkpoint))
    return found


def _cover(candidates: Sequence[_Candidate]) -> list[_Candidate | Partition]:
    """Ranges covering ``[0, BUCKETS)`` exactly once, left to right: at each point a
    document starting there (one the documents cover to the end with, the current
    before the retired, the most recently advanced first), or a fresh partition up
    to where the next document starts."""
    starting: dict[int, list[_Candidate]] = {}
    for c in sorted(candidates, key=lambda c: (c.retired, _desc(c.updated))):
        starting.setdefault(c.partition.lo, []).append(c)
    memo: dict[int, list[_Candidate | Partition] | None] = {}

    def from_(lo: int) -> list[_Candidate | Partition] | None:
        if lo == BUCKETS:
            return []
        if lo in memo:
            return memo[lo]
        best: list[_Candidate | Partition] | None = None
        for c in starting.get(lo, []):
            rest = from_(c.partition.hi)
            if rest is not None:
                best = [c, *rest]
                break
        memo[lo] = best
        return best

    out: list[_Candidate | Partition] = []
    lo = 0
    while lo < BUCKETS:
        options = starting.get(lo, [])
        if options:
            # one that the documents cover to the end, else the preferred one
            pick = next((c for c in options if from_(c.partition.hi) is not None), options[0])
            out.append(pick)
            lo = pick.partition.hi
            continue
        # no document starts here: a fresh partition up to where the next one does
        nxt = min((p for p in starting if p > lo), default=BUCKETS)
        out.append(Partition(lo, nxt))
        lo = nxt
    return out


def _desc(text: str) -> str:
    """A key sorting ISO times newest first."""
    return "".join(chr(0x10FFFF - ord(ch)) for ch in text)


def _entry(how: str, actor: str, reason: str, now: dt.datetime, **details: Any) -> dict[str, Any]:
    return {
        "type": journal.MANUAL,
        "operation": "reset_layout",
        "actor": actor,
        "reason": reason,
        "at": docmod.format_time(now),
        "from": how,
        **details,
    }


def from_state(poller: Any, *, actor: str, reason: str, now: dt.datetime) -> Rebuilt:
    """The layout the partitions' own state documents give (see the module docstring)."""
    chosen = _cover(_candidates(poller))
    partitions = tuple(c if isinstance(c, Partition) else c.partition for c in chosen)
    rebuilt = Rebuilt(
        layout.Membership(
            poller.name, poller.source.fingerprint(), int(now.timestamp()), partitions
        )
    )
    for c in chosen:
        if isinstance(c, Partition):
            rebuilt.sources[c.id] = "no state document: from the beginning"
            rebuilt.notes.append(
                f"buckets {c.lo}-{c.hi} have no partition state document: partition {c.id} "
                "starts from the beginning (rows of them delivered before are delivered again)"
            )
        else:
            state = "retired by a regroup, " if c.retired else ""
            rebuilt.sources[c.partition.id] = f"{state}checkpoint {c.checkpoint}"
    rebuilt.notes.append(
        "merge floors are kept only in the membership document: any are dropped (rows a "
        "merge would have skipped are delivered again; none is skipped)"
    )
    rebuilt.doc = replace(
        rebuilt.doc,
        journal=(_entry("state", actor, reason, now, partitions=len(partitions)),),
    )
    return rebuilt


def from_file(
    poller: Any, data: bytes, *, path: str, actor: str, reason: str, now: dt.datetime
) -> Rebuilt:
    """A saved membership document, with ownership cleared and a new generation."""
    try:
        saved = layout.loads(data)
    except CorruptStateError as exc:
        raise ConfigurationError(f"{path} is not a readable membership document: {exc}") from exc
    if saved.poller != poller.name:
        raise ConfigurationError(f"{path} is the layout of {saved.poller!r}, not {poller.name!r}")
    if saved.fingerprint != poller.source.fingerprint():
        raise ConfigurationError(
            f"{path} is a layout of another source definition of {poller.name!r}: "
            "use --from-state, or the backup taken with this one"
        )
    members = {name: replace(m, owns={}) for name, m in saved.members.items()}
    entry = _entry("file", actor, reason, now, file=path, partitions=len(saved.partitions))
    doc = replace(
        saved,
        generation=max(int(now.timestamp()), saved.generation + 1),
        members=members,
        journal=(*saved.journal, entry)[-20:],
    )
    rebuilt = Rebuilt(doc)
    for c in _candidates(poller):
        if c.retired and doc.partition(c.partition.id) is not None:
            rebuilt.notes.append(
                f"partition {c.partition.id} was retired by a later regroup: the backup is of "
                "an earlier layout, whose rows since are delivered again (--from-state "
                "rebuilds the later one)"
            )
    for p in doc.partitions:
        rebuilt.sources[p.id] = f"{len(p.floors)} floor(s)" if p.floors else "as saved"
    return rebuilt


def replace_unreadable(store: CheckpointStore, key: str, doc: Membership) -> bytes:
    """Write ``doc`` over the unreadable document at ``key``; the bytes it replaced.

    Raises:
        ConfigurationError: the document can be read (nothing to recover), or is gone.
        CasConflictError: it changed meanwhile.
    """
    stored = store.read(key)
    if stored is None:
        raise ConfigurationError(f"there is no {key!r}: members lay out a new one themselves")
    try:
        layout.loads(stored.data)
    except CorruptStateError:
        store.write(key, layout.dumps(doc), if_match=stored.etag)
        return stored.data
    raise ConfigurationError(
        f"{key!r} can be read: reset-layout replaces only an unreadable membership document "
        "(partitions set|split|merge change a readable one)"
    )


def describe(rebuilt: Rebuilt) -> list[str]:
    lines = [f"  {pid}: {where}" for pid, where in rebuilt.sources.items()]
    return lines + [f"  note: {n}" for n in rebuilt.notes]


__all__ = [
    "Rebuilt",
    "describe",
    "from_file",
    "from_state",
    "read_membership",
    "replace_unreadable",
    "unreadable_key",
    "unreadable_membership",
]
