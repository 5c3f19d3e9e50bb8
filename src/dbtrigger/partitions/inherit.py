"""What a partition made by a regroup takes over from its parents' state documents.

A child starts at its parent's checkpoint (a merged one at the lowest of its
parents', with floors), but a checkpoint is not all a partition has settled:

* its **window** (:mod:`dbtrigger.state.window`): events settled above the
  checkpoint while an earlier one waits for a retry (accepted, or rejected and
  dead-lettered: never to be delivered again), and the retries themselves with
  their attempts and backoff. Each entry goes to the child whose buckets hold
  its key, so a regroup delivers none of them again and no retry starts over;
* its **failing batch's record** (``failure``): the attempts of the batch that
  keeps failing at its checkpoint. Every child that starts where that batch
  starts goes on counting (which of them holds the failing row is not known;
  one whose batch passes drops the record at its commit), so a poison row is
  set aside after ``max_attempts`` deliveries in all, not ``max_attempts`` more
  after every regroup (with regroups often enough, never); its rows already
  processed are skipped there as before. The failing batch's id and extent
  (its last row, count and digest) are the parent batch's, not the child's,
  and are left out: the child's next failure records its own, which
  ``skip-batch`` then checks;
* its **fan-out set** (:mod:`dbtrigger.state.fanout_set`): the subscribers it
  last ran with, so a subscriber added after the regroup is said to start at
  the checkpoints (``subscriber_joined``) as it is without one;
* its **fencing token**: a child's first owner takes a token above its
  parents' and above any earlier partition of the same name (split, merge,
  split back), so a sink that keeps the highest ``ctx.fencing_token`` per
  ``ctx.poller_name`` never refuses it.

Pure functions of the parents' documents; :mod:`dbtrigger.partitions.regroup`
reads and writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dbtrigger.cursor import Position
from dbtrigger.errors import DbTriggerError
from dbtrigger.partitions.buckets import bucket_of
from dbtrigger.partitions.layout import Partition
from dbtrigger.state import fanout_set
from dbtrigger.state.document import FailureRecord, StateDocument
from dbtrigger.state.lease import MAX_DONE_IDS, failure_at
from dbtrigger.state.window import Window


def token(docs: Sequence[StateDocument | None]) -> int:
    """The highest fencing token of ``docs`` (0: none has had a lease)."""
    return max((d.lease.fencing_token for d in docs if d is not None and d.lease), default=0)


def subscribers(parents: Sequence[StateDocument]) -> tuple[str, ...] | None:
    """The fan-out set the parents recorded (None: none did). Parents that ran with
    different sets give the subscribers all of them had: one missing from any is
    said to join, the side that repeats nothing silently."""
    sets = [names for d in parents if (names := fanout_set.recorded(d)) is not None]
    if not sets:
        return None
    return tuple(sorted(set(sets[0]).intersection(*sets[1:])))


def failure(start: Position | None, parents: Sequence[StateDocument]) -> FailureRecord | None:
    """The record of a batch failing at ``start`` (None: the beginning), where the
    child's first batch starts, from the parents failing there (the most attempts
    when several are); None when none is."""
    at = start if start is not None else Position()
    records = [
        record
        for d in parents
        if d.position == at and (record := failure_at(d, d.position)) is not None
    ]
    if not records:
        return None
    most = max(records, key=lambda r: r.attempts)
    done = tuple(dict.fromkeys(i for r in records for i in r.done))
    return replace(
        most,
        batch_id=None,  # the child's batch is other rows: it is named anew
        from_position=at,
        done=done[:MAX_DONE_IDS],
        done_total=max(len(done), sum(r.done_total for r in records)),
        killed=tuple(dict.fromkeys(k for r in records for k in r.killed)),
        batch_end=None,
        batch_rows=None,
        batch_digest=None,
    )


def window(
    child: Partition, parents: Sequence[StateDocument], pk_columns: Sequence[str]
) -> Window | None:
    """The parents' window entries whose key lies in ``child``'s buckets (None: none)."""
    windows = [d.window for d in parents if d.window is not None]
    settled = tuple(p for w in windows for p in w.settled if _holds(child, p, pk_columns))
    pending = tuple(e for w in windows for e in w.pending if _holds(child, e.position, pk_columns))
    if not settled and not pending:
        return None
    bound = next((w.bound for w in windows if w.bound is not None), None)
    return Window(settled, pending, bound)


def _holds(child: Partition, position: Position, pk_columns: Sequence[str]) -> bool:
    """The key of ``position`` is in ``child``'s buckets, or may be.

    A PostgreSQL ``char(n)`` key is stored padded and hashed without the padding,
    so a text key is tried both ways; a key whose bucket cannot be computed goes
    to every child. An entry in a child that does not hold its row is found gone
    by that child's tick (:func:`dbtrigger.state.window.gone`) and dropped: at
    worst room in the window for a while, never a row skipped.
    """
    values = [position.pk.get(c) for c in pk_columns]
    if any(v is None for v in values):
        return True
    variants = [values, [v.rstrip(" ") if isinstance(v, str) else v for v in values]]
    try:
        return any(child.lo <= bucket_of(v) < child.hi for v in variants)
    except DbTriggerError:
        return True
