"""A change log numbered again below a poller's checkpoint (internal).

A change log poller's checkpoint is a log sequence number. ``changelog
uninstall --drop-log`` and ``install`` (what docs/changes.md says to do when a
key's columns change), a log dropped by hand and installed again, or a
``TRUNCATE`` of the log on MariaDB/MySQL (which restarts ``AUTO_INCREMENT``)
give a log whose numbers start again at 1, below the checkpoint: the poller
read after its old position and went past every change up to it without a word.

In one log the numbers only grow, and a prune removes its oldest rows only, so
a log that still holds rows holds one at or past every position a reader
reached in it. When its highest number is below the checkpoint, the log is
another one: :func:`refuse_renumbered` refuses, before anything is read, at
the poller's first fetch and at every drift check (``drift_check_seconds``).
A new log that has already passed the old checkpoint by then cannot be told
apart by its numbers (on PostgreSQL the log table's oid tells it at once, see
:mod:`dbtrigger.sources.table_identity`).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger.changelog.ddl import log_table_name
from dbtrigger.errors import SourceDefinitionError


def refuse_renumbered(engine: Engine, table: str, schema: str | None, seq: int) -> None:
    """Raise when the log of ``table`` holds rows and all of them are below ``seq``
    (a checkpoint past 0); one index read of the log's highest number. A log that
    cannot be read is left to the fetch that follows, which says why."""
    if seq <= 0:
        return
    name = log_table_name(table)
    log = sa.table(name, sa.column("dbt_seq", sa.BigInteger()), schema=schema)
    try:
        with engine.connect() as conn:
            highest = conn.execute(sa.select(sa.func.max(log.c.dbt_seq))).scalar()
    except sa.exc.SQLAlchemyError:
        return
    if highest is None or highest >= seq:
        return
    raise SourceDefinitionError(
        f"the change log of {table} ({name}) ends at sequence {highest}, before this "
        f"poller's checkpoint at {seq}: the log was dropped and installed again (changelog "
        "uninstall --drop-log, or a TRUNCATE of the log, which restarts its numbering on "
        "MariaDB/MySQL), or the checkpoint was set past it. Its changes up to sequence "
        f"{seq} would never be read. Nothing was read and the checkpoint stays. Read the "
        "new log from its start: `dbtrigger reset <poller> --to-beginning --reason ... --yes`; "
        "changes made while no log was installed were not logged (`dbtrigger changelog "
        "snapshot` sends every row again)",
        table=table,
        log_table=name,
        highest_seq=highest,
        checkpoint_seq=seq,
    )


__all__ = ["refuse_renumbered"]
