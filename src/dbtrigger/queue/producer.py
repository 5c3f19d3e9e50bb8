"""The producer's side of a queue: enqueue rows (now, later, with a priority), cancel them.

Producers may simply ``INSERT`` rows: the claim columns' defaults make a new
row ``ready`` and due at once. :meth:`ClaimSource.enqueue
<dbtrigger.queue.source.ClaimSource.enqueue>` (and ``dbtrigger queue add``)
does that insert and also sets what plain SQL would have to know the claim
columns for:

* **scheduled jobs** - ``run_after`` sets ``dbt_visible_at``, the column a
  claim already compares with the database's clock. A row scheduled for later
  is an ordinary ``ready`` row that is not due yet: it sits after the due
  range of the claim index, so a million of them cost a claim nothing;
* **priority** - ``dbt_priority`` on a table installed with ``queue install
  --priority``; claims take the highest priority first (see
  :mod:`dbtrigger.queue.statements`).

:func:`cancel` (``dbtrigger queue cancel``) takes rows off the queue before
they run: a ``ready`` row (due, scheduled, or waiting for a retry) and a row
whose claim expired become ``canceled``, a final status like ``done`` (pruned
with it, re-driven only by hand). A row a worker holds right now is left
alone and reported as running: its handler is already at work, and its
settlement would not be fenced out in time to stop it. A canceled row keeps
the reason in ``dbt_last_error``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Union

import sqlalchemy as sa

from dbtrigger._driver_errors import failed_as, short_error
from dbtrigger.errors import CommitError, ConfigurationError, OutputConstraintError
from dbtrigger.queue.schema import (
    CANCELED,
    CLAIM_TOKEN,
    CLAIMED,
    DONE_AT,
    ERROR_LIMIT,
    LAST_ERROR,
    PREFIX,
    PRIORITY,
    READY,
    STATUS,
    VISIBLE_AT,
)
from dbtrigger.state.stores.sql import is_duplicate_key

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from sqlalchemy.engine import Connection

    from dbtrigger.queue.layout import ClaimLayout, QueueTable
    from dbtrigger.queue.schema import DialectTime
    from dbtrigger.queue.statements import ClaimTable


class Queue(Protocol):
    """What :func:`enqueue` and :func:`cancel` ask of the queue: a
    :class:`~dbtrigger.queue.source.ClaimSource`, which offers them as methods."""

    pk_columns: tuple[str, ...]
    layout: ClaimLayout

    @property
    def name(self) -> str: ...

    @property
    def time(self) -> DialectTime: ...

    @property
    def target(self) -> ClaimTable: ...

    @property
    def queue_table(self) -> QueueTable: ...

    def transaction(self, *, locking: bool = False) -> AbstractContextManager[Connection]: ...


#: When enqueued rows become due: an aware datetime, a delay (seconds or a
#: timedelta, on the database's clock), or None for now.
RunAfter = Union[dt.datetime, dt.timedelta, float, int, None]  # noqa: UP007 - runtime alias

#: ``dbt_priority`` is a 32-bit integer column.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def enqueue(
    source: Queue,
    rows: Iterable[Mapping[str, Any]],
    *,
    run_after: RunAfter = None,
    priority: int | None = None,
) -> int:
    """Insert ``rows`` into the queue table in one transaction; how many.

    Raises:
        ConfigurationError: a row names a claim column or a column the table
            does not have, ``run_after`` is a naive datetime or not a time,
            ``priority`` is not a whole number or the table has no
            ``dbt_priority``, or the queue is in sidecar mode and scheduling or
            a priority was asked for (the feeder decides when its rows are due).
        OutputConstraintError: a row's key is in the table already (nothing was
            inserted; the message says how to run that row again).
        CommitError: the insert failed otherwise (nothing was inserted).
    """
    items = [dict(row) for row in rows]
    queue = source.queue_table  # the table is checked first
    user = queue.user
    columns_mode = source.layout.claims_table is None
    for row in items:
        claim = sorted(k for k in row if k.lower().startswith(PREFIX))
        if claim:
            raise ConfigurationError(
                f"rows to enqueue must not set claim columns ({', '.join(claim)}): use "
                "run_after= and priority= (the claim manages the others)"
            )
        unknown = sorted(k for k in row if k not in user.c)
        if unknown:
            raise ConfigurationError(
                f"{user.name} has no column(s) {', '.join(unknown)}; "
                f"available: {', '.join(c.name for c in user.c if not c.name.startswith(PREFIX))}"
            )
    values: dict[str, Any] = {}
    params: dict[str, Any] = {}
    if (run_after is not None or priority is not None) and not columns_mode:
        raise ConfigurationError(
            "run_after= and priority= set claim columns, which a sidecar queue keeps in "
            "its claims table, filled by the feeder: enqueue plain rows, or use "
            "mode='columns' for scheduled and prioritised jobs"
        )
    if run_after is not None:
        values[VISIBLE_AT], params = _due(source, run_after)
    elif columns_mode and source.time.dialect == "sqlite":
        # SQLite's column default is the epoch (it cannot default to an
        # expression on ALTER TABLE): date the row now, so its age is real.
        values[VISIBLE_AT], params = _due(source, 0)
    if priority is not None:
        if PRIORITY not in user.c:
            raise ConfigurationError(
                f"{user.name} has no {PRIORITY} column: add it with\n"
                f"  {queue.install_hint} --priority --yes"
            )
        values[PRIORITY] = _priority(priority)
    if not items:
        return 0
    statement = sa.insert(user).values(values) if values else sa.insert(user)
    failed = f"enqueueing {len(items)} row(s) into {source.name} failed"
    try:
        with failed_as(CommitError, failed, "; nothing was inserted"), source.transaction() as conn:
            if params:
                conn.execute(statement, [{**row, **params} for row in items])
            else:
                conn.execute(statement, items)
    except CommitError as exc:
        cause = exc.__cause__
        if isinstance(cause, sa.exc.IntegrityError) and is_duplicate_key(cause):
            raise _already_queued(failed, cause, columns_mode, user.name) from cause
        raise
    return len(items)


def _already_queued(
    failed: str, cause: Exception, columns_mode: bool, table: str
) -> OutputConstraintError:
    """A key that is in the table already: not retryable (inserting it again fails
    again), and a queue row is its job, so say how to run that row again."""
    again = (
        "make that row ready again instead (UPDATE it with dbt_status = 'ready', "
        "dbt_visible_at = the database's UTC now, dbt_claim_token = NULL, dbt_attempts = 0)"
        if columns_mode
        else "update that row instead, moving its cursor column (a new version is a new job)"
    )
    return OutputConstraintError(
        f"{failed}: a row with one of these keys is already in the table "
        f"({short_error(cause)}); nothing was inserted. To run a job again, {again}: "
        "see docs/queues.md#running-a-row-again",
        table=table,
        kind="unique",
    )


def _due(source: Queue, run_after: RunAfter) -> tuple[Any, dict[str, Any]]:
    """``dbt_visible_at``'s value for ``run_after``, and the parameters it needs."""
    time = source.time
    if isinstance(run_after, dt.datetime):
        if run_after.tzinfo is None:
            raise ConfigurationError(
                f"run_after={run_after.isoformat()} has no time zone: give an aware datetime "
                "(e.g. with tzinfo=datetime.timezone.utc), or a delay in seconds"
            )
        if run_after >= _LATEST:
            raise _too_late(run_after.isoformat())
        return time.at(run_after), {}
    if isinstance(run_after, dt.timedelta):
        seconds = run_after.total_seconds()
    elif isinstance(run_after, (int, float)) and not isinstance(run_after, bool):
        seconds = float(run_after)
    else:
        raise ConfigurationError(
            f"run_after must be an aware datetime, a timedelta or seconds, got {run_after!r}"
        )
    if not math.isfinite(seconds):
        raise ConfigurationError(f"run_after must be a finite delay, got {run_after!r}")
    if seconds >= (_LATEST - dt.datetime.now(dt.timezone.utc)).total_seconds():
        raise _too_late(f"{seconds:g} s from now")
    return time.plus(0), time.plus_params(seconds)


#: The latest ``run_after``: finished rows carry 9999-12-31 in ``dbt_visible_at``, so
#: a row due then is taken for one made ready by hand (stranded), and later ones
#: overflow the column (MariaDB, SQLite) or Python's datetime (PostgreSQL).
_LATEST = dt.datetime(9999, 1, 1, tzinfo=dt.timezone.utc)


def _too_late(when: str) -> ConfigurationError:
    return ConfigurationError(
        f"run_after={when} is due after {_LATEST:%Y-%m-%d}: a claim queue keeps "
        "9999-12-31 for finished rows; schedule it earlier"
    )


def _priority(priority: Any) -> int:
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigurationError(f"priority must be a whole number, got {priority!r}")
    if not low <= priority <= high:
        raise ConfigurationError(f"priority must be between {low} and {high}, got {priority}")
    return priority


@dataclass(frozen=True)
class Canceled:
    """What :func:`cancel` did (or, in a dry run, would do), key by key.

    ``canceled``: rows taken off the queue. ``running``: rows a worker holds
    now (left alone). ``finished``: rows already done, dead or canceled.
    ``missing``: keys the queue does not have.
    """

    canceled: list[dict[str, Any]] = field(default_factory=list)
    running: list[dict[str, Any]] = field(default_factory=list)
    finished: list[dict[str, Any]] = field(default_factory=list)
    missing: list[dict[str, Any]] = field(default_factory=list)


def cancel(source: Queue, keys: Iterable[Any], *, reason: str, dry_run: bool = False) -> Canceled:
    """Cancel the rows with these keys that have not started (see the module doc).

    Raises:
        ConfigurationError: a key does not name every key column (or a bare
            value was given for a key of several columns).
        CommitError: the update failed (nothing was changed).
    """
    pks = [_as_pk(source.pk_columns, key) for key in keys]
    if not pks:
        return Canceled()
    target = source.target
    table = target.table
    c = table.c
    match = source.layout.match_user_keys(target, pks, source.pk_columns)
    now = target.time.now()
    pending = sa.or_(c[STATUS] == READY, sa.and_(c[STATUS] == CLAIMED, c[VISIBLE_AT] <= now))
    ident = source.layout.user_key_columns(target)
    note = f"canceled: {reason}"[:ERROR_LIMIT]
    failed = f"canceling rows of {source.name} failed"
    with (
        failed_as(CommitError, failed, "; nothing was changed"),
        source.transaction(locking=True) as conn,
    ):
        found = conn.execute(
            sa.select(*ident, c[STATUS], sa.case((pending, 1), else_=0).label("dbt_pending"))
            .where(target.filtered(match))
            .with_for_update()
        ).all()
        result = Canceled()
        by_key: dict[str, str] = {}
        for row in found:
            pk = source.layout.user_pk(row[: len(ident)], source.pk_columns)
            text = _key_text(pk)
            state = "canceled" if row[-1] else ("running" if row[-2] == CLAIMED else "finished")
            # A sidecar row may have several versions: one pending one is enough.
            if by_key.get(text) != "canceled":
                by_key[text] = state
        for pk in pks:
            text = _key_text(pk)
            getattr(result, by_key.get(text, "missing")).append(pk)
        if not dry_run and result.canceled:
            conn.execute(
                sa.update(table)
                .where(target.filtered(match, pending))
                .values(
                    {
                        STATUS: CANCELED,
                        CLAIM_TOKEN: None,
                        DONE_AT: now,
                        VISIBLE_AT: target.time.far_future(),
                        LAST_ERROR: note,
                    }
                )
            )
        return result


def _as_pk(pk_columns: Sequence[str], key: Any) -> dict[str, Any]:
    if isinstance(key, Mapping):
        if set(key) != set(pk_columns):
            raise ConfigurationError(
                f"a key must name exactly the key columns {list(pk_columns)}, got {sorted(key)}"
            )
        return {name: key[name] for name in pk_columns}
    if len(pk_columns) != 1:
        raise ConfigurationError(
            f"the key has {len(pk_columns)} columns {list(pk_columns)}: give each key as a "
            f"mapping, not {key!r}"
        )
    return {pk_columns[0]: key}


def _key_text(pk: Mapping[str, Any]) -> str:
    return json.dumps({k: str(v) for k, v in pk.items()}, sort_keys=True)


__all__ = [
    "PRIORITY_RANGE",
    "Canceled",
    "Queue",
    "RunAfter",
    "cancel",
    "enqueue",
]
