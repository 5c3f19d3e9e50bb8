"""Claim, extend, settle, inspect: the queue's SQL, per dialect, on one table.

:class:`ClaimTable` knows a table that has the claim columns (the user's own
table in columns mode, the sidecar claims table in sidecar mode), its key
columns, and an optional extra filter. Every statement is built with
SQLAlchemy Core; values are bound. Callers own the transaction (the source
opens one per operation), so each method is one unit of work.

Claim, per dialect:

* PostgreSQL: one statement - ``WITH pick AS (SELECT key ... ORDER BY
  dbt_visible_at LIMIT n FOR UPDATE SKIP LOCKED) UPDATE ... FROM pick
  RETURNING *``. Concurrent claimers skip each other's locked rows instead of
  waiting, and no row can be picked twice.
* MariaDB >= 10.6 / MySQL >= 8: no ``UPDATE ... RETURNING``, so ``SELECT ...
  FOR UPDATE SKIP LOCKED`` then ``UPDATE ... WHERE key IN (...)`` in one
  READ COMMITTED transaction (no gap locks that would block producers).
* SQLite: no row locks; the transaction starts with ``BEGIN IMMEDIATE`` (the
  source's engine does that), which serialises claimers on the write lock,
  then one ``UPDATE ... WHERE key IN (SELECT ... LIMIT n) RETURNING *``.

Settling is fenced: every completion, retry, dead-marking and extension
matches ``key AND dbt_claim_token = :token AND dbt_status = 'claimed' AND
dbt_visible_at > now``. A row whose claim expired (whether or not another
worker has taken it since) no longer matches, and the method reports it as
*lost* instead of overwriting the newer claim's result.

A claim is judged held or expired at exactly one instant per settlement, and
the report is what was written at that instant:

* PostgreSQL and SQLite: the fenced ``UPDATE``/``DELETE ... RETURNING key`` is
  one statement with one clock reading; the keys it returns are the keys it
  changed.
* MariaDB/MySQL (no ``RETURNING``): ``SELECT key ... FOR UPDATE`` with the
  full fence locks the rows the claim still holds; that is the instant. The
  writes that follow match those locked keys by key, token and status but do
  *not* compare the clock again: the lock keeps every other claimer off the
  rows until commit, so nothing can have taken them since, while a second
  clock reading a few milliseconds later could find the claim expired, match
  nothing, and leave rows this method had already reported as done to be
  claimed and completed by another worker (the double completion of issue
  #12). Each write's row count must equal the number of keys it was given, or
  the transaction is rolled back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from dbtrigger.errors import CommitError
from dbtrigger.queue.schema import (
    ATTEMPTS,
    CLAIM_TOKEN,
    CLAIMABLE,
    CLAIMED,
    CLAIMED_BY,
    DEAD,
    DONE,
    DONE_AT,
    LAST_ERROR,
    READY,
    STATUS,
    VISIBLE_AT,
    DialectTime,
)

Key = tuple[Any, ...]


@dataclass(frozen=True)
class RetryItem:
    """A row to hand back for another attempt after ``delay_seconds``."""

    key: Key
    delay_seconds: float
    error: str


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


@dataclass(frozen=True)
class QueueCounts:
    """What ``dbtrigger queue status`` shows."""

    by_status: Mapping[str, int]
    claimable_now: int
    delayed: int
    expired_claims: int
    oldest_ready_age_seconds: float | None


class ClaimTable:
    """The queue statements for ``table`` keyed by ``key`` (see the module doc)."""

    def __init__(
        self,
        table: sa.Table,
        key: Sequence[str],
        time: DialectTime,
        extra_filter: ColumnElement[bool] | None = None,
    ) -> None:
        self.table = table
        self.key = tuple(key)
        self.time = time
        self.filter = extra_filter
        self._key_cols = [table.c[k] for k in self.key]
        self._mysql = time.dialect == "mysql"
        self._statements: dict[str, Any] = {}

    # --- predicates -----------------------------------------------------------------

    def _filtered(self, *clauses: ColumnElement[bool]) -> ColumnElement[bool]:
        parts = list(clauses)
        if self.filter is not None:
            parts.append(self.filter)
        return sa.and_(*parts)

    def claimable(self) -> ColumnElement[bool]:
        c = self.table.c
        return self._filtered(c[STATUS].in_(CLAIMABLE), c[VISIBLE_AT] <= self.time.now())

    def key_of(self, row: Mapping[str, Any]) -> Key:
        return tuple(row[k] for k in self.key)

    def _key_in(self, keys: Sequence[Key]) -> ColumnElement[bool]:
        if len(self._key_cols) == 1:
            col = self._key_cols[0]
            if self.time.dialect == "postgresql":
                # One array parameter: the SQL text is the same for every batch
                # size, so the driver parses and prepares it once.
                values = sa.bindparam(None, [k[0] for k in keys], type_=ARRAY(col.type))
                return col == sa.any_(values)
            return col.in_([k[0] for k in keys])
        return sa.tuple_(*self._key_cols).in_([tuple(k) for k in keys])

    # --- prepared statements --------------------------------------------------------
    #
    # The claim, the extension and the settlement run once per batch, so they
    # are built once per table and reused: SQLAlchemy compiles a statement
    # object once (its compiled cache keys on it), and what changes per batch
    # (token, worker, keys, limit, times, error text) travels as parameters.
    # Building them per call cost about a millisecond of client CPU per batch.

    def _keys_param(self) -> ColumnElement[bool]:
        """``key IN :dbt_keys`` (PostgreSQL, one column: ``= ANY(:dbt_keys)``, one
        array parameter, so the SQL text is the same for every batch size)."""
        if len(self._key_cols) == 1:
            col = self._key_cols[0]
            if self.time.dialect == "postgresql":
                return col == sa.any_(sa.bindparam("dbt_keys", type_=ARRAY(col.type)))
            return col.in_(sa.bindparam("dbt_keys", expanding=True))
        return sa.tuple_(*self._key_cols).in_(sa.bindparam("dbt_keys", expanding=True))

    def _keys_value(self, keys: Sequence[Key]) -> list[Any]:
        if len(self._key_cols) == 1:
            return [k[0] for k in keys]
        return [tuple(k) for k in keys]

    def _fence(self, *, clock: bool) -> ColumnElement[bool]:
        """Rows held by claim ``:dbt_token``: its token, still claimed and (``clock``)
        not expired.

        An expired claim is void even while nobody has taken the row over
        yet: its worker may neither complete nor extend it, so a worker that
        was frozen past the visibility timeout can never record an outcome
        (the row is delivered again instead).
        """
        c = self.table.c
        parts = [c[CLAIM_TOKEN] == sa.bindparam("dbt_token", type_=sa.String), c[STATUS] == CLAIMED]
        if clock:
            parts.append(c[VISIBLE_AT] > self.time.now())
        return sa.and_(*parts)

    def _write_fence(self) -> ColumnElement[bool]:
        """The fence of a settlement's writes (see the module doc): the clock is
        read here, except on MariaDB/MySQL, where the rows were locked and judged
        by :meth:`_owned_keys` first."""
        return sa.and_(self._keys_param(), self._fence(clock=not self._mysql))

    def _prepared(self, name: str) -> Any:
        stmt = self._statements.get(name)
        if stmt is None:
            stmt = self._statements[name] = getattr(self, f"_build_{name}")()
        return stmt

    def _claim_values(self) -> dict[str, Any]:
        c = self.table.c
        return {
            STATUS: CLAIMED,
            CLAIM_TOKEN: sa.bindparam("dbt_token", type_=sa.String),
            CLAIMED_BY: sa.bindparam("dbt_worker", type_=sa.String),
            ATTEMPTS: c[ATTEMPTS] + 1,
            VISIBLE_AT: self.time.plus(0),
        }

    def _pick(self) -> sa.Select[Any]:
        c = self.table.c
        return (
            sa.select(*self._key_cols)
            .where(self.claimable())
            .order_by(c[VISIBLE_AT])
            .limit(sa.bindparam("dbt_limit", type_=sa.Integer))
        )

    def _build_claim(self) -> Any:
        if self.time.dialect == "postgresql":
            cte = self._pick().with_for_update(skip_locked=True).cte("dbt_pick")
            return (
                sa.update(self.table)
                .where(sa.and_(*(col == cte.c[col.name] for col in self._key_cols)))
                .values(self._claim_values())
                .returning(*self.table.c)
            )
        if self._mysql:
            return (
                sa.select(self.table)
                .where(self.claimable())
                .order_by(self.table.c[VISIBLE_AT])
                .limit(sa.bindparam("dbt_limit", type_=sa.Integer))
                .with_for_update(skip_locked=True)
            )
        pick = self._pick()
        target = (
            self._key_cols[0].in_(pick.scalar_subquery())
            if len(self._key_cols) == 1
            else sa.tuple_(*self._key_cols).in_(pick)
        )
        return (
            sa.update(self.table)
            .where(target)
            .values(self._claim_values())
            .returning(*self.table.c)
        )

    def _build_claim_locked(self) -> Any:
        """MariaDB/MySQL: mark the rows the claim's SELECT locked."""
        return sa.update(self.table).where(self._keys_param()).values(self._claim_values())

    def _build_extend(self) -> Any:
        return (
            sa.update(self.table)
            .where(self._fence(clock=True))
            .values({VISIBLE_AT: self.time.plus(0)})
        )

    def _build_owned(self) -> Any:
        where = sa.and_(self._keys_param(), self._fence(clock=True))
        return sa.select(*self._key_cols).where(where).with_for_update()

    def _returning(self, stmt: Any) -> Any:
        return stmt if self._mysql else stmt.returning(*self._key_cols)

    def _build_done(self) -> Any:
        stmt = (
            sa.update(self.table)
            .where(self._write_fence())
            .values(
                {
                    STATUS: DONE,
                    DONE_AT: self.time.now(),
                    VISIBLE_AT: self.time.far_future(),
                    LAST_ERROR: None,
                }
            )
        )
        return self._returning(stmt)

    def _build_done_delete(self) -> Any:
        return self._returning(sa.delete(self.table).where(self._write_fence()))

    def _build_retry(self) -> Any:
        stmt = (
            sa.update(self.table)
            .where(self._write_fence())
            .values(
                {
                    STATUS: READY,
                    CLAIM_TOKEN: None,
                    VISIBLE_AT: self.time.plus(0),
                    LAST_ERROR: sa.bindparam("dbt_error", type_=sa.String),
                }
            )
        )
        return self._returning(stmt)

    def _build_dead(self) -> Any:
        stmt = (
            sa.update(self.table)
            .where(self._write_fence())
            .values(
                {
                    STATUS: DEAD,
                    DONE_AT: self.time.now(),
                    VISIBLE_AT: self.time.far_future(),
                    LAST_ERROR: sa.bindparam("dbt_error", type_=sa.String),
                }
            )
        )
        return self._returning(stmt)

    # --- claim ----------------------------------------------------------------------

    def claim(
        self, conn: Connection, *, limit: int, token: str, worker: str, visibility: float
    ) -> list[dict[str, Any]]:
        """Claim up to ``limit`` claimable rows for ``token``; the rows, with attempts counted."""
        params = {
            "dbt_limit": limit,
            "dbt_token": token,
            "dbt_worker": worker,
            **self.time.plus_params(visibility),
        }
        result = conn.execute(self._prepared("claim"), params)
        names = list(result.keys())
        rows = [dict(zip(names, r, strict=True)) for r in result.all()]
        if not self._mysql or not rows:
            return rows
        keys = [self.key_of(r) for r in rows]
        conn.execute(self._prepared("claim_locked"), {**params, "dbt_keys": self._keys_value(keys)})
        for row in rows:
            row[STATUS] = CLAIMED
            row[CLAIM_TOKEN] = token
            row[CLAIMED_BY] = worker
            row[ATTEMPTS] = int(row[ATTEMPTS]) + 1
        return rows

    def extend(self, conn: Connection, *, token: str, visibility: float) -> int:
        """Push the claim's expiry to now + ``visibility``; how many rows it still holds."""
        params = {"dbt_token": token, **self.time.plus_params(visibility)}
        return int(conn.execute(self._prepared("extend"), params).rowcount)

    # --- settle ---------------------------------------------------------------------

    def _owned_keys(self, conn: Connection, token: str, keys: Sequence[Key]) -> set[Key]:
        """The keys still held by ``token``, locked until the transaction ends.

        MariaDB/MySQL only: the one instant at which the settlement judges the
        claim (token, status and expiry); the writes that follow rely on the lock.
        """
        params = {"dbt_token": token, "dbt_keys": self._keys_value(keys)}
        return {tuple(r) for r in conn.execute(self._prepared("owned"), params).all()}

    def _apply(
        self,
        conn: Connection,
        name: str,
        token: str,
        keys: Sequence[Key],
        extra: Mapping[str, Any] | None = None,
    ) -> set[Key]:
        """Run the fenced statement ``name`` on ``keys``; the keys it changed."""
        if not keys:
            return set()
        params = {"dbt_token": token, "dbt_keys": self._keys_value(keys), **(extra or {})}
        result = conn.execute(self._prepared(name), params)
        if not self._mysql:
            return {tuple(r) for r in result.all()}
        # MariaDB/MySQL: the keys were locked and checked first.
        changed = int(result.rowcount)
        if changed != len(keys):
            # Cannot happen while the rows are locked; if it ever does, the
            # report would not be what was written: roll the settlement back
            # (the claim expires and the rows are delivered again).
            raise CommitError(
                f"settlement matched {changed} of {len(keys)} locked row(s) of "
                f"{self.table.name}; rolled back, the rows are claimed again"
            )
        return set(keys)

    def settle(
        self,
        conn: Connection,
        *,
        token: str,
        done: Sequence[Key],
        retry: Sequence[RetryItem],
        dead: Sequence[DeadItem],
        delete_done: bool,
    ) -> Settled:
        """Finish a claim's rows; keys whose claim was lost are left untouched."""
        if self._mysql:
            everything = [*done, *(r.key for r in retry), *(d.key for d in dead)]
            owned = self._owned_keys(conn, token, everything) if everything else set()
            done = [k for k in done if k in owned]
            retry = [r for r in retry if r.key in owned]
            dead = [d for d in dead if d.key in owned]
        done_keys = self._apply(conn, "done_delete" if delete_done else "done", token, done)
        retried: set[Key] = set()
        for item in retry:
            extra = {"dbt_error": item.error, **self.time.plus_params(item.delay_seconds)}
            retried |= self._apply(conn, "retry", token, [item.key], extra)
        died: set[Key] = set()
        for gone in dead:
            died |= self._apply(conn, "dead", token, [gone.key], {"dbt_error": gone.error})
        return Settled(frozenset(done_keys), frozenset(retried), frozenset(died))

    # --- operations -----------------------------------------------------------------

    def counts(self, conn: Connection) -> QueueCounts:
        c = self.table.c
        by_status = {
            str(status): int(n)
            for status, n in conn.execute(
                sa.select(c[STATUS], sa.func.count())
                .where(self._filtered(sa.true()))
                .group_by(c[STATUS])
            )
        }
        now = self.time.now()
        ready_now = conn.execute(
            sa.select(sa.func.count(), sa.func.max(self.time.age_seconds(c[VISIBLE_AT]))).where(
                self.claimable()
            )
        ).one()
        delayed = conn.execute(
            sa.select(sa.func.count()).where(
                self._filtered(c[STATUS] == READY, c[VISIBLE_AT] > now)
            )
        ).scalar_one()
        expired = conn.execute(
            sa.select(sa.func.count()).where(
                self._filtered(c[STATUS] == CLAIMED, c[VISIBLE_AT] <= now)
            )
        ).scalar_one()
        age = ready_now[1]
        return QueueCounts(
            by_status={s: by_status.get(s, 0) for s in (READY, CLAIMED, DONE, DEAD)}
            | {k: v for k, v in by_status.items() if k not in (READY, CLAIMED, DONE, DEAD)},
            claimable_now=int(ready_now[0]),
            delayed=int(delayed),
            expired_claims=int(expired),
            oldest_ready_age_seconds=None if age is None else max(0.0, float(age)),
        )

    def redrive_dead(self, conn: Connection, *, note: str, limit: int | None, dry_run: bool) -> int:
        """Make dead rows ready again with their attempts reset; how many."""
        c = self.table.c
        dead = self._filtered(c[STATUS] == DEAD)
        if dry_run or limit is not None:
            pick = sa.select(*self._key_cols).where(dead).order_by(*self._key_cols)
            if limit is not None:
                pick = pick.limit(limit)
            keys = [tuple(r) for r in conn.execute(pick)]
            if dry_run or not keys:
                return len(keys)
            where = sa.and_(self._key_in(keys), c[STATUS] == DEAD)
        else:
            where = dead
        previous = sa.func.coalesce(c[LAST_ERROR], "")
        stmt = (
            sa.update(self.table)
            .where(where)
            .values(
                {
                    STATUS: READY,
                    ATTEMPTS: 0,
                    CLAIM_TOKEN: None,
                    DONE_AT: None,
                    VISIBLE_AT: self.time.now(),
                    LAST_ERROR: sa.func.substr(sa.literal(note, sa.String) + previous, 1, 2000),
                }
            )
        )
        return int(conn.execute(stmt).rowcount)

    def prune_keys(
        self,
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
        c = self.table.c
        where = [c[STATUS].in_(list(statuses)), c[DONE_AT] < cutoff]
        if after is not None:
            if len(self._key_cols) == 1:
                where.append(self._key_cols[0] > after[0])
            else:
                where.append(sa.tuple_(*self._key_cols) > sa.tuple_(*after))
        stmt = (
            sa.select(*self._key_cols)
            .where(self._filtered(*where))
            .order_by(*self._key_cols)
            .limit(limit)
        )
        return [tuple(r) for r in conn.execute(stmt)]

    def delete_finished(
        self, conn: Connection, keys: Sequence[Key], statuses: Sequence[str]
    ) -> int:
        c = self.table.c
        stmt = sa.delete(self.table).where(self._key_in(keys), c[STATUS].in_(list(statuses)))
        return int(conn.execute(stmt).rowcount)
