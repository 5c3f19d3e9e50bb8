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
  then the same ``SELECT`` and ``UPDATE`` as MariaDB.

Which of the picked rows a claim takes is :func:`dbtrigger.queue.pick.choose`:
all fresh rows, unless the pick is led by rows of an expired claim (bisected)
or a waiting group. MariaDB and SQLite apply it between their two statements;
PostgreSQL's one statement claims only when a fresh row leads. Otherwise the
source claims the group in a transaction of its own
(:meth:`ClaimTable.claim_group`) that locks every row still in it first: a
pick skips rows a concurrent pick locked, so it may see part of the group, and
an expired claim of several rows seen as one would *isolate* a row that merely
shared it.

A table with ``dbt_priority`` is claimed one priority at a time, highest
first (:meth:`ClaimTable.claim_by_priority`).

Settling is fenced: every completion, retry, dead-marking and extension
matches ``key AND dbt_claim_token = :token AND dbt_status = 'claimed' AND
dbt_visible_at > now``. A row whose claim expired (whether or not another
worker has taken it since) no longer matches, and the method reports it as
*lost* instead of overwriting the newer claim's result.

A claim is judged held or expired at exactly one instant per settlement, and
the report is what was written at that instant. PostgreSQL and SQLite: the
fenced ``UPDATE``/``DELETE ... RETURNING key`` is one statement with one clock
reading. MariaDB/MySQL (no ``RETURNING``): ``SELECT key ... FOR UPDATE`` with
the full fence locks the rows the claim still holds (the instant); the writes
that follow match those keys by key, token and status without reading the
clock again (the lock keeps every other claimer off them), since a second
reading could find the claim expired and leave rows reported done to be
completed again elsewhere (issue #12). Each write's row count must equal the
number of keys it was given, or the transaction is rolled back.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from dbtrigger.errors import CommitError
from dbtrigger.queue.items import ClaimBatch, DeadItem, Key, RetryItem, Settled
from dbtrigger.queue.pick import Choice, Picked, choose, is_fresh
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
    PRIORITY,
    READY,
    STATUS,
    VISIBLE_AT,
    DialectTime,
)

#: Labels of what the PostgreSQL claim's pick carries besides the key (key
#: columns may not start with ``dbt_``, so they cannot clash).
_WAS = "dbt_pick_status"
_WAS_TOKEN = "dbt_pick_token"  # noqa: S105 - a column label
_WAS_AT = "dbt_pick_at"
_PICKED = "dbt_picked"


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
        #: The table has ``dbt_priority``: claims take higher priorities first.
        self.priority = PRIORITY in table.c

    # --- predicates -----------------------------------------------------------------

    @property
    def key_columns(self) -> list[sa.Column[Any]]:
        return self._key_cols

    def filtered(self, *clauses: ColumnElement[bool]) -> ColumnElement[bool]:
        parts = list(clauses)
        if self.filter is not None:
            parts.append(self.filter)
        return sa.and_(*parts)

    def claimable(self) -> ColumnElement[bool]:
        c = self.table.c
        return self.filtered(c[STATUS].in_(CLAIMABLE), c[VISIBLE_AT] <= self.time.now())

    def key_of(self, row: Mapping[str, Any]) -> Key:
        return tuple(row[k] for k in self.key)

    def key_in(self, keys: Sequence[Key]) -> ColumnElement[bool]:
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
    # Built once per table (SQLAlchemy compiles a statement object once); what
    # changes per batch travels as parameters. Building them per call cost about
    # a millisecond of client CPU per batch.

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

    def _claim_values(self, attempts: int = 1) -> dict[str, Any]:
        """A claim's writes; ``attempts`` added to ``dbt_attempts`` (0: the half of
        an expired claim of several rows, whose shared expiry is given back)."""
        c = self.table.c
        return {
            STATUS: CLAIMED,
            CLAIM_TOKEN: sa.bindparam("dbt_token", type_=sa.String),
            CLAIMED_BY: sa.bindparam("dbt_worker", type_=sa.String),
            ATTEMPTS: c[ATTEMPTS] + attempts,
            VISIBLE_AT: self.time.plus(0),
        }

    def _build_pick(self) -> Any:
        """The rows a claim may take, locked (skipping rows other claims locked);
        of one priority (``:dbt_level``) on a prioritised table."""
        where = self.claimable()
        if self.priority:
            where = sa.and_(where, self.table.c[PRIORITY] == sa.bindparam("dbt_level"))
        return (
            sa.select(self.table)
            .where(where)
            .order_by(self.table.c[VISIBLE_AT])
            .limit(sa.bindparam("dbt_limit", type_=sa.Integer))
            .with_for_update(skip_locked=True)
        )

    def _build_claim(self) -> Any:
        """PostgreSQL, one statement: ``WITH pick AS (SELECT ... SKIP LOCKED), head
        AS (its first row), claimed AS (UPDATE ... FROM pick, head WHERE both are
        fresh RETURNING *) SELECT claimed.*, (SELECT count(*) FROM pick) FROM head
        LEFT JOIN claimed``: no row when the pick was empty, one row of NULLs when
        the head was not fresh (the caller then chooses)."""
        c = self.table.c
        pick = (
            sa.select(
                *self._key_cols,
                c[STATUS].label(_WAS),
                c[CLAIM_TOKEN].label(_WAS_TOKEN),
                c[VISIBLE_AT].label(_WAS_AT),
            )
            .where(self.claimable())
            .order_by(c[VISIBLE_AT])
            .limit(sa.bindparam("dbt_limit", type_=sa.Integer))
            .with_for_update(skip_locked=True)
            .cte("dbt_pick")
        )
        head = sa.select(pick.c[_WAS], pick.c[_WAS_TOKEN]).order_by(pick.c[_WAS_AT]).limit(1)
        head_cte = head.cte("dbt_head")
        claimed = (
            sa.update(self.table)
            .where(
                *(col == pick.c[col.name] for col in self._key_cols),
                pick.c[_WAS] == READY,
                pick.c[_WAS_TOKEN].is_(None),
                sa.exists().where(head_cte.c[_WAS] == READY, head_cte.c[_WAS_TOKEN].is_(None)),
            )
            .values(self._claim_values())
            .returning(*self.table.c)
            .cte("dbt_claimed")
        )
        picked = sa.select(sa.func.count()).select_from(pick).scalar_subquery()
        return sa.select(*claimed.c, picked.label(_PICKED)).select_from(
            head_cte.outerjoin(claimed, sa.true())
        )

    def _build_level_top(self) -> Any:
        return self._level_statement(below=False)

    def _build_level(self) -> Any:
        return self._level_statement(below=True)

    def _level_statement(self, *, below: bool) -> Any:
        """The highest priority (below ``:dbt_below``) that has rows: one index probe.

        PostgreSQL and SQLite ask the partial index (claimable rows). MariaDB/MySQL
        have none, and filtering on the status would walk each priority's finished
        rows; so any row counts (a priority of finished rows costs one empty pick).
        """
        c = self.table.c
        where = [c[PRIORITY] < sa.bindparam("dbt_below", type_=sa.Integer)] if below else []
        if not self._mysql:
            where.append(c[STATUS].in_(CLAIMABLE))
        return sa.select(c[PRIORITY]).where(*where).order_by(c[PRIORITY].desc()).limit(1)

    def _build_claim_locked(self) -> Any:
        """Mark the picked rows a claim takes (they are locked by the pick)."""
        return sa.update(self.table).where(self._keys_param()).values(self._claim_values())

    def _build_claim_half(self) -> Any:
        return sa.update(self.table).where(self._keys_param()).values(self._claim_values(0))

    def _build_regroup(self) -> Any:
        """Make the untried half of an expired claim a waiting group (see pick.py):
        ``ready`` under a new token, ``dbt_visible_at`` kept so it leads the next
        pick, the shared expiry's attempt given back."""
        c = self.table.c
        group = sa.bindparam("dbt_group", type_=sa.String)
        return (
            sa.update(self.table)
            .where(self._keys_param(), c[STATUS] == CLAIMED)
            .values({STATUS: READY, CLAIM_TOKEN: group, ATTEMPTS: c[ATTEMPTS] - 1})
        )

    def _build_group_keys(self) -> Any:
        """The keys of the rows in group ``:dbt_group``: a plain read, no lock waited for."""
        return sa.select(*self._key_cols).where(self._in_group())

    def _build_group(self) -> Any:
        """Those rows, still in the group and claimable, locked (waiting for a
        concurrent claim of them to end) in key order."""
        where = sa.and_(self._keys_param(), self._in_group(), self.claimable())
        return sa.select(self.table).where(where).order_by(*self._key_cols).with_for_update()

    def _in_group(self) -> ColumnElement[bool]:  # NULL-safe: 'claimed' set by hand, no token
        c = self.table.c
        return sa.and_(
            c[CLAIM_TOKEN].is_not_distinct_from(sa.bindparam("dbt_group", type_=sa.String)),
            c[STATUS] == sa.bindparam("dbt_group_status", type_=sa.String),
        )

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

    def _settling(self, values: Mapping[str, Any]) -> Any:
        """A fenced write of ``values`` onto the keys a settlement names."""
        return self._returning(sa.update(self.table).where(self._write_fence()).values(values))

    def _finishing(self, status: str, error: Any) -> Any:
        """A settlement that ends the rows' life in the queue (done, dead)."""
        time = self.time
        return self._settling(
            {STATUS: status, DONE_AT: time.now(), VISIBLE_AT: time.far_future(), LAST_ERROR: error}
        )

    def _build_done(self) -> Any:
        return self._finishing(DONE, None)

    def _build_dead(self) -> Any:
        return self._finishing(DEAD, sa.bindparam("dbt_error", type_=sa.String))

    def _build_done_delete(self) -> Any:
        return self._returning(sa.delete(self.table).where(self._write_fence()))

    def _build_retry(self) -> Any:
        return self._retrying(None)

    def _build_split(self) -> Any:
        """Rows that failed together wait as a group (see pick.py); attempt given back."""
        return self._retrying(sa.bindparam("dbt_group", type_=sa.String), refund=True)

    def _build_alone(self) -> Any:
        return self._retrying(sa.bindparam("dbt_group", type_=sa.String))

    def _retrying(self, group: Any, *, refund: bool = False) -> Any:
        values = {STATUS: READY, CLAIM_TOKEN: group, VISIBLE_AT: self.time.plus(0)}
        values[LAST_ERROR] = sa.bindparam("dbt_error", type_=sa.String)
        if refund:
            values[ATTEMPTS] = self.table.c[ATTEMPTS] - 1
        return self._settling(values)

    # --- claim ----------------------------------------------------------------------

    def claim(
        self, conn: Connection, *, limit: int, token: str, worker: str, visibility: float
    ) -> ClaimBatch | None:
        """Claim up to ``limit`` claimable rows for ``token`` (attempts counted).

        ``None`` (PostgreSQL only): the pick was led by rows of an expired claim
        or a regrouped half, and nothing was claimed; run :meth:`claim_choosing`
        in a transaction.
        """
        if self.time.dialect != "postgresql":
            return self.claim_choosing(
                conn, limit=limit, token=token, worker=worker, visibility=visibility
            )
        params = {
            "dbt_limit": limit,
            "dbt_token": token,
            "dbt_worker": worker,
            **self.time.plus_params(visibility),
        }
        result = conn.execute(self._prepared("claim"), params)
        names = [n for n in result.keys() if n != _PICKED]  # noqa: SIM118 - a Result
        fetched = result.all()
        if not fetched:
            return ClaimBatch([])
        picked = int(fetched[0][-1])
        if fetched[0][names.index(STATUS)] is None:
            return None
        rows = [dict(zip(names, r[:-1], strict=True)) for r in fetched]
        return ClaimBatch(rows, more=picked >= limit or picked > len(rows))

    def claim_by_priority(
        self, conn: Connection, *, limit: int, token: str, worker: str, visibility: float
    ) -> ClaimBatch:
        """Claim up to ``limit`` rows, highest ``dbt_priority`` first, fresh rows from
        as many priorities as it takes (an expired claim's or a group's rows alone).

        ``conn`` must be in a transaction (PostgreSQL: READ COMMITTED, the
        picks' locks last until it ends). Each priority costs one probe of the
        ``(dbt_priority, dbt_visible_at)`` index and one pick of its rows due
        now, so a claim stays O(batch + priorities) whatever is scheduled later.
        """
        rows: list[dict[str, Any]] = []
        more = False
        below: int | None = None
        while len(rows) < limit:
            if below is None:
                level = conn.execute(self._prepared("level_top")).scalar()
            else:
                level = conn.execute(self._prepared("level"), {"dbt_below": below}).scalar()
            if level is None:
                break
            batch = self.claim_choosing(
                conn,
                limit=limit - len(rows),
                token=token,
                worker=worker,
                visibility=visibility,
                level=int(level),
                fresh_only=bool(rows),
            )
            if batch.group:
                if rows:  # an expired claim leads the next priority: never mixed
                    more = True
                    break
                return batch
            rows += batch.rows
            more = more or batch.more
            below = int(level)
        return ClaimBatch(rows, more=more or len(rows) >= limit)

    def claim_choosing(
        self,
        conn: Connection,
        *,
        limit: int,
        token: str,
        worker: str,
        visibility: float,
        level: int | None = None,
        fresh_only: bool = False,
    ) -> ClaimBatch:
        """Pick and lock, :func:`~dbtrigger.queue.pick.choose`, then write the claim
        (and a regrouped half); ``conn`` must be in a transaction that holds the
        pick's locks (MariaDB/PostgreSQL) or the write lock (SQLite).

        ``level``: the priority to pick from (a prioritised table). A pick led
        by an expired claim or a regrouped half takes nothing (``group``, and its
        ``lead`` for :meth:`claim_group`, but none with ``fresh_only``).
        """
        params: dict[str, Any] = {"dbt_limit": limit}
        if self.priority:
            params["dbt_level"] = level
        picked, marks = self._locked(conn, "pick", params)
        if marks and not is_fresh(marks[0].status, marks[0].token):
            return ClaimBatch([], more=True, group=True, lead=None if fresh_only else marks[0])
        choice = choose(marks)
        rows = self._take(conn, picked, choice, token, worker, visibility)
        more = len(rows) < len(picked) or len(picked) >= limit
        return ClaimBatch(rows, more, choice.isolated, choice.bisected)

    def claim_group(
        self,
        conn: Connection,
        lead: Picked,
        *,
        limit: int,
        token: str,
        worker: str,
        visibility: float,
    ) -> ClaimBatch:
        """Claim from the group of ``lead`` (see the module doc) once every row
        still in it is locked; ``conn``'s transaction must hold no other lock
        (claimers of one group wait for each other in key order, no deadlock)."""
        group = {"dbt_group": lead.token, "dbt_group_status": lead.status}
        keys = [tuple(r) for r in conn.execute(self._prepared("group_keys"), group).all()]
        if not keys:  # another claim took the group meanwhile
            return ClaimBatch([], more=True, group=True)
        picked, marks = self._locked(conn, "group", {"dbt_keys": self._keys_value(keys), **group})
        choice = choose(marks)
        if len(choice.claim) > limit:  # a group claimed with a larger batch size
            rest = choice.regroup + choice.claim[limit:]
            choice = Choice(choice.claim[:limit], rest, bisected=choice.bisected)
        rows = self._take(conn, picked, choice, token, worker, visibility)
        return ClaimBatch(rows, True, choice.isolated, choice.bisected, group=True)

    def _locked(
        self, conn: Connection, name: str, params: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], list[Picked]]:
        """The rows statement ``name`` locked, and their claim state."""
        result = conn.execute(self._prepared(name), params)
        names = list(result.keys())
        picked = [dict(zip(names, r, strict=True)) for r in result.all()]
        return picked, [Picked(self.key_of(r), r[STATUS], r[CLAIM_TOKEN]) for r in picked]

    def _take(
        self,
        conn: Connection,
        picked: list[dict[str, Any]],
        choice: Choice,
        token: str,
        worker: str,
        visibility: float,
    ) -> list[dict[str, Any]]:
        """Write ``choice`` for the locked rows ``picked`` (the regrouped half, the
        claim); the claimed rows as written."""
        if choice.regroup:
            conn.execute(
                self._prepared("regroup"),
                {"dbt_keys": self._keys_value(choice.regroup), "dbt_group": uuid.uuid4().hex},
            )
        taken = set(choice.claim)
        rows = [r for r in picked if self.key_of(r) in taken]
        half = choice.bisected is not None  # an expired claim's half: its expiry given back
        if rows:
            params: dict[str, Any] = {"dbt_token": token, "dbt_worker": worker}
            params["dbt_keys"] = self._keys_value(choice.claim)
            params.update(self.time.plus_params(visibility))
            conn.execute(self._prepared("claim_half" if half else "claim_locked"), params)
        for row in rows:
            row.update({STATUS: CLAIMED, CLAIM_TOKEN: token, CLAIMED_BY: worker})
            row[ATTEMPTS] = int(row[ATTEMPTS]) + (0 if half else 1)
        return rows

    def extend(self, conn: Connection, *, token: str, visibility: float) -> int:
        """Push the claim's expiry to now + ``visibility``; how many rows it still holds."""
        params = {"dbt_token": token, **self.time.plus_params(visibility)}
        return int(conn.execute(self._prepared("extend"), params).rowcount)

    # --- settle ---------------------------------------------------------------------

    def _owned_keys(self, conn: Connection, token: str, keys: Sequence[Key]) -> set[Key]:
        """The keys still held by ``token``, locked until the transaction ends
        (MariaDB/MySQL: the one instant the settlement judges the claim at)."""
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
        # MariaDB/MySQL: the keys were locked and checked first, so a short count
        # cannot happen; if it does, the report would be wrong: roll back.
        changed = int(result.rowcount)
        if changed != len(keys):
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
        groups: dict[tuple[str, float, str, bool], list[Key]] = {}
        for item in retry:
            extra = {"dbt_error": item.error, **self.time.plus_params(item.delay_seconds)}
            if item.group is None:
                retried |= self._apply(conn, "retry", token, [item.key], extra)
            else:
                group = (item.group, item.delay_seconds, item.error, item.counted)
                groups.setdefault(group, []).append(item.key)
        for (group_token, delay, error, counted), keys in groups.items():
            extra = {"dbt_group": group_token, "dbt_error": error, **self.time.plus_params(delay)}
            retried |= self._apply(conn, "alone" if counted else "split", token, keys, extra)
        died: set[Key] = set()
        for gone in dead:
            died |= self._apply(conn, "dead", token, [gone.key], {"dbt_error": gone.error})
        return Settled(frozenset(done_keys), frozenset(retried), frozenset(died))


__all__ = ["ClaimBatch", "ClaimTable", "DeadItem", "Key", "RetryItem", "Settled"]
