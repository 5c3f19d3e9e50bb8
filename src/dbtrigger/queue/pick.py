"""Which of the rows a claim locked it takes: bisecting the rows of expired claims.

A claim locks the first ``batch_size`` claimable rows in ``dbt_visible_at``
order (the *pick*), then takes some of them. Taking all of them would be
wrong after a crash: rows claimed together whose claim expired without an
outcome (the worker was killed, ran out of memory, hung) would be claimed
together again, and one row that kills every worker holding it would take
the whole batch to ``dead`` with it.

So the claim looks at the first row of the pick (the *head*, the row that
has waited longest) and takes one of three kinds of claim:

* the head is **fresh** (``ready``, no claim token): every fresh row of the
  pick. Rows of expired claims further down the pick are left where they are
  (they lead a later pick), so they are never mixed with fresh rows;
* the head belongs to an **expired claim** (still ``claimed``, its visibility
  timeout passed): the first half of that claim's rows in the pick. The other
  half is *regrouped*: made ``ready`` again under a new group token, keeping
  its ``dbt_visible_at`` so it leads the next pick. A claim that expired
  holding a single row is taken alone: that row is *isolated*;
* the head belongs to a **regrouped half** (``ready`` with a token, which
  nothing else writes): every row of that group, tried together as one claim.

A half that expires again is halved again, so a row that kills its worker is
isolated after about ``log2(batch_size)`` expiries, and the rows that came
with it are completed in the halves that did not crash. Everything this needs
is in the claim columns (status, token, visible_at): the worker that knew
what happened is dead. An isolated row that has used up its attempts goes
dead without a handler call (:mod:`dbtrigger.queue.outcome`); a row in a half
is never dead for having expired, and the halving costs it no attempt: the
claimed half keeps the attempt the expired claim counted (as this claim's),
the regrouped half gives it back.

A regrouped half is also what a handler failure shared by several rows leaves
(:func:`dbtrigger.queue.outcome.decide` splits them into two such groups, due
after the backoff): the rows a failing claim held are tried in halves until
the row that fails is alone.

Nothing here does I/O: the statements lock and write, :func:`choose` decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.queue.schema import CLAIMED, READY


@dataclass(frozen=True)
class Picked:
    """One row the pick locked: its key and its claim state before this claim."""

    key: tuple[Any, ...]
    status: str
    token: str | None


@dataclass(frozen=True)
class Choice:
    """What a claim does with its pick.

    ``claim``: the keys it takes. ``regroup``: the keys made a waiting group
    (the untried half of an expired claim). ``isolated``: the one claimed row's
    previous claim expired holding it alone. ``bisected``: ``(expired claim's
    rows in the pick, rows taken)`` when an expired claim was halved.
    """

    claim: list[tuple[Any, ...]] = field(default_factory=list)
    regroup: list[tuple[Any, ...]] = field(default_factory=list)
    isolated: bool = False
    bisected: tuple[int, int] | None = None


def is_fresh(status: str, token: str | None) -> bool:
    """A row no claim has touched since it was made ready (new, retried, re-driven)."""
    return status == READY and token is None


def choose(picked: Sequence[Picked]) -> Choice:
    """The claim to take from ``picked`` (in pick order; see the module doc)."""
    if not picked:
        return Choice()
    head = picked[0]
    if is_fresh(head.status, head.token):
        return Choice(claim=[p.key for p in picked if is_fresh(p.status, p.token)])
    group = [p.key for p in picked if p.status == head.status and p.token == head.token]
    if head.status != CLAIMED:
        return Choice(claim=group)  # a regrouped half: tried whole
    if len(group) == 1:
        return Choice(claim=group, isolated=True)
    half = (len(group) + 1) // 2
    return Choice(claim=group[:half], regroup=group[half:], bisected=(len(group), half))
