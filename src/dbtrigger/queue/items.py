"""What a claim took and what a settlement writes: the values passed between
the claim statements (:mod:`dbtrigger.queue.statements`), the driver and the
layouts. Nothing here does I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dbtrigger.queue.pick import Picked

Key = tuple[Any, ...]


@dataclass(frozen=True)
class ClaimBatch:
    """What one claim took.

    ``rows``: the claimed rows (claim columns as written). ``more``: the pick
    was full or rows were left in it, so claiming again at once finds work.
    ``isolated`` and ``bisected``: see :class:`dbtrigger.queue.pick.Choice`.
    """

    rows: list[dict[str, Any]]
    more: bool = False
    isolated: bool = False
    bisected: tuple[int, int] | None = None
    #: The pick was led by rows of an expired claim or a regrouped half (taken
    #: alone), or, when only fresh rows were wanted, nothing was taken for that.
    group: bool = False
    #: Nothing taken: the pick was led by this row of an expired claim or a
    #: regrouped half; claim its group with ``ClaimTable.claim_group``.
    lead: Picked | None = None


@dataclass(frozen=True)
class RetryItem:
    """A row to hand back for another attempt after ``delay_seconds``.

    ``group``: the row failed together with others, with nothing to say which
    of them failed (the handler raised on a claim of several rows). It waits
    with the rows of its ``group`` (``ready`` under that token, claimed
    together, never mixed with other rows: :mod:`dbtrigger.queue.pick`), and
    the attempt is not counted against it: a shared failure is nobody's until
    the halving has isolated the row that fails. ``counted``: the row failed
    alone and its attempt stands; its ``group`` is itself, so it comes back
    alone instead of failing a claim of fresh rows again.
    """

    key: Key
    delay_seconds: float
    error: str
    group: str | None = None
    counted: bool = False


@dataclass(frozen=True)
class DeadItem:
    """A row that will not be attempted again."""

    key: Key
    error: str


@dataclass(frozen=True)
class Settled:
    """Which keys each part of a settlement actually changed (the rest were lost)."""

    done: frozenset[Key]
    retried: frozenset[Key]
    dead: frozenset[Key]


__all__ = ["ClaimBatch", "DeadItem", "Key", "RetryItem", "Settled"]
