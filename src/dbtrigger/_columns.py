"""Whether a watched table's columns changed since it was read: a probe cheap enough
to run every half minute (internal).

A source builds its statements from the table's columns as they were when it
first looked (reflection). ``ALTER TABLE ... ADD COLUMN`` under a running
worker left the new column out of every event until a restart, and ``DROP
COLUMN`` failed every fetch. :class:`ColumnWatch` notices both: ``SELECT * FROM
t WHERE false`` returns no row and costs the server a plan, and its cursor
description lists the columns as the database has them now, with the driver's
type code of each (PostgreSQL and MariaDB give one, SQLite none). The source
compares that list with the one it took when it read the table, at most once
every :data:`CHECK_SECONDS` and at once when a statement of its fails, and
reads the table again when they differ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dbtrigger._driver_errors import short_error
from dbtrigger._lock_wait import lock_timed_out

log = logging.getLogger("dbtrigger.sources")

#: How long a running source may go without looking at its table's columns: a
#: column added to the table is in the events at most this long after the DDL
#: (plus one poll interval).
CHECK_SECONDS = 30.0

#: The columns of a table as ``SELECT *`` returns them: (name, driver type code).
Layout = tuple[tuple[str, Any], ...]


def probe(conn: Connection, selectable: sa.FromClause) -> Layout:
    """The columns ``SELECT * FROM selectable`` returns now (one statement, no row)."""
    stmt: sa.Select[Any] = sa.select(sa.literal_column("*")).select_from(selectable)
    stmt = stmt.where(sa.false())
    result = conn.execute(stmt)
    try:
        description = result.cursor.description if result.cursor is not None else None
    finally:
        result.close()
    return layout_of(description)


def probe_or_none(conn: Connection, selectable: sa.FromClause) -> Layout | None:
    """:func:`probe`, or None if the statement fails (rolled back): a table that
    cannot be read is reported by what reads it next (a reflection says why). A
    probe that gave up waiting for a lock is raised: the table is there, and
    what reads it next, after the rollback, would wait unbounded (a bound set
    for the transaction ends with it)."""
    try:
        return probe(conn, selectable)
    except sa.exc.DBAPIError as exc:
        if lock_timed_out(exc):
            raise
        if conn.in_transaction() and not conn.invalidated:
            conn.rollback()
        return None


def layout_of(description: Sequence[Sequence[Any]] | None) -> Layout:
    """A cursor description as a :data:`Layout`."""
    return tuple((str(d[0]), d[1]) for d in description or ())


@dataclass(frozen=True)
class ColumnChange:
    """How a table's columns differ from what a source read of it."""

    added: tuple[str, ...]
    dropped: tuple[str, ...]
    retyped: tuple[str, ...]

    @classmethod
    def between(cls, before: Layout, now: Layout) -> ColumnChange:
        old, new = dict(before), dict(now)
        return cls(
            added=tuple(n for n in new if n not in old),
            dropped=tuple(n for n in old if n not in new),
            retyped=tuple(n for n in new if n in old and new[n] != old[n]),
        )

    @property
    def only_added(self) -> bool:
        return not self.dropped and not self.retyped

    def text(self) -> str:
        parts = [
            f"{what}: {', '.join(names)}"
            for what, names in (
                ("added", self.added),
                ("dropped", self.dropped),
                ("type changed", self.retyped),
            )
            if names
        ]
        return "; ".join(parts) or "column order changed"

    def report(
        self, source: str, failure: BaseException | None, *, read: str = "rows are read"
    ) -> None:
        """Log the change (INFO for columns only added and noticed by a check,
        WARNING otherwise), with the failure it caused, if any, which was then
        run again on the new columns."""
        failed = (
            f" (a statement on the old columns failed, {short_error(failure)}, and was run again)"
            if failure is not None
            else ""
        )
        log.log(
            logging.INFO if self.only_added and failure is None else logging.WARNING,
            "%s: the table's columns changed (%s); %s with the columns it has now%s",
            source,
            self.text(),
            read,
            failed,
            extra={
                "event": "source_columns_changed",
                "source": source,
                "added": list(self.added),
                "dropped": list(self.dropped),
                "retyped": list(self.retyped),
                "failed": failure is not None,
            },
        )


class ColumnWatch:
    """The columns a source read its table with, and when to look again."""

    def __init__(self, layout: Layout | None) -> None:
        self.layout = layout
        self.checked_at = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.checked_at >= CHECK_SECONDS

    def check(self, conn: Connection, selectable: sa.FromClause) -> ColumnChange | None:
        """Probe the table now: how its columns changed (None: they did not)."""
        self.checked_at = time.monotonic()  # first: twins due at once do not all probe
        now = probe(conn, selectable)
        if now == self.layout:
            return None
        return ColumnChange.between(self.layout or (), now)


__all__ = [
    "CHECK_SECONDS",
    "ColumnChange",
    "ColumnWatch",
    "Layout",
    "layout_of",
    "probe",
    "probe_or_none",
]
