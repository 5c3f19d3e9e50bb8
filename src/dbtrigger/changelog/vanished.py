"""Rows that left the table with no delete logged: a ``TRUNCATE`` the triggers never saw.

A ``TRUNCATE`` fires no row trigger. PostgreSQL logs it with a statement
trigger; MariaDB/MySQL have none, and there a foreign key's ``ON DELETE
CASCADE`` fires no trigger either (nor, on SQLite, the rows an ``INSERT OR
REPLACE`` removes). The log's readers then keep those rows for ever. Two checks
find them, each keyed by the latest change of each key the log holds (back to
the last ``truncate`` marker, or to a row logged without its key, which
``ChangeLogGapError`` reports): a key whose latest change left it in the table,
but which the table no longer holds, has vanished.

* :func:`vanished_keys` without ``whole_log``: the newest :data:`WINDOW` log rows,
  two reads by key, cheap enough for every drift check.
* with ``whole_log``: every key the log holds, in one statement (the log's latest
  change per key, joined with the table by its key), one pass over the log. The
  window alone missed a ``TRUNCATE`` followed by more than :data:`WINDOW`
  changes (a reload), and rows whose last change was further back: a truncated
  table of 1,000 rows reloaded with 600 of them kept the other 400 in every
  reader, silently. The source runs it at its first drift check (one interval
  later for a log of more than :data:`AT_ONCE_ROWS`) and then as often as
  :data:`WHOLE_LOG_SHARE` of the time allows; ``changelog check`` and
  ``dbtrigger check`` always.

A delete that commits between the window's two reads is not taken for a
vanished row: the keys found missing are read again in the log after the window
began, and a later change of the key explains it (the whole-log check is one
statement, so one snapshot). What no check can find is a key whose log rows are
all gone: pruned (``changelog prune``), or logged before the log was installed
and never snapshot.

``dbtrigger changelog resync`` (:func:`dbtrigger.changelog.snapshot.resync`)
is the repair: a ``truncate`` marker (readers drop what they hold) followed by
a snapshot of every row the table holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from dbtrigger._engine import reflect_table
from dbtrigger.changelog.ddl import TableInfo, log_table_name

#: Log rows (the newest) whose keys are checked against the table.
WINDOW = 500

#: Keys one existence query asks for.
_CHUNK = 200

#: The share of a source's time the whole-log check may take: after a check that
#: took d seconds, the next waits at least 1/share times d (and a drift interval).
WHOLE_LOG_SHARE = 0.01

#: A log of at most this many rows is checked whole at a poller's first drift check
#: (measured: 460,000 rows took 2.6 s on PostgreSQL, 2.2 s on MariaDB); a larger one
#: one drift interval later, so that a cold start does not wait for it.
AT_ONCE_ROWS = 100_000


def log_span(conn: sa.Connection, table: str, schema: str | None) -> int:
    """How many rows the log of ``table`` spans at most (its highest sequence number
    less its lowest): two reads of its primary key's index."""
    log = sa.table(log_table_name(table), sa.column("dbt_seq", sa.BigInteger()), schema=schema)
    seq = log.c.dbt_seq
    try:
        low, high = conn.execute(sa.select(sa.func.min(seq), sa.func.max(seq))).one()
    except sa.exc.DBAPIError:  # no log: the drift check that follows says so
        conn.rollback()
        return 0
    return 0 if low is None else int(high) - int(low) + 1


def vanished_keys(
    conn: sa.Connection, info: TableInfo, log_keys: Sequence[str], *, whole_log: bool = False
) -> list[tuple[Any, ...]]:
    """Keys the log's newest rows (``whole_log``: any of its rows) leave in the table
    that the table no longer holds."""
    key_names = [c.name for c in info.pk]
    if list(log_keys) != key_names:
        return []  # the key drifted: reported as such, not compared
    gone = _in_window(conn, info, key_names)
    if gone or not whole_log:
        return gone
    return _in_whole_log(conn, info, key_names)


def _log(info: TableInfo, key_names: Sequence[str]) -> sa.TableClause:
    return sa.table(
        info.log_table,
        sa.column("dbt_seq", sa.BigInteger()),
        sa.column("dbt_op"),
        sa.column("dbt_changed_at"),
        *(sa.column(k) for k in key_names),
        schema=info.schema,
    )


def _in_window(
    conn: sa.Connection, info: TableInfo, key_names: Sequence[str]
) -> list[tuple[Any, ...]]:
    log = _log(info, key_names)
    keys = [log.c[k] for k in key_names]
    rows = conn.execute(
        sa.select(log.c.dbt_seq, log.c.dbt_op, *keys).order_by(log.c.dbt_seq.desc()).limit(WINDOW)
    ).all()
    latest: dict[tuple[Any, ...], tuple[Any, str]] = {}
    for seq, op, *values in rows:
        if op == "truncate":
            break  # everything before it was gone already
        key = tuple(values)
        if any(v is None for v in key):
            break  # a change the trigger could not key: ChangeLogGapError's, and it hides keys
        latest.setdefault(key, (seq, op))
    expected = [k for k, (_, op) in latest.items() if op != "delete"]
    if not expected:
        return []
    # Reflected, so that the keys are bound in the table's own types (a key widened to
    # bigint past 2^31 is not bound as an integer).
    table = reflect_table(conn, info.table, info.schema)
    columns = [table.c[k] for k in key_names]
    found: set[tuple[Any, ...]] = set()
    for start in range(0, len(expected), _CHUNK):
        part = expected[start : start + _CHUNK]
        where = (
            columns[0].in_([k[0] for k in part])
            if len(columns) == 1
            else sa.tuple_(*columns).in_(part)
        )
        found.update(tuple(r) for r in conn.execute(sa.select(*columns).where(where)))
    missing = [k for k in expected if k not in found]
    if not missing:
        return []
    # Changed since the window was read (a delete that committed in between)?
    since = min(latest[k][0] for k in missing)
    later = conn.execute(sa.select(log.c.dbt_seq, *keys).where(log.c.dbt_seq > since)).all()
    changed = {
        tuple(values) for seq, *values in later if seq > latest.get(tuple(values), (seq,))[0]
    }
    return [k for k in missing if k not in changed]


def _in_whole_log(
    conn: sa.Connection, info: TableInfo, key_names: Sequence[str]
) -> list[tuple[Any, ...]]:
    """Up to :data:`WINDOW` keys whose latest change in the log (after its last
    ``truncate`` or unkeyed row) is not a delete and that the table does not hold:
    one statement, so the log and the table are read in one snapshot."""
    log = _log(info, key_names)
    keys = [log.c[k] for k in key_names]
    # Everything at or before the last truncate marker was gone already; a row logged
    # without its key may be any key's delete (ChangeLogGapError reports it).
    marks = _log(info, key_names).alias("marks")
    floor = (
        sa.select(sa.func.coalesce(sa.func.max(marks.c.dbt_seq), 0))
        .where(sa.or_(marks.c.dbt_op == "truncate", *(marks.c[k].is_(None) for k in key_names)))
        .scalar_subquery()
    )
    latest = (
        sa.select(sa.func.max(log.c.dbt_seq).label("seq"))
        .where(log.c.dbt_seq > floor)
        .group_by(*keys)
        .subquery("latest")
    )
    last = _log(info, key_names).alias("last_change")
    table = reflect_table(conn, info.table, info.schema)
    held = sa.and_(*(table.c[k] == last.c[k] for k in key_names))
    rows = conn.execute(
        sa.select(*(last.c[k] for k in key_names))
        .select_from(last.join(latest, last.c.dbt_seq == latest.c.seq))
        .where(last.c.dbt_op != "delete")
        .where(~sa.exists().where(held))
        .order_by(last.c.dbt_seq)
        .limit(WINDOW)
    ).all()
    return [tuple(r) for r in rows]


def unlogged_since_truncate(
    conn: sa.Connection, info: TableInfo, log_keys: Sequence[str]
) -> list[tuple[Any, ...]]:
    """Up to :data:`WINDOW` keys the table holds with no change logged after the log's
    last ``truncate`` row (none: no truncate row, or rows logged without a key after it).

    Readers drop every row at a truncate, so each row the table holds must have been
    logged after it: inserted since (PostgreSQL's ``TRUNCATE``), or written by the
    snapshot of ``changelog resync``. A row that was not is gone from every reader: a
    resync that stopped part-way (it commits its truncate row, then the table chunk
    by chunk), or a row written while the triggers were missing."""
    key_names = [c.name for c in info.pk]
    if list(log_keys) != key_names:
        return []
    log = _log(info, key_names)
    floor = conn.execute(
        sa.select(sa.func.max(log.c.dbt_seq)).where(log.c.dbt_op == "truncate")
    ).scalar()
    if floor is None:
        return []
    after = log.c.dbt_seq > floor
    if conn.execute(
        sa.select(log.c.dbt_seq).where(after, sa.or_(*(log.c[k].is_(None) for k in key_names)))
    ).first():
        return []  # a change the trigger could not key: ChangeLogGapError's
    logged = sa.select(*(log.c[k] for k in key_names)).where(after).distinct().subquery("logged")
    table = reflect_table(conn, info.table, info.schema)
    found = sa.and_(*(logged.c[k] == table.c[k] for k in key_names))
    rows = conn.execute(
        sa.select(*(table.c[k] for k in key_names))
        .where(~sa.exists().where(found))
        .order_by(*(table.c[k] for k in key_names))
        .limit(WINDOW)
    ).all()
    if rows and _resync_may_run(conn, log, floor):
        return []  # a resync still writing its chunks: not stopped (yet)
    return [tuple(r) for r in rows]


#: A resync whose truncate row or latest snapshot row is younger than this may still be
#: writing its chunks (a chunk waits at most 30 s for a lock): its rows are not missing yet.
RESYNC_GRACE_SECONDS = 120


def _resync_may_run(conn: sa.Connection, log: sa.TableClause, floor: int) -> bool:
    """Was the truncate row at ``floor``, or a snapshot row after it, written within
    :data:`RESYNC_GRACE_SECONDS`, by the database's clock?"""
    newest = (
        sa.select(sa.func.max(log.c.dbt_changed_at))
        .where(log.c.dbt_seq >= floor, log.c.dbt_op.in_(("truncate", "upsert")))
        .scalar_subquery()
    )
    grace = int(RESYNC_GRACE_SECONDS)
    dialect = conn.dialect.name
    if dialect == "postgresql":
        cutoff: Any = sa.literal_column(f"clock_timestamp() - interval '{grace} seconds'")
    elif dialect == "sqlite":
        cutoff = sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", f"-{grace} seconds")
    else:
        cutoff = sa.literal_column(f"CURRENT_TIMESTAMP(6) - INTERVAL {grace} SECOND")
    return bool(conn.execute(sa.select(newest > cutoff)).scalar())


__all__ = [
    "AT_ONCE_ROWS",
    "WHOLE_LOG_SHARE",
    "WINDOW",
    "log_span",
    "unlogged_since_truncate",
    "vanished_keys",
]
