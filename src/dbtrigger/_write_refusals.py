"""What a database's refusal of a write says about the rows (internal).

A write can fail because the database is unwell (retry) or because a row
breaks a rule of its table (retrying fails the same way, for ever). The
second kind is read here from the driver's error, per dialect, into a
:class:`Refusal`: what kind of rule, which constraint and columns, and which
row when that can be told without showing a value:

============  ===================  ==========================  ======================
kind          PostgreSQL SQLSTATE  MariaDB/MySQL error         SQLite (default build)
============  ===================  ==========================  ======================
unique        23505, 23P01         1062, 1242 (upsert guard)   UNIQUE constraint failed
not_null      23502                1048, 1364                  NOT NULL constraint failed
check         23514                4025, 3819                  CHECK constraint failed
foreign_key   23503                1451, 1452, 1216, 1217      only with foreign_keys=ON
value         class 22             1264, 1406, 1265, 1366,...  an int past 64 bits
============  ===================  ==========================  ======================

SQLite does not enforce a ``VARCHAR(n)`` length or a ``SMALLINT`` range and
checks foreign keys only when ``PRAGMA foreign_keys = ON``: such rows are
written. The row is found by looking at the rows themselves (the ``None`` in
a NOT NULL column, the string longer than its column) or by matching the
database's report of the duplicate key against them; the report itself is
never shown (MariaDB's and PostgreSQL's quote the row's values).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from dbtrigger.errors import (
    DbTriggerError,
    OutputConstraintError,
    OutputReferenceError,
    OutputValueError,
)

_PG_KINDS = {
    "23505": "unique",
    "23P01": "unique",
    "23502": "not_null",
    "23514": "check",
    "23503": "foreign_key",
}
_MYSQL_KINDS = {
    1062: "unique",
    1242: "unique",  # the upsert guard of _tables.upsert_statement
    1048: "not_null",
    1364: "not_null",
    4025: "check",
    3819: "check",
    1451: "foreign_key",
    1452: "foreign_key",
    1216: "foreign_key",
    1217: "foreign_key",
    1264: "value",  # out of range
    1406: "value",  # data too long
    1265: "value",  # data truncated (an ENUM, a SET)
    1366: "value",  # incorrect value for the column's type
    1292: "value",  # incorrect date/time value
    1367: "value",
    1416: "value",
}
_SQLITE_KINDS = {
    "UNIQUE constraint failed": "unique",
    "PRIMARY KEY must be unique": "unique",
    "NOT NULL constraint failed": "not_null",
    "CHECK constraint failed": "check",
    "FOREIGN KEY constraint failed": "foreign_key",
}
_INTEGER_BITS = {"SmallInteger": 16, "Integer": 32, "BigInteger": 64}


@dataclass(frozen=True)
class Refusal:
    """A row broke a rule of its table (see the module doc)."""

    kind: str
    #: The database's name for the rule (None: it did not say).
    constraint: str | None
    #: The columns of the rule, when known.
    columns: tuple[str, ...]
    #: The index of the row in the rows written (None: it cannot be told).
    row: int | None
    #: The driver's code: a SQLSTATE, a MariaDB error number, SQLite's error name.
    code: str
    #: For a foreign key: True when a row to delete (or change) is still referred to.
    referenced: bool = False


def refusal(
    exc: BaseException, table: sa.Table | None, rows: Sequence[Mapping[str, Any]]
) -> Refusal | None:
    """What ``exc`` says about ``rows`` (written to ``table``), or None when it is not
    a row breaking a rule (a lost connection, a lock, a permission)."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, OverflowError):  # pysqlite: an int past 64 bits, before SQL
        row, column = _value_misfit(table, rows, overflow=True)
        return Refusal("value", None, (column,) if column else (), row, "OverflowError")
    module = type(orig).__module__
    if module.startswith("sqlite3"):
        return _sqlite(str(orig), table, rows)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and module.startswith("pymysql"):
        return _mysql(args[0], str(args[1]) if len(args) > 1 else "", table, rows)
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str):
        return _pg(sqlstate, getattr(orig, "diag", None), table, rows)
    return None


def _pg(
    sqlstate: str, diag: Any, table: sa.Table | None, rows: Sequence[Mapping[str, Any]]
) -> Refusal | None:
    kind = _PG_KINDS.get(sqlstate) or ("value" if sqlstate.startswith("22") else None)
    if kind is None:
        return None
    constraint = getattr(diag, "constraint_name", None)
    detail = str(getattr(diag, "message_detail", None) or "")
    if kind == "value":
        row, column = _value_misfit(table, rows)
        return Refusal(kind, None, (column,) if column else (), row, sqlstate)
    if kind == "not_null":
        column = str(getattr(diag, "column_name", None) or "")
        return Refusal(kind, None, (column,), _null_row(rows, column), sqlstate)
    if kind == "check":
        return Refusal(kind, constraint, (), _only(rows), sqlstate)
    found = re.match(r"Key \((.+?)\)=\((.*)\) (?:already exists|is not present|is still)", detail)
    columns = tuple(c.strip().strip('"') for c in found.group(1).split(",")) if found else ()
    referenced = "is still referenced" in detail
    row = _matching_row(rows, columns, found.group(2), ", ") if found else None
    return Refusal(
        kind, constraint, columns, _only(rows) if row is None else row, sqlstate, referenced
    )


def _mysql(
    code: int, text: str, table: sa.Table | None, rows: Sequence[Mapping[str, Any]]
) -> Refusal | None:
    kind = _MYSQL_KINDS.get(code)
    if kind is None:
        return None
    number = str(code)
    if kind == "unique":
        found = re.match(r"Duplicate entry '(.*)' for key '(?:[^']*\.)?([^']*)'$", text)
        if found is None:  # the upsert guard: another unique key, not said which
            return Refusal(kind, None, (), _only(rows), number)
        name = found.group(2)
        columns = _index_columns(table, name)
        row = _matching_row(rows, columns, found.group(1), "-")
        return Refusal(kind, name, columns, _only(rows) if row is None else row, number)
    if kind == "not_null":
        found = re.search(r"'([^']+)'", text)
        column = found.group(1) if found else ""
        return Refusal(kind, None, (column,), _null_row(rows, column), number)
    if kind == "check":
        found = re.search(r"CONSTRAINT [`']([^`']+)[`']|constraint '([^']+)'", text)
        name = (found.group(1) or found.group(2)) if found else None
        return Refusal(kind, name, (), _only(rows), number)
    if kind == "foreign_key":
        found = re.search(r"CONSTRAINT `([^`]+)` FOREIGN KEY \(([^)]*)\)", text)
        name = found.group(1) if found else None
        columns = tuple(c.strip(" `") for c in found.group(2).split(",")) if found else ()
        return Refusal(kind, name, columns, _only(rows), number, code in (1451, 1217))
    row, column = _value_misfit(table, rows)
    if column is None:  # the server named the column (and the row, within its statement)
        named = re.search(r"column [`']?(?:[^ ]*[`.])?([^`' ]+)[`']? at row (\d+)", text)
        if named:
            column = named.group(1)
            index = int(named.group(2)) - 1
            row = index if 0 <= index < len(rows) else None
    return Refusal(kind, None, (column,) if column else (), row, number)


def _sqlite(text: str, table: sa.Table | None, rows: Sequence[Mapping[str, Any]]) -> Refusal | None:
    kind = next((k for prefix, k in _SQLITE_KINDS.items() if text.startswith(prefix)), None)
    if kind is None:
        return None
    code = text.split(":", maxsplit=1)[0]
    named = text.partition(":")[2].strip()
    if kind in ("unique", "not_null"):
        columns = tuple(c.strip().rpartition(".")[2] for c in named.split(",") if c.strip())
        if kind == "not_null":
            column = columns[0] if columns else ""
            return Refusal(kind, None, (column,), _null_row(rows, column), code)
        return Refusal(kind, _unique_name(table, columns), columns, _only(rows), code)
    return Refusal(kind, named or None, (), _only(rows), code)


def refusal_error(
    found: Refusal,
    where: str,
    table: sa.Table | None,
    rows: Sequence[Mapping[str, Any]],
    conflict_columns: Sequence[str] = (),
) -> DbTriggerError:
    """The error ``found`` is, for rows written to ``where`` (``dialect:table``): a
    message naming the rule, its columns and the row by its key, never a value."""
    row_key = _key_text(found.row, table, rows, conflict_columns)
    subject = _row_subject(found.row, len(rows), row_key)
    rule = f"{found.constraint!r}" if found.constraint else "a constraint"
    on = f" on ({', '.join(found.columns)})" if found.columns and found.columns[0] else ""
    fields: dict[str, Any] = {
        "table": where,
        "kind": found.kind,
        "constraint": found.constraint,
        "columns": list(found.columns),
        "row": found.row,
        "key": row_key or None,
        "code": found.code,
        "rows": len(rows) or None,
    }
    done = (
        "Writing it again cannot help: fix the row or the table; under a trigger with a "
        "dead-letter sink (quarantine=...) the row is set aside after max_attempts"
    )
    if found.kind == "foreign_key":
        if found.referenced:
            what = f"other rows still refer to {subject} through foreign key {rule}{on}"
        else:
            what = f"{subject} refers through foreign key {rule}{on} to a row that is not there"
        return OutputReferenceError(
            f"cannot write to {where}: {what} (yet). Retried with the batch: it succeeds "
            f"once the other row is there ({found.code})",
            **fields,
        )
    if found.kind == "value":
        column = found.columns[0] if found.columns else None
        kind = _column_type(table, column)
        fields.pop("kind")
        return OutputValueError(
            f"cannot write {subject} to {where}: "
            + (f"column {column!r}{kind} cannot store its value" if column else "a value")
            + f" (too long, out of range or not of the column's type; {found.code}). {done}",
            column=column,
            **fields,
        )
    if found.kind == "not_null":
        column = found.columns[0] if found.columns else "?"
        given = bool(rows) and column in rows[0]
        what = (
            f"{subject} has no value (None) in column {column!r}, which is NOT NULL"
            if given
            else f"the rows give no column {column!r}, which is NOT NULL and has no default"
        )
    elif found.kind == "check":
        what = f"{subject} breaks check constraint {rule}"
    else:
        key = f"unique key {rule}{on}" if found.constraint else f"a unique key{on}"
        what = (
            f"{subject} has the same value as an existing row (or another row written "
            f"with it) in {key}"
        )
        if conflict_columns and set(found.columns) != set(conflict_columns):
            what += (
                f", which is not the upsert's conflict key ({', '.join(conflict_columns)}), "
                "so the upsert cannot merge it"
            )
        elif not conflict_columns:
            what += "; if it is a redelivery of a row written before, write with "
            what += "action='upsert' on that key"
    return OutputConstraintError(
        f"cannot write to {where}: {what} ({found.code}). {done}", **fields
    )


def _key_columns(table: sa.Table | None, conflict_columns: Sequence[str]) -> list[str]:
    if conflict_columns:
        return list(conflict_columns)
    return [c.name for c in table.primary_key.columns] if table is not None else []


def _key_text(
    row: int | None,
    table: sa.Table | None,
    rows: Sequence[Mapping[str, Any]],
    conflict_columns: Sequence[str],
) -> str:
    """``id=3`` for the row's key columns it gives ("" when none, or no row)."""
    if row is None or row >= len(rows):
        return ""
    values = rows[row]
    shown = [f"{c}={values[c]!r}" for c in _key_columns(table, conflict_columns) if c in values]
    return ", ".join(shown)[:200]


def _row_subject(row: int | None, count: int, key: str) -> str:
    """How a message names the refused row: ``row 2 (id=3)``, or, not knowing
    which, ``one of the 5 rows``; ``key`` is its :func:`_key_text`."""
    if row is None:
        return f"one of the {count} rows" if count != 1 else "the row"
    return f"row {row}" + (f" ({key})" if key else "")


def _column_type(table: sa.Table | None, column: str | None) -> str:
    if table is None or column is None or column not in table.c:
        return ""
    try:
        return f" ({table.c[column].type})"
    except Exception:  # noqa: BLE001 - a type that cannot render itself
        return ""


def _only(rows: Sequence[Mapping[str, Any]]) -> int | None:
    return 0 if len(rows) == 1 else None


def _null_row(rows: Sequence[Mapping[str, Any]], column: str) -> int | None:
    """The first row with None in ``column`` (None: no row gives it a value)."""
    for index, row in enumerate(rows):
        if column in row and row[column] is None:
            return index
    return _only(rows)


def _matching_row(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], reported: str, joiner: str
) -> int | None:
    """The one row whose values of ``columns``, as text, read as the database's report."""
    if not columns:
        return None
    found = [
        index
        for index, row in enumerate(rows)
        if all(c in row for c in columns)
        and joiner.join("null" if row[c] is None else str(row[c]) for c in columns) == reported
    ]
    return found[0] if len(found) == 1 else None


def _value_misfit(
    table: sa.Table | None, rows: Sequence[Mapping[str, Any]], *, overflow: bool = False
) -> tuple[int | None, str | None]:
    """The first (row, column) whose value is longer than its string column or past
    its integer column's range; (None, None) when none is."""
    if table is None:
        return _only(rows), None
    for index, row in enumerate(rows):
        for column, value in row.items():
            if column not in table.c or value is None:
                continue
            kind = table.c[column].type
            length = getattr(kind, "length", None) or 0
            too_long = isinstance(value, str) and 0 < length < len(value)
            if isinstance(kind, sa.String) and too_long:
                return index, column
            if isinstance(value, int) and not isinstance(value, bool):
                bits = 64 if overflow else _bits(kind)
                if bits and not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
                    return index, column
    return _only(rows), None


def _bits(kind: Any) -> int | None:
    for klass in type(kind).__mro__:
        if klass.__name__ in _INTEGER_BITS:
            return _INTEGER_BITS[klass.__name__]
    return None


def _index_columns(table: sa.Table | None, name: str) -> tuple[str, ...]:
    """The columns of the unique key called ``name`` (MariaDB's ``PRIMARY`` too)."""
    if table is None:
        return ()
    if name == "PRIMARY":
        return tuple(c.name for c in table.primary_key.columns)
    for index in table.indexes:
        if index.name == name:
            return tuple(c.name for c in index.columns)
    for constraint in table.constraints:
        if constraint.name == name and isinstance(constraint, sa.UniqueConstraint):
            return tuple(c.name for c in constraint.columns)
    return ()


def _unique_name(table: sa.Table | None, columns: Sequence[str]) -> str | None:
    """SQLite names the columns, not the key: the key's name, from the table."""
    if table is None:
        return None
    wanted = set(columns)
    if {c.name for c in table.primary_key.columns} == wanted:
        return "PRIMARY KEY"
    keys: list[sa.Index | sa.UniqueConstraint] = list(table.indexes)
    keys += [c for c in table.constraints if isinstance(c, sa.UniqueConstraint)]
    for key in keys:
        if isinstance(key.name, str) and {c.name for c in key.columns} == wanted:
            return key.name
    return None


__all__ = ["Refusal", "refusal", "refusal_error"]
