"""Without column names in the log: the columns a table had before (or after) ``ALTER``s.

A reader behind the log names a table map written before an ``ALTER TABLE`` by a
reading of ``information_schema`` taken after it (:mod:`dbtrigger.cdc.binlog_lookahead`).
The reading is the table as it is after the statement; for many statements the
table before it follows exactly from the statement's text:

* ``ADD [COLUMN] c ...`` (at the end, ``FIRST`` or ``AFTER x``; ``ADD (c ..., d ...)``):
  before it, the columns were these without ``c``, wherever it went;
* ``RENAME COLUMN b TO c``: ``b`` in ``c``'s place, of ``c``'s type;
* ``MODIFY b ...`` / ``CHANGE b c ...`` without ``FIRST``/``AFTER``: ``b`` in ``c``'s
  place; its type then is not in the statement;
* ``ADD PRIMARY KEY (...)``: no primary key before (a table has at most one);
* indexes, constraints, options, defaults, partitions: nothing.

And the other way round, from a reading taken before the statements, ``DROP
COLUMN`` and a moved column too. What cannot be undone is not guessed: a dropped
column's place and type, a moved column's old place, the key an ``ADD PRIMARY
KEY`` replaced, a clause not understood, a column named by two clauses of one
statement, a rename or drop of the table. The result must then fit the table map
itself (:func:`fitted`): as many columns, each known type stored as the log
stores that type, and a column whose type is not known (``MODIFY``/``CHANGE``,
added) only where the log's type decides how its values read (not a string type,
which ``UUID``, ``INET6`` and binary strings are too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger.cdc.binlog_alter import ColumnOp, column_ops

#: Table map type codes of strings: how their values read depends on the catalog type.
STRINGS = frozenset({15, 249, 250, 251, 252, 253, 254})
_BLOBS = frozenset({249, 250, 251, 252})
_TEXTS = [
    "tinytext",
    "text",
    "mediumtext",
    "longtext",
    "tinyblob",
    "blob",
    "mediumblob",
    "longblob",
]
#: How the log stores each ``DATA_TYPE`` (pymysqlreplication's type codes; ENUM and SET
#: are 247/248 once their real type is read); a type not listed is not checked.
STORED: Mapping[str, frozenset[int]] = {
    "tinyint": frozenset({1}),
    "smallint": frozenset({2}),
    "mediumint": frozenset({9}),
    "int": frozenset({3}),
    "bigint": frozenset({8}),
    "float": frozenset({4}),
    "double": frozenset({5}),
    "decimal": frozenset({0, 246}),
    "date": frozenset({10, 14}),
    "datetime": frozenset({12, 18}),
    "timestamp": frozenset({7, 17}),
    "time": frozenset({11, 19}),
    "year": frozenset({13}),
    "bit": frozenset({16}),
    "enum": frozenset({247, 254}),
    "set": frozenset({248, 254}),
    **dict.fromkeys(("char", "binary", "uuid", "inet6"), frozenset({254})),
    **dict.fromkeys(("varchar", "varbinary"), frozenset({15, 253})),
    **dict.fromkeys(_TEXTS, _BLOBS),
    "json": _BLOBS | {245},  # MariaDB's is a LONGTEXT; MySQL's its own type
}


@dataclass(frozen=True)
class Columns:
    """A table's columns at one place in the log: names in order, each one's
    ``DATA_TYPE`` (None: not known) and the primary key's columns."""

    names: tuple[str, ...]
    types: Mapping[str, str | None]
    keys: tuple[str, ...]


def _at(names: Sequence[str], name: str) -> int | None:
    """Where ``name`` is (column names are not case sensitive)."""
    lower = name.lower()
    return next((i for i, n in enumerate(names) if n.lower() == lower), None)


def _renamed(keys: Iterable[str], old: str, new: str) -> tuple[str, ...]:
    return tuple(new if k.lower() == old.lower() else k for k in keys)


def _undo(
    op: ColumnOp, names: list[str], types: dict[str, str | None], keys: tuple[str, ...]
) -> tuple[str, ...] | None:
    """``op`` undone on the columns after it (in place); the key before it, or None when
    it cannot be undone."""
    if op.kind == "key":
        if not op.keys or [k.lower() for k in keys] != [k.lower() for k in op.keys]:
            return None  # the key it dropped is not in the statement
        return ()
    if op.kind == "drop" or op.keyed or (op.kind == "change" and op.place is not None):
        return None  # the dropped (or moved) column's place is not in the statement
    i = _at(names, op.new or op.name)
    if i is None:
        return None
    if op.kind == "add":
        if _at(keys, op.name) is not None:
            return None
        types.pop(names.pop(i), None)
        return keys
    if op.name.lower() != names[i].lower() and _at(names, op.name) is not None:
        return None
    now = names[i]
    names[i] = op.name
    kept = types.pop(now, None)
    types[op.name] = kept if op.kind == "rename" else None
    return _renamed(keys, now, op.name)


def _redo(
    op: ColumnOp, names: list[str], types: dict[str, str | None], keys: tuple[str, ...]
) -> tuple[str, ...] | None:
    """``op`` done on the columns before it (in place); the key after it, or None."""
    if op.kind == "key":
        if op.keys and keys:  # a second primary key: the server refused it
            return None
        return op.keys
    if op.keyed:
        return None
    if op.kind == "add":
        if _at(names, op.name) is not None:
            return None
        return keys if _place(names, op.name, op.place) else None
    i = _at(names, op.name)
    if i is None:
        return None
    if op.kind == "drop":
        if _at(keys, op.name) is not None:
            return None
        types.pop(names.pop(i), None)
        return keys
    if op.new.lower() != op.name.lower() and _at(names, op.new) is not None:
        return None
    old = names.pop(i)
    kept = types.pop(old, None)
    if op.place is None:
        names.insert(i, op.new)
    elif not _place(names, op.new, op.place):
        return None
    types[op.new] = kept if op.kind == "rename" else None
    return _renamed(keys, old, op.new)


def _place(names: list[str], name: str, place: str | None) -> bool:
    if place is None:
        names.append(name)
    elif place == "":
        names.insert(0, name)
    else:
        after = _at(names, place)
        if after is None:
            return False
        names.insert(after + 1, name)
    return True


def across(texts: Sequence[str], columns: Columns, *, backward: bool) -> Columns | None:
    """The columns on the other side of the statements ``texts`` (in log order): before
    them from ``columns`` after them (``backward``), or after them from before. None
    when a statement's effect cannot be known for certain (see the module docstring)."""
    names, types, keys = list(columns.names), dict(columns.types), columns.keys
    for text in reversed(texts) if backward else texts:
        ops = column_ops(text)
        if ops is None:
            return None
        for op in reversed(ops) if backward else ops:
            if op.kind == "add" and not backward:
                types[op.name] = None
            done = (_undo if backward else _redo)(op, names, types, keys)
            if done is None:
                return None
            keys = done
    return Columns(tuple(names), types, tuple(keys))


def fitted(columns: Columns, table_map: Sequence[Any]) -> dict[str, str] | None:
    """Each column's ``DATA_TYPE`` if ``columns`` fit the table map's columns
    (``table_map``: the log's, with a ``type`` code each); None when they do not, or
    when a string column's type is not known (how its values read depends on it)."""
    if len(columns.names) != len(table_map):
        return None
    out: dict[str, str] = {}
    for name, column in zip(columns.names, table_map, strict=True):
        code = getattr(column, "type", None)
        known = columns.types.get(name)
        if known is None:
            if code is None or code in STRINGS:
                return None
            out[name] = ""  # the log's type alone says how it reads
            continue
        stored = STORED.get(known)
        if stored is not None and code not in stored:
            return None
        out[name] = known
    return out


__all__ = ["STORED", "STRINGS", "Columns", "across", "fitted"]
