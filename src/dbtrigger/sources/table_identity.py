"""Whether the polled table is still the one the checkpoint was read from (internal).

A checkpoint is a position in one table. ``DROP TABLE`` and ``CREATE TABLE``
with the same name (a migration that rebuilds it, a restore) give a new table
whose sequence, or whose copied timestamps, start again below that position:
the keyset read ``(cursor, pk) > checkpoint`` went past every such row, and the
poller delivered only the rows above it, without a word.

On PostgreSQL a table keeps its oid for as long as it exists (through ``ALTER
TABLE``, ``VACUUM FULL`` and ``TRUNCATE``) and a new table gets another one.
The source learns the oid when it first reads the table, and every statement
it builds carries ``to_regclass('the_table')::oid = <that oid>``: a condition
on no row, which PostgreSQL evaluates once per statement (a ``One-Time
Filter``; the index range scan is unchanged, no round trip is added). Rows of a
new table are never read, so no checkpoint can pass them. Every
``CHECK_SECONDS`` (the column check's interval, :mod:`dbtrigger._columns`) the
source asks for the oid; another one is refused with a
:class:`~dbtrigger.errors.SourceDefinitionError` on every fetch from then on,
the checkpoint unchanged, the message saying how to go on. A checkpoint reset
to the beginning reads the new table whole; a restarted worker learns the new
table and goes on from its checkpoint.

Only ordinary and partitioned tables: a view dropped and created again over
the same table is the same rows. MariaDB/MySQL and SQLite give a table no
identity that survives a rebuild (``OPTIMIZE TABLE``, an ``ALTER`` that copies
it) but not a new table, so there nothing is checked (docs/sources.md).
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dbtrigger import _columns
from dbtrigger.cursor import Position
from dbtrigger.errors import SourceDefinitionError
from dbtrigger.names import quoted_name


class TableIdentity:
    """The oid of a polled PostgreSQL table as the source first read it (see the module
    docstring); nothing to learn or check for a query, a view or another database."""

    def __init__(self, *, table: str | None, schema: str | None, dialect: str, source: str) -> None:
        self._table = table if dialect == "postgresql" else None
        self._schema = schema
        self._source = source
        self._oid: int | None = None
        self._now_sql = ""
        self._learned = False
        self._checked_at = time.monotonic()
        #: Another table was found: checked again on every fetch until one is allowed.
        self.refused = False

    def learn(self, conn: Connection) -> None:
        """Read the table's oid (an ordinary or partitioned table's only), once: the
        shapes learnt after a column change keep the table the checkpoint was read from."""
        if self._table is None or self._learned:
            return
        self._learned = True
        # The name is validated (letters, digits, '_', '$') and quoted: a literal is safe.
        name = quoted_name(conn.dialect.identifier_preparer.quote, self._table, self._schema)
        self._now_sql = f"CAST(to_regclass('{name}') AS oid)"
        found = conn.execute(
            sa.text(f"SELECT c.oid, c.relkind FROM pg_class c WHERE c.oid = {self._now_sql}")  # noqa: S608 - see above
        ).first()
        if found is not None and found.relkind in ("r", "p"):
            self._oid = int(found.oid)
        self._checked_at = time.monotonic()

    def predicate(self) -> sa.TextClause | None:
        """The condition every statement of the source carries (None: nothing learnt)."""
        if self._oid is None:
            return None
        return sa.text(f"{self._now_sql} = {self._oid}")

    def due(self) -> bool:
        return self.refused or time.monotonic() - self._checked_at >= _columns.CHECK_SECONDS

    def same(self, conn: Connection, after: Position) -> bool:
        """Is the table the one learnt? False: another, to be learnt (``after`` is the
        beginning, so nothing of it is passed). Raises when the checkpoint is in the old one."""
        if self._oid is None:
            return True
        self._checked_at = time.monotonic()
        now = conn.execute(sa.text(f"SELECT {self._now_sql}")).scalar()
        if now is None or now == self._oid:
            self.refused = False  # (gone: the fetch says so)
            return True
        if after.is_beginning:
            return False
        self.refused = True
        raise SourceDefinitionError(
            f"table {self._source.split(':', 1)[-1]} was dropped and created again since this "
            f"worker first read it (PostgreSQL oid {self._oid}, now {now}): the checkpoint "
            f"(cursor {after.cursor!r}) is a position in the old table, and the rows of the new "
            "one below it would never be read. Nothing was read from the new table and the "
            "checkpoint stays. To deliver every row of the new table, read it from its start: "
            "`dbtrigger reset <poller> --to-beginning --reason ... --yes`; if its rows below "
            "the checkpoint were delivered already (copied from the old table), restart the "
            "worker: it goes on from the checkpoint",
            table=self._table,
            schema=self._schema,
        )


__all__ = ["TableIdentity"]
