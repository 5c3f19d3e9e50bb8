"""BinlogSource without column names in the log: is the catalog the table map's?

With ``binlog_row_metadata`` not FULL (MariaDB's default) a table map carries no
column names, and the reader names its values from ``information_schema``, which
describes the table as it is *now*. That is the table map's definition only if
no statement changed the table between the table map's place in the log and now.
A reader behind the log that read the catalog after ``ALTER TABLE t DROP COLUMN
b, ADD COLUMN c INT`` (same count, same types) named ``b``'s values ``c``: data
silently wrong.

So, once per table map id (the server gives a table a new id whenever it loads
its definition again, as after every ``ALTER``), the reader looks ahead in the
log from the table map to its current end (:func:`later_statement`:
``SHOW BINLOG EVENTS``, server side, paged) for a statement that changes the
watched table (:func:`dbtrigger.cdc.binlog_ddl.redefines`). None: the catalog,
read before the look-ahead began, is the table map's, and any later ``ALTER``
gives later changes another id, looked at in turn. One: the names of the table
map's changes are not knowable, and delivery stops before them
(:func:`refusal`), until a snapshot of the table is asked for after that
statement; the changes of that table map are then passed over as a ``truncate``
of the table, and the snapshot brings the rows it holds. With names in the log
none of this runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pymysql

from dbtrigger.cdc import binlog_ddl as ddl
from dbtrigger.cdc.binlog_setup import binary_logs, file_index, translated
from dbtrigger.cdc.binlog_tokens import Where, commit_token

#: Events read per ``SHOW BINLOG EVENTS`` page (each page starts where the last ended).
PAGE = 2000

_USE = re.compile(r"^\s*use\s+`((?:[^`]|``)+)`\s*;\s*(.*)$", re.I | re.S)


@dataclass(frozen=True)
class Later:
    """A statement that changed a watched table after a table map of it was written."""

    table: str
    file: str
    pos: int
    text: str

    def token(self, commit: str) -> str:
        """The statement's place as a commit token of the reader generation of ``commit``
        (for ``asked_after``: a snapshot asked for after it lets the reader pass it)."""

        generation = Where.parse(commit).generation
        return commit_token(file_index(self.file), self.pos, None, generation)


def _statement(info: str) -> tuple[str, str | None]:
    """``SHOW BINLOG EVENTS``' ``Info`` of a query (``use `db`; ALTER ...``): the text and
    its default database."""
    used = _USE.match(info)
    if used is None:
        return info, None
    return used.group(2), used.group(1).replace("``", "`")


def later_statement(
    conn: pymysql.connections.Connection[Any], table: str, file: str, pos: int
) -> Later | None:
    """The first statement in the log from ``file``:``pos`` to its end that changes
    ``table``'s definition (None: there is none now)."""
    index = file_index(file)
    files = [name for name, _ in binary_logs(conn) if file_index(name) >= index]
    start = pos
    with translated("looking ahead in the binary log (SHOW BINLOG EVENTS)"):
        for name in files or [file]:
            while True:
                with conn.cursor() as cur:
                    cur.execute("SHOW BINLOG EVENTS IN %s FROM %s LIMIT %s", (name, start, PAGE))
                    rows = cur.fetchall()
                for row in rows:
                    if str(row[2]) != "Query":
                        continue
                    text, schema = _statement(str(row[5] or ""))
                    if ddl.redefines(text, schema, table):
                        return Later(table, name, int(row[1]), text)
                if len(rows) < PAGE:
                    break
                start = int(rows[-1][4])  # End_log_pos: where the next event starts
            start = 4
    return None


def refusal(later: Later, commit: str, poller: str | None) -> str:
    """The stop before the changes of a table map whose names are not knowable."""
    text = " ".join(later.text.split())
    text = text if len(text) <= 120 else text[:117] + "..."
    t = later.table
    return (
        f"watched table {t} was changed by a statement after changes of it still to be "
        f"read were written ({text!r} at {later.file}:{later.pos} in the binary log; the "
        f"first such change is in the transaction at {commit}). The log carries no column "
        "names (binlog_row_metadata is not FULL) and information_schema describes the "
        "table as it is now, so those changes' columns cannot be named; every change "
        "before them was delivered and delivery stops before them. Set "
        "binlog_row_metadata=FULL on the server (SET GLOBAL binlog_row_metadata = 'FULL', "
        "and in my.cnf) so that changes carry their names, then ask for the table's rows: "
        f"dbtrigger cdc snapshot MODULE:TRIGGER --table {t} --yes (a request made before "
        "the statement was written does not count: ask again); the changes that cannot be "
        f"named are then passed over as a truncate event of {t} (poller "
        f"{poller or 'POLLER'}), and the snapshot brings the rows the table holds"
    )


class Lookahead:
    """Per table map id (without names in the log): the later statement, if any.

    Looked for once per id (a table map precedes every transaction's rows of the
    table: the scan must not run per row event); each id's answer holds, since a
    statement after the scan gives the table a new id.
    """

    def __init__(self, scan: Callable[[str, str, int], Later | None] | None) -> None:
        self.scan = scan
        self._found: dict[int, tuple[str, Later | None]] = {}
        #: Tables a truncate was kept for in the open transaction, passing a statement.
        self.truncated: set[str] = set()
        #: Statements a snapshot was asked for after (the answer holds: not asked again).
        self.passed: set[Later] = set()

    def table_map(self, table_id: int, table: str, where: tuple[str, int] | None) -> None:
        """A table map named from the catalog (read before this, at ``where`` in the log)."""
        known = self._found.get(table_id)
        if self.scan is None or where is None or (known is not None and known[0] == table):
            return
        self._found[table_id] = (table, self.scan(table, *where))

    def named_by_log(self, table_id: int) -> None:
        self._found.pop(table_id, None)

    def passes(self, later: Later, commit: str, acked: Callable[[str, str], bool]) -> bool:
        """Was a snapshot of the table asked for after ``later`` (``acked``: table, commit
        token)? Asked once per statement, not per row event of the changes it passes."""
        if later not in self.passed and acked(later.table, later.token(commit)):
            self.passed.add(later)
        return later in self.passed

    def later(self, table_id: int) -> Later | None:
        known = self._found.get(table_id)
        return None if known is None else known[1]


__all__ = ["PAGE", "Later", "Lookahead", "later_statement", "refusal"]
