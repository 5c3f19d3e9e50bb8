"""BinlogSource without column names in the log: is a catalog reading the table map's?

With ``binlog_row_metadata`` not FULL (MariaDB's default) a table map carries no
column names, and the reader names its values from ``information_schema``
(:class:`Reading`: the names and types, and where the log ended when they were
read). That is the table map's definition exactly when no statement changed the
table's column list between the table map's place in the log and the reading's
end: between them either way round, since a reading may be older than the table
map (the one taken at the start) or newer (a reader behind the log).
:func:`dbtrigger.cdc.binlog_ddl.redefines` says which statements change it
(an ``ALTER TABLE`` of the table's columns, a rename, drop or ``CREATE OR
REPLACE``; not an index, a comment, a table option, a statement of another table).

So, once per table map id (the server gives a table a new id whenever it loads
its definition again, as after every ``ALTER``), the reader takes the latest
reading of the table; if such a statement lies between, and the reading is
older than the table map, it reads the catalog again (a reader that keeps up
names the changes after an ``ALTER`` by it). A statement still between the table
map and the reading (:class:`Later`): the names are not knowable, and delivery
stops before that id's changes (:func:`refusal`) until a snapshot of the table is
asked for after that statement; those changes are then passed over as a
``truncate`` of the table, and the snapshot brings the rows it holds. A statement
written after the reading does not count: the names were read before it.

The log is read once per stretch (:class:`Statements`, ``SHOW BINLOG EVENTS``,
server side, paged): each id asks only about the stretch between its table map
and its reading, and what was read is kept (the statements of the watched tables
only). With names in the log none of this runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pymysql

from dbtrigger.cdc import binlog_ddl as ddl
from dbtrigger.cdc import binlog_replay as replay
from dbtrigger.cdc.binlog_setup import binary_logs, file_index, translated
from dbtrigger.cdc.binlog_tokens import Where, commit_token

#: Events read per ``SHOW BINLOG EVENTS`` page (each page starts where the last ended).
PAGE = 2000

_USE = re.compile(r"^\s*use\s+`((?:[^`]|``)+)`\s*;\s*(.*)$", re.I | re.S)


@dataclass(frozen=True, order=True)
class Mark:
    """A place in the binary log: file (by its number) and offset; ordered as the log."""

    index: int
    pos: int
    file: str = field(compare=False)

    @classmethod
    def of(cls, where: tuple[str, int]) -> Mark:
        return cls(file_index(where[0]), where[1], where[0])


@dataclass(frozen=True)
class Reading:
    """A table's columns as ``information_schema`` gave them (names in order, each one's
    ``DATA_TYPE``), and where the log ended when they had been read (``end``, read
    after them: a statement that changed what they show was in the log by then)."""

    names: tuple[str, ...]
    types: Mapping[str, str]
    end: Mark
    #: The primary key's columns, in key order (empty: the table has none).
    keys: tuple[str, ...]
    #: Statements between the reading and the table map it names were replayed
    #: (:mod:`~dbtrigger.cdc.binlog_replay`): how many, for the log line.
    replayed: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Later:
    """A statement that changed a watched table between a table map of it and the reading
    its values would be named by."""

    table: str
    file: str
    pos: int
    text: str

    def token(self, commit: str) -> str:
        """The statement's place as a commit token of the reader generation of ``commit``
        (for ``asked_after``: a snapshot asked for after it lets the reader pass it)."""

        generation = Where.parse(commit).generation
        return commit_token(file_index(self.file), self.pos, None, generation)


@dataclass(frozen=True)
class Statement:
    """A statement of the log that changes one of the watched tables (see :class:`Statements`)."""

    at: Mark
    text: str
    schema: str | None
    #: A stretch of the log the server no longer has: what it held is not known, so it
    #: counts as a change of every table.
    unknown: bool = False

    def changes(self, table: str) -> bool:
        return self.unknown or ddl.redefines(self.text, self.schema, table)


def _statement(info: str) -> tuple[str, str | None]:
    """``SHOW BINLOG EVENTS``' ``Info`` of a query (``use `db`; ALTER ...``): the text and
    its default database."""
    used = _USE.match(info)
    if used is None:
        return info, None
    return used.group(2), used.group(1).replace("``", "`")


def read_statements(
    conn: pymysql.connections.Connection[Any], tables: Collection[str], start: Mark, end: Mark
) -> tuple[list[Statement], int]:
    """The statements from ``start`` up to ``end`` (not included) that change one of
    ``tables``' definitions, and the bytes of log read."""
    found: list[Statement] = []
    read = 0
    with translated("looking ahead in the binary log (SHOW BINLOG EVENTS)"):
        files = [n for n, _ in binary_logs(conn) if start.index <= file_index(n) <= end.index]
        have = {file_index(n) for n in files}
        gone = [i for i in range(start.index, end.index + 1) if i not in have]
        if gone:  # purged while the reader was behind: the statements there cannot be read
            name = f"{start.file.rpartition('.')[0]}.{gone[0]:06d}"
            text = f"(binary log {name}, no longer on the server: its statements are not known)"
            first = max(start, Mark(gone[0], 4, name))
            return [Statement(first, text, None, unknown=True)], read
        for name in files:
            index = file_index(name)
            at = start.pos if index == start.index else 4
            while index < end.index or at < end.pos:
                with conn.cursor() as cur:
                    cur.execute("SHOW BINLOG EVENTS IN %s FROM %s LIMIT %s", (name, at, PAGE))
                    rows = cur.fetchall()
                for row in rows:
                    if index == end.index and int(row[1]) >= end.pos:
                        return found, read
                    read += max(0, int(row[4]) - int(row[1]))
                    if str(row[2]) != "Query":
                        continue
                    text, schema = _statement(str(row[5] or ""))
                    if any(ddl.redefines(text, schema, t) for t in tables):
                        found.append(Statement(Mark(index, int(row[1]), name), text, schema))
                if len(rows) < PAGE:
                    break
                at = int(rows[-1][4])  # End_log_pos: where the next event starts
    return found, read


class Statements:
    """The watched tables' statements of the stretch of the log read so far, which
    grows as it is asked about: each byte of the log is read once (per source set-up),
    however many table map ids ask about it."""

    def __init__(self, read: Callable[[Mark, Mark], tuple[list[Statement], int]]) -> None:
        self._read = read
        self._lo: Mark | None = None
        self._hi: Mark | None = None
        self._found: list[Statement] = []
        #: Bytes of log read (``cdc_binlog`` benchmark, tests).
        self.bytes_read = 0

    def first(self, table: str, a: Mark, b: Mark) -> Statement | None:
        """The first statement from ``a`` to ``b`` (either way round; ``b``'s place not
        included) that changes ``table``."""
        found = self.between(table, a, b)
        return found[0] if found else None

    def between(self, table: str, a: Mark, b: Mark) -> list[Statement]:
        """The statements from ``a`` to ``b`` (either way round; ``b``'s place not
        included) that change ``table``, in log order."""
        lo, hi = min(a, b), max(a, b)
        if lo == hi:
            return []
        if self._lo is None or self._hi is None or hi < self._lo or lo > self._hi:
            self._found, self._lo, self._hi = self._fetch(lo, hi), lo, hi  # not adjoining
        else:
            if lo < self._lo:
                self._found, self._lo = self._fetch(lo, self._lo) + self._found, lo
            if hi > self._hi:
                self._found, self._hi = self._found + self._fetch(self._hi, hi), hi
        return [s for s in self._found if lo <= s.at < hi and s.changes(table)]

    def _fetch(self, lo: Mark, hi: Mark) -> list[Statement]:
        found, read = self._read(lo, hi)
        self.bytes_read += read
        return found


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


def _replayed(
    reading: Reading, between: Sequence[Statement], at: Mark, columns: Sequence[Any]
) -> Reading | None:
    """The columns of a table map at ``at`` from a ``reading`` with the statements
    ``between`` them, when those are known for certain and fit the table map's
    ``columns`` (:mod:`~dbtrigger.cdc.binlog_replay`); None otherwise."""
    if not columns or any(s.unknown for s in between):
        return None
    known = replay.Columns(reading.names, dict(reading.types), reading.keys)
    derived = replay.across([s.text for s in between], known, backward=reading.end > at)
    types = None if derived is None else replay.fitted(derived, columns)
    if derived is None or types is None:
        return None
    return Reading(derived.names, types, reading.end, derived.keys, replayed=len(between))


class Lookahead:
    """Per table map id named from the catalog: the reading it is named by, and the
    statement between them, if any (see the module docstring).

    Decided once per id (a table map precedes every transaction's rows of the table:
    the look-ahead must not run per row event) and kept: the id's names are kept too.
    """

    def __init__(
        self,
        statements: Statements | None,
        catalog: Callable[[str], Reading | None] | None = None,
    ) -> None:
        self.statements = statements
        self.catalog = catalog
        #: Each table's readings, oldest first (the start's first, seeded by the source).
        self.readings: dict[str, list[Reading]] = {}
        self._found: dict[int, tuple[str, Reading, Later | None]] = {}
        #: Tables a truncate was kept for in the open transaction, passing a statement.
        self.truncated: set[str] = set()
        #: Statements a snapshot was asked for after (the answer holds: not asked again).
        self.passed: set[Later] = set()

    def reading(
        self,
        table_id: int,
        table: str,
        where: tuple[str, int],
        columns: Sequence[Any] = (),
    ) -> Reading | None:
        """The reading the table map ``table_id`` of ``table`` at ``where`` (its
        ``columns``: the log's, each with a type code) is named by (None: no reading of
        the table yet, and the catalog cannot be read now)."""
        known = self._found.get(table_id)
        if known is not None and known[0] == table:
            return known[1]
        readings = self.readings.setdefault(table, [])
        if self.statements is None:
            return readings[-1] if readings else None
        at, statements = Mark.of(where), self.statements
        newer = [r for r in readings if r.end > at]
        if not newer and self.catalog is not None:
            fresh = self.catalog(table)  # newer than the table map: read up to now
            if fresh is not None:
                readings.append(fresh)
                newer = [fresh]
        # The newer reading nearest the table map (the shortest stretch), then the older
        # ones, newest first (a statement between the table map and now, none before).
        candidates = sorted(newer, key=lambda r: r.end)[:1]
        candidates += sorted((r for r in readings if r.end <= at), key=lambda r: r.end)[::-1]
        for reading in candidates:
            if statements.first(table, at, reading.end) is None:
                self._found[table_id] = (table, reading, None)
                return reading
        for reading in candidates:  # statements between: replayed where they are known
            derived = _replayed(reading, statements.between(table, at, reading.end), at, columns)
            if derived is not None:
                self._found[table_id] = (table, derived, None)
                return derived
        if not candidates:
            return None
        reading = candidates[0]
        between = statements.first(table, at, reading.end)
        assert between is not None  # noqa: S101 - none fitted
        later = Later(table, between.at.file, between.at.pos, between.text)
        self._found[table_id] = (table, reading, later)
        return reading

    def named(self, table_id: int, table: str) -> Reading | None:
        """The reading :meth:`reading` gave the id (None: none, or named otherwise)."""
        known = self._found.get(table_id)
        return known[1] if known is not None and known[0] == table else None

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
        return None if known is None else known[2]


__all__ = [
    "PAGE",
    "Later",
    "Lookahead",
    "Mark",
    "Reading",
    "Statement",
    "Statements",
    "read_statements",
    "refusal",
]
