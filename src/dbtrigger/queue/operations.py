"""Operator commands on a claim table: ``queue status`` counts, re-driving dead
rows, pruning finished ones.

Split from :mod:`dbtrigger.queue.statements` (the claim, extension and
settlement every batch runs): these run when an operator asks, each in the
transaction its caller opened, and build their statements per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dbtrigger.queue.schema import (
    ATTEMPTS,
    CLAIM_TOKEN,
    CLAIMED,
    DEAD,
    DONE,
    DONE_AT,
    LAST_ERROR,
    READY,
    STATUS,
    VISIBLE_AT,
)
from dbtrigger.queue.statements import ClaimTable, Key


@dataclass(frozen=True)
class QueueCounts:
    """What ``dbtrigger queue status`` shows."""

    by_status: Mapping[str, int]
    claimable_now: int
    #: ``ready`` rows not due yet that have been tried: waiting for a retry.
    delayed: int
    expired_claims: int
    oldest_ready_age_seconds: float | None
    #: ``ready`` rows not due yet that were never tried: scheduled for later.
    scheduled: int = 0
    #: ``ready`` rows that still carry a finished row's ``dbt_visible_at``
    #: (9999-12-31): made ready by hand without it, they are never claimed.
    stranded: int = 0
    #: The oldest ready row carries no real time: on SQLite ``queue install``
    #: defaults ``dbt_visible_at`` to the epoch, so a row inserted without it
    #: would read as 57 years old. Its age is then None, not a made-up number.
    undated: bool = False


#: An age no queued row has: what the epoch default of ``dbt_visible_at`` reads as.
UNDATED_AGE_SECONDS = 25 * 365 * 86400


def counts(table: ClaimTable, conn: Connection) -> QueueCounts:
    """The numbers of ``queue status``, from one statement: one snapshot, so they add
    up while workers claim (four statements, each its own snapshot on PostgreSQL,
    showed rows ``ready`` and, a claim later, gone from ``claimable now``)."""
    c = table.table.c
    now = table.time.now()

    def number(condition: sa.ColumnElement[bool]) -> Any:
        return sa.func.sum(sa.case((condition, 1), else_=0))

    claimable = sa.and_(c[STATUS].in_((READY, CLAIMED)), c[VISIBLE_AT] <= now)
    later = sa.and_(c[STATUS] == READY, c[VISIBLE_AT] > now)
    # Tried: attempts counted, or waiting as a group (a failure shared by several
    # rows gives its attempt back, see queue/outcome.py).
    tried = sa.or_(c[ATTEMPTS] > 0, c[CLAIM_TOKEN].is_not(None))
    stuck = c[VISIBLE_AT] >= table.time.far_future()
    age = table.time.age_seconds(c[VISIBLE_AT])
    stmt = (
        sa.select(
            c[STATUS],
            sa.func.count(),
            number(claimable),
            sa.func.max(sa.case((claimable, age))),
            number(later),
            number(sa.and_(later, sa.not_(stuck), tried)),
            number(sa.and_(later, stuck)),
            number(sa.and_(c[STATUS] == CLAIMED, c[VISIBLE_AT] <= now)),
        )
        .where(table.filtered(sa.true()))
        .group_by(c[STATUS])
    )
    by_status: dict[str, int] = {}
    ready_now = scheduled = delayed = stranded = expired = 0
    oldest: float | None = None
    for status, n, claimable_n, age_max, later_n, delayed_n, stuck_n, expired_n in conn.execute(
        stmt
    ):
        by_status[str(status)] = int(n)
        ready_now += int(claimable_n or 0)
        scheduled += int(later_n or 0) - int(delayed_n or 0) - int(stuck_n or 0)
        delayed += int(delayed_n or 0)
        stranded += int(stuck_n or 0)
        expired += int(expired_n or 0)
        if age_max is not None and (oldest is None or float(age_max) > oldest):
            oldest = float(age_max)
    undated = oldest is not None and oldest > UNDATED_AGE_SECONDS
    if undated:
        oldest = None
    shown = (READY, CLAIMED, DONE, DEAD)
    return QueueCounts(
        by_status={s: by_status.get(s, 0) for s in shown}
        | {k: v for k, v in by_status.items() if k not in shown},
        claimable_now=ready_now,
        delayed=delayed,
        expired_claims=expired,
        oldest_ready_age_seconds=None if oldest is None else max(0.0, oldest),
        scheduled=scheduled,
        stranded=stranded,
        undated=undated,
    )


def retries_waiting(table: ClaimTable, conn: Connection) -> tuple[int, float | None]:
    """Rows waiting for a retry (``ready``, tried, not due yet, as ``counts``'s
    ``delayed``) and the seconds until the first is due (None: none waits)."""
    c = table.table.c
    tried = sa.or_(c[ATTEMPTS] > 0, c[CLAIM_TOKEN].is_not(None))
    later = table.filtered(
        c[STATUS] == READY,
        c[VISIBLE_AT] > table.time.now(),
        c[VISIBLE_AT] < table.time.far_future(),
        tried,
    )
    age = table.time.age_seconds(c[VISIBLE_AT])  # negative: the time still to wait
    waiting, oldest = conn.execute(sa.select(sa.func.count(), sa.func.max(age)).where(later)).one()
    return int(waiting), None if oldest is None else max(0.0, -float(oldest))


def claims_held(table: ClaimTable, conn: Connection) -> tuple[int, float | None]:
    """Rows under a live claim (any worker's: one at work, or one that died and
    whose claim has not expired yet) and the seconds until the first claim expires."""
    c = table.table.c
    held = table.filtered(c[STATUS] == CLAIMED, c[VISIBLE_AT] > table.time.now())
    age = table.time.age_seconds(c[VISIBLE_AT])  # negative: the time the claim has left
    count, first = conn.execute(sa.select(sa.func.count(), sa.func.max(age)).where(held)).one()
    return int(count), None if first is None else max(0.0, -float(first))


def dead_rows(table: ClaimTable, conn: Connection, *, limit: int | None) -> list[dict[str, Any]]:
    """Dead rows in key order: their key, attempts, last error and when they died."""
    c = table.table.c
    stmt = (
        sa.select(*table.key_columns, c[ATTEMPTS], c[LAST_ERROR], c[DONE_AT])
        .where(table.filtered(c[STATUS] == DEAD))
        .order_by(*table.key_columns)
    )
    if limit is not None:
        stmt = stmt.limit(limit)
    return [dict(r) for r in conn.execute(stmt).mappings()]


def discard_dead(
    table: ClaimTable, conn: Connection, keys: Sequence[Key], *, note: str, delete: bool
) -> int:
    """Settle dead rows as done for good (their error kept, ``note`` in front), or
    delete them (``delete``); how many."""
    c = table.table.c
    where = sa.and_(table.key_in(keys), table.filtered(c[STATUS] == DEAD))
    if delete:
        return int(conn.execute(sa.delete(table.table).where(where)).rowcount)
    return _update_noted(table, conn, where, note, {STATUS: DONE, DONE_AT: table.time.now()})


def redrive_dead(
    table: ClaimTable,
    conn: Connection,
    *,
    note: str,
    limit: int | None,
    dry_run: bool,
    keys: Sequence[Key] | None = None,
    stranded: bool = False,
) -> int:
    """Make dead rows (all, or those of ``keys``) ready again, attempts reset; how many.
    ``stranded``: the ``ready`` rows that carry a finished row's ``dbt_visible_at``
    instead (made ready by hand without it, see :class:`QueueCounts`)."""
    c = table.table.c
    chosen = (
        sa.and_(c[STATUS] == READY, c[VISIBLE_AT] >= table.time.far_future())
        if stranded
        else c[STATUS] == DEAD
    )
    dead = table.filtered(chosen)
    if keys is not None:
        if dry_run:
            found = conn.execute(
                sa.select(sa.func.count()).where(sa.and_(table.key_in(keys), dead))
            ).scalar_one()
            return int(found)
        dead = sa.and_(table.key_in(keys), dead)
    if keys is None and (dry_run or limit is not None):
        pick = sa.select(*table.key_columns).where(dead).order_by(*table.key_columns)
        if limit is not None:
            pick = pick.limit(limit)
        keys = [tuple(r) for r in conn.execute(pick)]
        if dry_run or not keys:
            return len(keys)
        where = sa.and_(table.key_in(keys), chosen)
    else:
        where = dead
    ready = {STATUS: READY, ATTEMPTS: 0, CLAIM_TOKEN: None, DONE_AT: None}
    return _update_noted(table, conn, where, note, {**ready, VISIBLE_AT: table.time.now()})


def _update_noted(
    table: ClaimTable, conn: Connection, where: Any, note: str, values: Mapping[str, Any]
) -> int:
    """Write ``values`` onto the rows ``where`` selects, ``note`` put in front of each
    row's last error (so the history of a row stays on the row); how many."""
    previous = sa.func.coalesce(table.table.c[LAST_ERROR], "")
    noted = sa.func.substr(sa.literal(note, sa.String) + previous, 1, 2000)
    stmt = sa.update(table.table).where(where).values({**values, LAST_ERROR: noted})
    return int(conn.execute(stmt).rowcount)


def prune_keys(
    table: ClaimTable,
    conn: Connection,
    *,
    cutoff: Any,
    after: Key | None,
    limit: int,
    statuses: Sequence[str],
) -> list[Key]:
    """The next ``limit`` finished keys (by key order, after ``after``) older than ``cutoff``.

    Walking the key in order makes a full prune read the table once, not
    once per chunk.
    """
    c = table.table.c
    where = [c[STATUS].in_(list(statuses)), c[DONE_AT] < cutoff]
    if after is not None:
        if len(table.key_columns) == 1:
            where.append(table.key_columns[0] > after[0])
        else:
            where.append(sa.tuple_(*table.key_columns) > sa.tuple_(*after))
    stmt = (
        sa.select(*table.key_columns)
        .where(table.filtered(*where))
        .order_by(*table.key_columns)
        .limit(limit)
    )
    return [tuple(r) for r in conn.execute(stmt)]


def delete_finished(
    table: ClaimTable,
    conn: Connection,
    keys: Sequence[Key],
    statuses: Sequence[str],
    cutoff: Any,
) -> int:
    """Delete the rows of ``keys`` :func:`prune_keys` picked, if they are still
    finished before ``cutoff``: one made ready and run again since the pick (its
    producer re-enqueued it) keeps its fresh outcome."""
    c = table.table.c
    stmt = sa.delete(table.table).where(
        table.key_in(keys), c[STATUS].in_(list(statuses)), c[DONE_AT] < cutoff
    )
    return int(conn.execute(stmt).rowcount)
