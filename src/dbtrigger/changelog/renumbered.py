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
A new log that has already passed the checkpoint by then is told by its row at
the checkpoint's number: the checkpoint holds the key of the change it passed
there (``(dbt_seq, key)``), and a log row never changes, so a row at that
number naming another key is another log's. (Only keys read back as whole
numbers or text are compared; the row may also be gone, pruned, or a number the
new log skipped: nothing can be told then.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger.changelog.ddl import log_table_name
from dbtrigger.errors import SourceDefinitionError


def refuse_renumbered(
    engine: Engine,
    table: str,
    schema: str | None,
    seq: int,
    key: Sequence[Any] = (),
    key_columns: Sequence[str] = (),
) -> None:
    """Raise when the log of ``table`` holds rows and all of them are below ``seq``
    (a checkpoint past 0), or when its row at ``seq`` names another key than ``key``
    (the checkpoint's, in the order of ``key_columns``, the log's key columns); two
    index reads. A log that cannot be read is left to the fetch that follows, which
    says why."""
    if seq <= 0:
        return
    name = log_table_name(table)
    compared = len(key) == len(key_columns) and any(_comparable(v) for v in key)
    log = sa.table(
        name,
        sa.column("dbt_seq", sa.BigInteger()),
        *(sa.column(c) for c in key_columns if compared),
        schema=schema,
    )
    try:
        with engine.connect() as conn:
            highest = conn.execute(sa.select(sa.func.max(log.c.dbt_seq))).scalar()
            there = (
                conn.execute(
                    sa.select(*(log.c[c] for c in key_columns)).where(log.c.dbt_seq == seq)
                ).first()
                if compared and highest is not None and highest >= seq
                else None
            )
    except sa.exc.SQLAlchemyError:
        return
    if there is not None and _another_key(key, tuple(there)):
        raise SourceDefinitionError(
            f"the change log of {table} ({name}) holds, at this poller's checkpoint "
            f"(sequence {seq}), a change of another key than the one the poller passed "
            "there: the log was dropped and installed again (changelog uninstall "
            "--drop-log, or a TRUNCATE of the log, which restarts its numbering on "
            "MariaDB/MySQL) and its numbers passed the checkpoint before the poller "
            "looked (or a `dbtrigger reset --to-cursor` named another key than the "
            f"change at that sequence: give its key). Its changes up to sequence {seq} "
            "would never be read. Nothing was "
            "read and the checkpoint stays. Read the new log from its start: "
            "`dbtrigger reset <poller> --to-beginning --reason ... --yes`; changes made "
            "while no log was installed were not logged (`dbtrigger changelog snapshot` "
            "sends every row again)",
            table=table,
            log_table=name,
            checkpoint_seq=seq,
        )
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


def _comparable(value: Any) -> bool:
    """A key value that reads back from a checkpoint exactly as from the log."""
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _another_key(passed: Sequence[Any], there: Sequence[Any]) -> bool:
    """Do the values differ where both can be compared exactly?"""
    return any(
        _comparable(a) and _comparable(b) and type(a) is type(b) and a != b
        for a, b in zip(passed, there, strict=True)
    )


__all__ = ["refuse_renumbered"]
