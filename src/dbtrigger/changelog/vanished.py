"""Rows that left the table with no delete logged: a ``TRUNCATE`` the triggers never saw.

A ``TRUNCATE`` fires no row trigger. PostgreSQL logs it with a statement
trigger; MariaDB/MySQL have none, and there a foreign key's ``ON DELETE
CASCADE`` fires no trigger either. The log's readers then keep those rows for
ever. What can be found cheaply is found here: the latest change of each key
among the last :data:`WINDOW` log rows (back to the last ``truncate`` marker,
or to a row logged without its key, which ``ChangeLogGapError`` reports)
says whether the key should be in the table; a key that should be and is not
has vanished. Two reads by key, bounded by the window, as often as the drift
check runs (``drift_check_seconds``).

A delete that commits between the two reads is not taken for a vanished row:
the keys found missing are read again in the log after the window began, and
a later change of the key explains it. Rows deleted unlogged further back
than the window, or a truncate followed by more than :data:`WINDOW` changes,
are not found: the check makes a silent loss loud, it does not audit the log.

``dbtrigger changelog resync`` (:func:`dbtrigger.changelog.snapshot.resync`)
is the repair: a ``truncate`` marker (readers drop what they hold) followed by
a snapshot of every row the table holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from dbtrigger._engine import reflect_table
from dbtrigger.changelog.ddl import TableInfo

#: Log rows (the newest) whose keys are checked against the table.
WINDOW = 500

#: Keys one existence query asks for.
_CHUNK = 200


def vanished_keys(
    conn: sa.Connection, info: TableInfo, log_keys: Sequence[str]
) -> list[tuple[Any, ...]]:
    """Keys the log's newest rows leave in the table that the table no longer holds."""
    key_names = [c.name for c in info.pk]
    if list(log_keys) != key_names:
        return []  # the key drifted: reported as such, not compared
    log = sa.table(
        info.log_table,
        sa.column("dbt_seq", sa.BigInteger()),
        sa.column("dbt_op"),
        *(sa.column(k) for k in key_names),
        schema=info.schema,
    )
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


__all__ = ["WINDOW", "vanished_keys"]
