"""What a table's reflected columns and keys must satisfy before it can be polled.

The keyset fetch is only lossless if three things hold, and each fails
silently when it does not:

* **Exact comparison.** The checkpoint's cursor and key values are bound back
  into ``(cursor, pk) > (:cursor, :pk)``. A single-precision float (PostgreSQL
  ``real``, MariaDB/MySQL ``FLOAT``) is stored as 0.699999988 but handed to
  Python as 0.7; bound back as a double, 0.7 is *greater* than the stored value,
  so rows tied on that cursor are skipped and one row comes back forever.
  Sub-microsecond timestamps (SQL Server ``datetime2(7)``) are truncated by
  the driver the same way. Such columns are refused (:func:`lossy_type_reason`).
* **Unique positions.** Two rows with the same ``(cursor, pk)`` cannot both be
  delivered across a batch boundary: the second is not *after* the first.
  :func:`unique_key_problem` asks the reflected primary key, unique
  constraints and unique indexes for proof.
* **A checkpoint of the column's own kind.** A checkpoint written while the
  cursor was ``timestamp`` and read back after an ``ALTER`` to ``timestamptz``
  is bound as a wall-clock time in the session's zone, ``int`` → ``text``
  compares ``'10' < '9'``: either way rows are skipped without a word.
  :func:`kinds_for_type` says which stored kinds a column accepts, and
  :func:`kind_mismatch` builds the operator error.

All of these are pure functions of SQLAlchemy type and constraint objects, so
they are tested table by table; :class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource`
calls them once, right after it reflects the table.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from dbtrigger.cursor import kind_of
from dbtrigger.errors import SerializationError, SourceDefinitionError

log = logging.getLogger("dbtrigger.sources")

#: Kinds that compare as numbers: a checkpoint of one is valid against a column of another.
NUMERIC_KINDS = frozenset({"int", "decimal", "float"})

#: Stored kinds a SQLite date/time column accepts: the column is compared as its
#: stored text, and a date/time typed on the command line is rendered to that text.
SQLITE_TEXT_DATETIME_KINDS = frozenset({"str", "naive_timestamp", "timestamp", "date"})

#: ... and, for a declared date/time column (table mode), numbers: SQLite keeps a
#: number written to such a column (Unix time) as a number, which sorts before
#: all text and is bound back as the number it is.
SQLITE_DATETIME_COLUMN_KINDS = SQLITE_TEXT_DATETIME_KINDS | {"int", "float"}

#: PostgreSQL type OIDs and MySQL field-type codes of single-precision floats,
#: for query mode, where only the result description knows the column types.
_PG_FLOAT4_OID = 700
_MYSQL_FLOAT_CODE = 4

#: MySQL field-type codes of date/time columns (TIMESTAMP, DATE, DATETIME, NEWDATE),
#: and the kind their values take, for query mode.
_MYSQL_TEMPORAL_CODES = {7: "naive_timestamp", 10: "date", 12: "naive_timestamp", 14: "date"}

#: The exact Python types whose values are of a kind (the fast path of
#: :meth:`ShapeChecks.check_rows`; anything else is judged by :func:`kind_of`).
_TYPES_OF_KIND: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "bool": (bool,),
    "str": (str,),
    "float": (float,),
    "decimal": (decimal.Decimal,),
    "naive_timestamp": (dt.datetime,),
    "timestamp": (dt.datetime,),
    "date": (dt.date,),
    "uuid": (uuid.UUID,),
    "bytes": (bytes, bytearray, memoryview),
}

#: What pymysql returns for a DATE/DATETIME/TIMESTAMP value no Python date can
#: hold: the zero date, or a date with a zero month or day (``2026-00-10``).
_MYSQL_ZERO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2}:\d{2}(\.\d+)?)?")


def lossy_type_reason(dialect: str, type_: sa.types.TypeEngine[Any]) -> str | None:
    """Why values of this column cannot be compared exactly after a round trip (None: they can)."""
    if isinstance(type_, sa.Float):
        if isinstance(type_, (sa.DOUBLE, sa.DOUBLE_PRECISION)):
            return None
        precision = getattr(type_, "precision", None)
        single = isinstance(type_, sa.REAL) or (precision is not None and precision <= 24)
        if dialect in ("mysql", "mariadb"):
            # FLOAT is single precision there unless FLOAT(p) with p > 24,
            # which reflection already reports as DOUBLE.
            single = type(type_).__name__ == "FLOAT" or single
        if dialect == "sqlite":
            single = False  # SQLite's REAL is always an 8-byte double
        if single:
            return (
                "it is a single-precision float: the database keeps 0.699999988 where the "
                "driver returns 0.7, so a checkpoint bound back compares unequal to its own "
                "row and rows sharing that value are skipped"
            )
        return None
    if isinstance(type_, sa.DateTime) and dialect == "mssql":
        precision = getattr(type_, "precision", None)
        name = type(type_).__name__
        if name in ("DATETIME2", "DATETIMEOFFSET") and (precision is None or precision > 6):
            return (
                f"{name}({7 if precision is None else precision}) keeps 100-nanosecond ticks "
                "that Python's datetime truncates to microseconds, so a checkpoint compares "
                "below its own row"
            )
    return None


def query_column_lossy_reason(dialect: str, type_code: Any) -> str | None:
    """:func:`lossy_type_reason` for a query-mode column, from the driver's type code."""
    if dialect == "postgresql" and type_code == _PG_FLOAT4_OID:
        return lossy_type_reason(dialect, sa.REAL())
    if dialect in ("mysql", "mariadb") and type_code == _MYSQL_FLOAT_CODE:
        return lossy_type_reason("postgresql", sa.REAL())
    return None


def refuse_lossy(column: str, role: str, source: str, reason: str) -> SourceDefinitionError:
    """The error for a cursor or key column that cannot be compared exactly."""
    return SourceDefinitionError(
        f"{role} column {column!r} of {source} cannot be used: {reason}. Fix: poll a "
        f"column of an exact type (integer, numeric/decimal, timestamp), or in query mode "
        f"select it cast to double precision / DOUBLE (CAST({column} AS DOUBLE PRECISION) "
        f"AS {column})",
        column=column,
    )


def kinds_for_type(
    dialect: str, type_: sa.types.TypeEngine[Any], *, compared_as_text: bool = False
) -> frozenset[str] | None:
    """The checkpoint kinds a column of this declared type accepts (None: not known)."""
    if compared_as_text:
        return SQLITE_DATETIME_COLUMN_KINDS
    if isinstance(type_, sa.Boolean):
        return frozenset({"bool", "int"})
    if isinstance(type_, (sa.Integer, sa.Numeric)):
        return NUMERIC_KINDS
    if isinstance(type_, sa.DateTime):
        if dialect != "postgresql":
            # MariaDB/MySQL DATETIME and TIMESTAMP and SQLite come back naive.
            return frozenset({"naive_timestamp"})
        return frozenset({"timestamp" if type_.timezone else "naive_timestamp"})
    if isinstance(type_, sa.Date):
        return frozenset({"date"})
    if isinstance(type_, sa.Uuid) and type_.as_uuid:
        return frozenset({"uuid"})
    if isinstance(type_, (sa.String, sa.Enum)):
        return frozenset({"str"})
    if isinstance(type_, sa.LargeBinary):
        return frozenset({"bytes"})
    return None


def primary_kind(kinds: frozenset[str] | None, type_: sa.types.TypeEngine[Any]) -> str | None:
    """The one kind a value typed for this column should take (``reset --to-cursor``)."""
    if kinds is None:
        return None
    if kinds == NUMERIC_KINDS:
        if isinstance(type_, sa.Integer):
            return "int"
        if isinstance(type_, sa.Float):
            return "float"
        return "decimal"
    if kinds in (SQLITE_TEXT_DATETIME_KINDS, SQLITE_DATETIME_COLUMN_KINDS):
        return "str"
    if "bool" in kinds:
        return "bool"
    return next(iter(kinds))


def describe_kind(kind: str) -> str:
    return {
        "timestamp": "timestamp (with time zone)",
        "naive_timestamp": "timestamp (without time zone)",
        "int": "integer",
        "str": "text",
    }.get(kind, kind)


def kind_mismatch(
    *,
    source: str,
    column: str,
    role: str,
    stored_kind: str,
    column_type: str,
    column_kind: str | None,
) -> SourceDefinitionError:
    """The refusal for a checkpoint whose value no longer fits its column's type."""
    now = f"{column_type} ({describe_kind(column_kind)} values)" if column_kind else column_type
    kind_flag = f" --kind {column_kind}" if role == "cursor" and column_kind else ""
    return SourceDefinitionError(
        f"the checkpoint of {source} holds a {describe_kind(stored_kind)} value for {role} "
        f"column {column!r}, but the column is now {now}: its type changed under the "
        "checkpoint, and comparing the old value with the new type would skip rows. "
        "Fix: re-enter the checkpoint in the new type with `dbtrigger reset POLLER "
        f"--to-cursor VALUE --pk NAME=VALUE{kind_flag} --reason 'cursor type changed' --yes` "
        "(for timestamp -> timestamptz give the old wall-clock value with the zone the "
        "writers used), or start over with `dbtrigger reset POLLER --to-beginning "
        "--reason 'cursor type changed' --yes`",
        column=column,
        stored_kind=stored_kind,
        column_type=column_type,
    )


def check_position_kinds(
    values: Mapping[str, Any],
    expected: Mapping[str, frozenset[str] | None],
    *,
    source: str,
    cursor_column: str,
    type_names: Mapping[str, str],
    primary: Mapping[str, str | None],
) -> None:
    """Raise when a checkpoint value's kind does not fit its column (unknown columns pass)."""
    for column, value in values.items():
        accepted = expected.get(column)
        if accepted is None or value is None:
            continue
        stored = kind_of(value)
        if stored in accepted:
            continue
        raise kind_mismatch(
            source=source,
            column=column,
            role="cursor" if column == cursor_column else "key",
            stored_kind=stored,
            column_type=type_names.get(column, "?"),
            column_kind=primary.get(column),
        )


def _index_is_plain(index: sa.Index) -> bool:
    """A unique index counts as proof only without a predicate and without expressions."""
    if any(key.endswith("_where") and value is not None for key, value in index.kwargs.items()):
        return False
    return all(isinstance(expr, sa.Column) for expr in index.expressions)


def unique_keys(table: sa.Table) -> list[tuple[str, ...]]:
    """Column sets the reflected table declares unique: primary key, constraints, indexes."""
    keys: list[tuple[str, ...]] = []
    if table.primary_key.columns:
        keys.append(tuple(c.name for c in table.primary_key.columns))
    for constraint in table.constraints:
        if isinstance(constraint, sa.UniqueConstraint) and constraint.columns:
            keys.append(tuple(c.name for c in constraint.columns))
    for index in table.indexes:
        if index.unique and _index_is_plain(index):
            keys.append(tuple(c.name for c in index.columns))
    return keys


def unique_key_problem(
    keys: Iterable[Sequence[str]], cursor_column: str, pk_columns: Sequence[str]
) -> str | None:
    """Why ``(cursor, pk)`` is not proven unique by ``keys`` (None: it is).

    A declared unique key made only of position columns proves every position
    names at most one row. A unique key that includes a NULL-able column is
    still proof here: a NULL cursor is excluded and reported, a NULL key refused.
    """
    position = {cursor_column, *pk_columns}
    if any(key and set(key) <= position for key in keys):
        return None
    declared = [list(k) for k in keys]
    return (
        f"no primary key, unique constraint or unique index covers only the position "
        f"columns {sorted(position)} (declared unique: {declared or 'nothing'}); rows "
        "sharing a cursor value and key are skipped at batch boundaries"
    )


def refuse_non_unique(
    source: str, pk_columns: Sequence[str], problem: str
) -> SourceDefinitionError:
    cols = ", ".join(pk_columns)
    return SourceDefinitionError(
        f"pk_columns [{cols}] of {source} are not proven unique: {problem}. Fix: name the "
        f"table's real key in pk_columns, or declare it: ALTER TABLE ... ADD PRIMARY KEY "
        f"({cols}) / CREATE UNIQUE INDEX ... ON ... ({cols}). If it is unique without a "
        "declaration and cannot be declared, poll it in query mode (query=...), where the "
        "key's uniqueness is yours to guarantee",
        pk_columns=list(pk_columns),
    )


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


@functools.cache
def _allowed_types(accepted: frozenset[str]) -> frozenset[type]:
    """The exact Python types whose values are of one of the ``accepted`` kinds (or NULL)."""
    allowed: set[type] = {type(None)}
    for kind in accepted:
        allowed.update(_TYPES_OF_KIND.get(kind, ()))
    return frozenset(allowed)


class ShapeChecks:
    """The checks above, bound to one source: run once after reflection, then per fetch.

    The per-fetch part (:meth:`check_position`) is a few ``isinstance`` calls on
    the checkpoint's values; the database is asked again only in query mode or
    for a column of a type not known here, and then once (one-row sample).
    """

    def __init__(
        self, *, dialect: str, source: str, cursor_column: str, pk_columns: Sequence[str]
    ) -> None:
        self.dialect = dialect
        self.source = source
        self.cursor_column = cursor_column
        self.pk_columns = tuple(pk_columns)
        self.position_columns = tuple(dict.fromkeys((cursor_column, *pk_columns)))
        self.expected: dict[str, frozenset[str] | None] = dict.fromkeys(self.position_columns)
        self.primary: dict[str, str | None] = dict.fromkeys(self.position_columns)
        self.type_names: dict[str, str] = {}
        #: Set when ``(cursor, pk)`` uniqueness could not be proven but was not refused (views).
        self.unverified_unique: str | None = None
        self._sampled = False

    # --- once, after reflection ---------------------------------------------------

    def table_reflected(
        self,
        table: sa.Table,
        *,
        compared_as_text: Iterable[str],
        is_view: Callable[[], bool],
        sql_dialect: sa.Dialect,
    ) -> None:
        """Refuse lossy or non-unique position columns; learn each column's kinds."""
        read_doubles_as_floats(table)
        as_text = set(compared_as_text)
        for name in self.position_columns:
            type_ = table.c[name].type
            role = "cursor" if name == self.cursor_column else "key"
            reason = lossy_type_reason(self.dialect, type_)
            if reason is not None:
                raise refuse_lossy(name, role, self.source, reason)
            kinds = kinds_for_type(self.dialect, type_, compared_as_text=name in as_text)
            self.expected[name] = kinds
            self.primary[name] = primary_kind(kinds, type_)
            self.type_names[name] = _type_name(type_, sql_dialect)
        problem = unique_key_problem(unique_keys(table), self.cursor_column, self.pk_columns)
        if problem is None:
            return
        if not is_view():
            raise refuse_non_unique(self.source, self.pk_columns, problem)
        # A view declares no keys; the table under it may well be keyed. Say so
        # loudly once instead of refusing a definition that may be correct.
        self.unverified_unique = problem
        log.warning(
            "%s is a view: cannot prove pk_columns %s unique (%s); if they are not, rows "
            "are skipped. Poll the underlying table, or check it with `dbtrigger check`",
            self.source,
            list(self.pk_columns),
            problem,
            extra={"event": "unverified_unique_key", "source": self.source},
        )

    def query_probed(self, description: Sequence[Sequence[Any]] | None) -> None:
        """Query mode: refuse single-precision position columns by the driver's type codes.

        MariaDB/MySQL date/time columns learn their kind from the type code too:
        a sampled zero date comes back as text and must not make the column a
        text column (see :meth:`check_rows`).
        """
        if not description:
            return
        codes = {str(d[0]): d[1] for d in description}
        for name in self.position_columns:
            reason = query_column_lossy_reason(self.dialect, codes.get(name))
            if reason is not None:
                role = "cursor" if name == self.cursor_column else "key"
                raise refuse_lossy(name, role, self.source, reason)
            temporal = _MYSQL_TEMPORAL_CODES.get(codes.get(name))  # type: ignore[arg-type]
            if self.dialect in ("mysql", "mariadb") and temporal and self.expected[name] is None:
                self.expected[name] = frozenset({temporal})
                self.primary[name] = temporal
                self.type_names.setdefault(name, "DATE" if temporal == "date" else "DATETIME")

    # --- per fetch ------------------------------------------------------------------

    @property
    def needs_sample(self) -> bool:
        """Some position column's kind is still unknown and no row has been sampled yet."""
        return not self._sampled and None in self.expected.values()

    def learn_from_sample(self, sample: Callable[[], Mapping[str, Any] | None]) -> None:
        """Fill unknown kinds from one row (query mode, unknown types); once a row exists."""
        if not self.needs_sample:
            return
        row = sample()
        if row is None:
            return  # no row yet: nothing a checkpoint could be compared with either
        self._sampled = True
        for name in self.position_columns:
            value = row.get(name)
            if self.expected[name] is not None or value is None:
                continue
            kind = kind_of(value)
            if kind in NUMERIC_KINDS:
                accepted = NUMERIC_KINDS
            elif kind == "str" and self.dialect == "sqlite":
                accepted = SQLITE_TEXT_DATETIME_KINDS
            else:
                accepted = frozenset({kind})
            self.expected[name] = accepted
            self.primary[name] = kind
            self.type_names.setdefault(name, f"a column returning {describe_kind(kind)} values")

    def check_rows(
        self, columns: Sequence[str], tuples: Sequence[Sequence[Any]]
    ) -> dict[int, set[type]]:
        """Refuse a fetched batch holding a position value its column's kinds do not allow.

        Any row of a batch can become the checkpoint (the batch's end, a
        partial commit, the settled window), and the next fetch refuses a
        checkpoint whose kind does not fit its column (:meth:`check_position`)
        as a type change: the poller would stop on its own checkpoint. The
        value is refused here instead, before anything is delivered, naming
        the row. The case that happens: a MariaDB/MySQL zero date, which
        pymysql returns as text. One ``type`` scan per position column at C
        speed; rows are looked at one by one only when it finds a stranger.

        Returns the type sets it collected (column index -> the types of its
        values), which the events' own check of the same tuples takes instead
        of scanning them again (:func:`dbtrigger.events.events_from_rows`).
        """
        found: dict[int, set[type]] = {}
        if not tuples:
            return found
        index = {name: i for i, name in enumerate(columns)}
        for name in self.position_columns:
            accepted, at = self.expected.get(name), index.get(name)
            if accepted is None or at is None:
                continue
            allowed = _allowed_types(accepted)
            types = found[at] = {type(row[at]) for row in tuples}
            if types <= allowed:
                continue
            for row in tuples:
                value = row[at]
                if type(value) in allowed:
                    continue
                try:
                    kind = kind_of(value)
                except SerializationError:
                    continue  # no checkpoint encoding at all: the events' check names it
                if kind not in accepted:
                    key = {c: row[index[c]] for c in self.pk_columns if c in index}
                    raise self._unfit_value(name, value, kind, key)
        return found

    def _unfit_value(
        self, column: str, value: Any, kind: str, key: Mapping[str, Any]
    ) -> SerializationError:
        role = "cursor" if column == self.cursor_column else "key"
        type_name = self.type_names.get(column, "?")
        where = f"row from {self.source} with key {dict(key)!r}: {role} column {column!r}"
        if (
            self.dialect in ("mysql", "mariadb")
            and isinstance(value, str)
            and _MYSQL_ZERO_DATE.fullmatch(value)
        ):
            fix = f"UPDATE ... SET {column} = ... WHERE {column} = '{value}'"  # noqa: S608 - advice
            return SerializationError(
                f"{where} ({type_name}) holds the zero date {value!r} (a MariaDB/MySQL date "
                "with a zero year, month or day), which no Python date can hold: the driver "
                "returns it as text, and a checkpoint at that row would not fit the column's "
                f"type. The batch holding it was not delivered. Fix: set a real date in that "
                f"row ({fix}), keep new zero dates out with sql_mode NO_ZERO_DATE,NO_ZERO_IN_DATE "
                "(with strict mode), or leave such rows out of the source with where=",
                column=column,
                key=dict(key),
            )
        expected = " or ".join(sorted(describe_kind(k) for k in self.expected[column] or ()))
        return SerializationError(
            f"{where} ({type_name}) returned {value!r}, {_a(describe_kind(kind))} value where "
            f"the column's type gives {expected} values: a checkpoint at that row would be "
            "refused by the next fetch as a type change. The batch holding it was not "
            "delivered. Fix the value in that row, or leave the row out of the source with where=",
            column=column,
            key=dict(key),
        )

    def check_position(self, values: Mapping[str, Any]) -> None:
        check_position_kinds(
            values,
            self.expected,
            source=self.source,
            cursor_column=self.cursor_column,
            type_names=self.type_names,
            primary=self.primary,
        )


def read_doubles_as_floats(table: sa.Table) -> None:
    """Read reflected binary floats as Python floats, never as truncated Decimals.

    MariaDB/MySQL reflection marks ``DOUBLE`` columns ``asdecimal=True``, and
    SQLAlchemy then turns each value into a Decimal of ten decimal places:
    0.30000000000000004 comes back as 0.3000000000. As a cursor that value is
    bound back below its own row, so the row is delivered again forever and
    rows tied with it are skipped; as payload it silently loses digits. A float
    column's value is a double; it is delivered as one.
    """
    for column in table.columns:
        type_ = column.type
        if isinstance(type_, sa.Float) and type_.asdecimal:
            type_.asdecimal = False


def _type_name(type_: sa.types.TypeEngine[Any], dialect: sa.Dialect) -> str:
    try:
        return str(type_.compile(dialect=dialect))
    except Exception:  # noqa: BLE001 - a type without generic DDL: its class name says enough
        return type(type_).__name__


__all__ = [
    "NUMERIC_KINDS",
    "ShapeChecks",
    "check_position_kinds",
    "kind_mismatch",
    "kinds_for_type",
    "lossy_type_reason",
    "primary_kind",
    "query_column_lossy_reason",
    "refuse_lossy",
    "refuse_non_unique",
    "unique_key_problem",
    "unique_keys",
]
