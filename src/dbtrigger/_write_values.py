"""Values a write refuses before the driver sees them, and MariaDB's JSON columns (internal).

Some values reach the table changed, silently, or fail in a way that reads as
the database being unwell (retried for ever); both are refused here, naming
the row and the column, as :class:`~dbtrigger.errors.OutputValueError`:

* a **time-zone-aware datetime in a column without a time zone** (SQLite,
  MariaDB/MySQL ``DATETIME``/``TIMESTAMP``, PostgreSQL ``timestamp``): SQLite
  and PyMySQL drop the offset (10:00+02:00 is stored as 10:00), PostgreSQL
  converts to the session's time zone (08:00 under UTC): the same row would
  hold another instant on each database. dbtrigger never guesses a zone
  (docs/sources.md), so the caller says which wall clock the column keeps;
* a **NaN or infinity** on MariaDB/MySQL, which cannot store one (PyMySQL
  refuses it as a ProgrammingError);
* a **NUL character** in a string on PostgreSQL, whose text cannot hold one
  (psycopg refuses it as a DataError);
* a **naive datetime in a column with a time zone** (PostgreSQL
  ``timestamptz``): read in the session's ``TimeZone``, so the instant stored
  depends on the server's setting;
* **finer than the column keeps**: microseconds in a ``timestamp(0)``,
  ``DATETIME`` or ``TIME`` (PostgreSQL rounds them, 10:00:00.999999 becoming
  10:00:01; MariaDB cuts them off), more digits after the point than a
  ``NUMERIC(p, s)`` keeps (rounded on all three), a fraction in an integer
  column (rounded on PostgreSQL and MariaDB), a Decimal or int a binary float
  column cannot hold as written, and on SQLite a Decimal its ``NUMERIC``
  (a binary float there) would round;
* **bytes in a text column** (PostgreSQL stores their hex escape as the text),
  text in a binary column (psycopg raised a TypeError of its own), a datetime
  with a time of day in a ``DATE`` column (the time cut off), a time with a
  zone in a ``TIME`` column (the offset dropped), and on SQLite a Decimal,
  UUID, timedelta or time its driver cannot send to the column (it failed as
  the database's error, retried);
* a **row larger than MariaDB/MySQL's** ``max_allowed_packet``: the server
  drops the connection on such a statement, which reads as "server has gone
  away" (a network hiccup, retried for ever); :func:`packet_misfit` tells it
  from one after the fact.

MariaDB has no JSON type of its own: ``JSON`` is ``LONGTEXT`` with a
``CHECK (json_valid(col))``, reflected as ``LONGTEXT``. A dict given to it was
refused ("give the column a type that holds it (JSON)" - it was one).
:func:`mark_json_columns` gives such columns :class:`MariaDbJson`: a dict, a
list, a number or a bool is sent as its JSON text; a string is sent as it is,
JSON text already (what the earlier refusal told people to send:
``json.dumps(...)``), so it is not encoded twice.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger.errors import OutputValueError


class MariaDbJson(sa.TypeDecorator[Any]):
    """A MariaDB ``JSON`` column (``LONGTEXT`` checked by ``json_valid``): values other
    than strings are sent as JSON text; strings, JSON text already, as they are. Read
    back as text, as before (a reader's rows do not change type)."""

    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None or isinstance(value, str):
            return value
        return json.dumps(value)


def mark_json_columns(conn: Connection, table: sa.Table) -> None:
    """On MariaDB, give each ``LONGTEXT`` column checked by ``json_valid`` (what
    ``CREATE TABLE ... (c JSON)`` made) the type :class:`MariaDbJson`. A server
    without ``information_schema.CHECK_CONSTRAINTS`` (before 10.2) has no such check."""
    if not getattr(conn.dialect, "is_mariadb", False):
        return
    clauses: list[Any] = []
    with contextlib.suppress(SQLAlchemyError):
        clauses = list(
            conn.execute(
                sa.text(
                    "SELECT CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS WHERE "
                    "CONSTRAINT_SCHEMA = COALESCE(:schema, DATABASE()) AND TABLE_NAME = :name"
                ),
                {"schema": table.schema, "name": table.name},
            )
        )
    for (clause,) in clauses:
        text = str(clause).strip()
        if not (text.startswith("json_valid(`") and text.endswith("`)")):
            continue
        name = text[len("json_valid(`") : -2].replace("``", "`")
        if name in table.c and isinstance(table.c[name].type, sa.String):
            table.c[name].type = MariaDbJson()


def refuse_values(
    dialect: str, table: sa.Table, rows: Sequence[Mapping[str, Any]], where: str
) -> None:
    """Refuse the first value of ``rows`` its column would not store as given (the
    module doc).

    Raises:
        OutputValueError: names the row, the column and what to do; never the value.
    """
    mysql = dialect in ("mysql", "mariadb")
    columns = list(rows[0]) if rows else []
    for column in columns:
        kind = table.c[column].type
        naive_column = isinstance(kind, sa.DateTime) and not getattr(kind, "timezone", False)
        text_column = isinstance(kind, sa.String)
        for index, row in enumerate(rows):
            value = row.get(column)
            if value is None:
                continue
            if naive_column and isinstance(value, dt.datetime) and value.tzinfo is not None:
                why = (
                    "is time-zone aware and the column keeps no time zone (stored as it is, "
                    "the offset would be dropped on SQLite and MariaDB/MySQL, converted to "
                    "the session's zone on PostgreSQL). Give the wall-clock time the column "
                    "keeps: value.astimezone(datetime.timezone.utc).replace(tzinfo=None) for "
                    "UTC, or make it a column with a time zone (PostgreSQL timestamptz)"
                )
            elif mysql and _not_finite(value):
                why = (
                    "is NaN or infinite, which MariaDB/MySQL cannot store. Write None "
                    "(NULL) or a number instead"
                )
            elif dialect == "postgresql" and text_column and _holds_nul(value):
                why = (
                    "holds a NUL character ('\\x00'), which PostgreSQL text cannot store. "
                    "Remove it (value.replace('\\x00', '')) or write bytes to a bytea column"
                )
            else:
                found = misfit(dialect, kind, value)
                if found is None:
                    continue
                why = found
            raise _refused(where, index, column, kind, value, why)


def misfit(dialect: str, kind: Any, value: Any) -> str | None:
    """Why ``value`` would reach a column of type ``kind`` changed, or not at all
    (None: it reaches it as given): the rest of the list in the module doc. The
    reason reads after "the value of column 'c' (TYPE)"."""
    why = _changed(dialect, kind, value)
    if why is None and dialect == "sqlite":
        why = _unsendable_on_sqlite(kind, value)
    return why


def _changed(dialect: str, kind: Any, value: Any) -> str | None:
    if isinstance(value, dt.datetime) and isinstance(kind, sa.Date):
        if value.tzinfo is not None or value.time() != dt.time(0):
            return (
                "is a datetime with a time of day (or a time zone) and the column keeps "
                "a date: the time would be cut off. Write value.date() if the date is "
                "what you mean, or make the column a timestamp/DATETIME"
            )
        return None
    if isinstance(value, dt.time) and isinstance(kind, sa.Time):
        if value.tzinfo is not None and not getattr(kind, "timezone", False):
            return (
                "is a time with a time zone and the column keeps none: the offset would "
                "be dropped. Write the wall-clock time the column keeps "
                "(value.replace(tzinfo=None))"
            )
        return _finer_than(dialect, kind, value)
    if isinstance(value, str) and isinstance(kind, sa.LargeBinary):
        return (
            "is text and the column keeps bytes. Encode it (value.encode('utf-8')) or "
            "write it to a text column"
        )
    if isinstance(value, dt.datetime) and isinstance(kind, sa.DateTime):
        if value.tzinfo is None and getattr(kind, "timezone", False) is True:
            return (
                "is a naive datetime and the column keeps an instant (timestamp with time "
                "zone): the database would read it in the session's time zone, whatever "
                "that is on the server the row reaches. Say which zone it is in: "
                "value.replace(tzinfo=datetime.timezone.utc) for a UTC wall clock"
            )
        return _finer_than(dialect, kind, value)
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        if isinstance(value, (bytes, bytearray, memoryview)) and isinstance(kind, sa.String):
            return (
                "is bytes and the column keeps text (PostgreSQL would store the bytes' hex "
                "escape as the text, MariaDB/MySQL decode them, SQLite keeps a blob). "
                "Decode them (value.decode('utf-8')) or write them to a binary column "
                "(bytea, BLOB)"
            )
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN/infinity: left to the database (refused on MariaDB above)
    if isinstance(value, Decimal) and not value.is_finite():
        return None
    exact = value if isinstance(value, Decimal) else Decimal(repr(value))
    if isinstance(kind, sa.Integer):
        if exact != exact.to_integral_value():
            return (
                "has a fraction and the column keeps whole numbers: the database would "
                "round it (or keep it on SQLite only). Round it yourself (int(value), "
                "round(value)) or make the column NUMERIC/DECIMAL"
            )
        return None
    if isinstance(kind, sa.Float):
        if isinstance(value, float):
            return None  # a binary float into a binary float column: the caller's choice
        if _float_holds(exact, single=_single_float(dialect, kind)):
            return None
        return (
            "has more significant digits than the column's binary floating point holds: "
            "it would be stored rounded. Round it (float(value) is what would be stored) "
            "or make the column NUMERIC/DECIMAL"
        )
    if isinstance(kind, sa.Numeric):
        scale = getattr(kind, "scale", None)
        places = max(0, -int(exact.normalize().as_tuple().exponent))
        if scale is not None and places > scale:
            return (
                f"has {places} digits after the decimal point and the column keeps {scale}: "
                "the database would round it. Round it first "
                f"(value.quantize(Decimal('1e-{scale}'))) or give the column a larger scale"
            )
        if dialect == "sqlite" and not _float_holds(exact, single=False):
            return (
                "has more significant digits than SQLite keeps in a NUMERIC column, which it "
                "stores as a binary float (about 15): it would be stored rounded. Store it as "
                "text (str(value)) in a TEXT column, or round it"
            )
    return None


#: What sqlite3 cannot send itself (it raises "type ... is not supported", which read as
#: the database failing), with what to write instead; SQLAlchemy converts them for some
#: column types (a Decimal for NUMERIC, a UUID for Uuid), never for one reflected as text.
_SQLITE_UNSENDABLE: tuple[tuple[type[Any], str], ...] = (
    (Decimal, "str(value), or int(value) / float(value) for a number column"),
    (UUID, "str(value)"),
    (dt.timedelta, "value.total_seconds()"),
    (dt.time, "value.isoformat()"),
)


@functools.cache
def _sqlite_dialect() -> Dialect:
    from sqlalchemy.dialects.sqlite import pysqlite  # noqa: PLC0415

    return pysqlite.dialect()


def _unsendable_on_sqlite(kind: Any, value: Any) -> str | None:
    for python_type, instead in _SQLITE_UNSENDABLE:
        if isinstance(value, python_type) and not isinstance(value, dt.datetime):
            dialect = _sqlite_dialect()
            if kind.dialect_impl(dialect).bind_processor(dialect) is not None:
                return None  # the column type converts it (NUMERIC, TIME, Uuid)
            return (
                f"is a {python_type.__name__}, which SQLite's driver cannot send to a "
                f"column of this type. Write {instead}"
            )
    return None


def _finer_than(dialect: str, kind: Any, value: dt.datetime | dt.time) -> str | None:
    """The reason a time of day with microseconds finer than the column's fractional
    seconds is refused: PostgreSQL rounds them (10:00:00.9999995 to the next second),
    MariaDB/MySQL truncate them."""
    if dialect == "postgresql":
        digits = getattr(kind, "precision", None)
        digits = 6 if digits is None else digits
    elif dialect in ("mysql", "mariadb"):
        digits = getattr(kind, "fsp", None) or 0
    else:
        return None  # SQLite keeps the text SQLAlchemy writes, all six digits
    if digits >= 6 or value.microsecond % 10 ** (6 - digits) == 0:
        return None
    kept = value.microsecond - value.microsecond % 10 ** (6 - digits)
    return (
        f"has microseconds ({value.microsecond:06d}) and the column keeps {digits} digit(s) "
        "of a second: the database would round or cut them off. Drop them first "
        f"(value.replace(microsecond={kept})) or widen the column "
        "(timestamp(6), DATETIME(6), TIME(6))"
    )


def _single_float(dialect: str, kind: Any) -> bool:
    """Is ``kind`` a 4-byte float (PostgreSQL ``real``, MariaDB/MySQL ``FLOAT``)?"""
    if dialect == "postgresql":
        return isinstance(kind, sa.REAL)
    if dialect in ("mysql", "mariadb"):
        return type(kind).__name__ == "FLOAT"
    return False


def _float_holds(exact: Decimal, *, single: bool) -> bool:
    """Does a binary float (8-byte, or 4-byte when ``single``) keep ``exact`` as written?"""
    try:
        as_float = float(exact)
    except OverflowError:
        return False
    if not math.isfinite(as_float):
        return False
    if single:
        # 6 significant digits always survive a 4-byte float (FLT_DIG), and
        # MariaDB/MySQL show a FLOAT with 6.
        digits = len(exact.normalize().as_tuple().digits)
        return digits <= 6 and abs(as_float) < 3.4e38
    # Exactly that binary value (2**70), or the one its shortest text reads back as (0.1).
    return Decimal(as_float) == exact or Decimal(repr(as_float)) == exact


def unserializable_json(
    dialect: Dialect, table: sa.Table, rows: Sequence[Mapping[str, Any]], where: str
) -> OutputValueError | None:
    """The error of the first value of a JSON column that the engine's JSON serializer
    (``json_serializer=``, else ``json.dumps``) cannot write (None: none)."""
    serialize = getattr(dialect, "_json_serializer", None) or json.dumps
    columns = [c for c in (rows[0] if rows else ()) if isinstance(table.c[c].type, sa.JSON)]
    for index, row in enumerate(rows):
        for column in columns:
            value = row.get(column)
            try:
                serialize(value)
            except (TypeError, ValueError) as exc:
                first = (str(exc).splitlines() or [""])[0][:200]
                why = (
                    f"holds something JSON cannot hold ({first}). Convert it first "
                    "(value.isoformat() for a datetime, str(...) for a Decimal or a UUID), "
                    "or give the engine a json_serializer that does"
                )
                return _refused(where, index, column, table.c[column].type, value, why)
    return None


def in_key_order(
    table: sa.Table, rows: Sequence[Mapping[str, Any]], conflict_columns: Sequence[str]
) -> list[dict[str, Any]]:
    """``rows`` (copies) sorted by their key: ``conflict_columns``, else the table's
    primary key when the rows give all of it; as given when they cannot be compared.

    Two writers (functions, instances, lanes) whose rows share keys take the rows'
    locks in the order of their rows: in opposite orders each waits for the other,
    and the database ends one as a deadlock victim (PostgreSQL after its
    ``deadlock_timeout``, a second each). 20 threads writing 10 of 40 keys each,
    in random order, spent minutes in deadlocks; in one order they take locks
    alike and only wait. The sort is stable: a key given twice in one write keeps
    its rows' order (the last one wins an upsert, as before). Errors still name a
    row by its place in ``rows``, since they are told from the rows as given.
    A table with a foreign key to itself keeps the order given: a parent row
    must come before the rows that refer to it, whatever their keys.
    """
    copies = [dict(r) for r in rows]
    keys = list(conflict_columns) or [c.name for c in table.primary_key.columns]
    if len(copies) < 2 or not keys or any(k not in copies[0] for k in keys):
        return copies
    if any(fk.column.table is table for fk in table.foreign_keys):
        return copies
    try:
        return sorted(copies, key=lambda r: tuple((r[k] is None, r[k]) for k in keys))
    except TypeError:  # values of kinds that do not compare (None beside None, mixed)
        return copies


#: What MariaDB/MySQL (and PyMySQL) say when the server dropped a statement too large
#: for ``max_allowed_packet``: gone away, lost during the query, packet too large.
_PACKET_CODES = frozenset({2006, 2013, 1153})


def packet_misfit(
    engine: Engine, exc: BaseException, rows: Sequence[Mapping[str, Any]], where: str
) -> OutputValueError | None:
    """The error of a MariaDB/MySQL write that lost its connection because a row alone
    is larger than the server's ``max_allowed_packet`` (None: not that).

    Only a row whose values' own bytes reach the limit counts (the statement that
    carries it is larger still), so a connection lost for another reason stays a
    retryable failure. The limit is read on another connection of the pool.
    """
    orig = getattr(exc, "orig", None) or exc
    args = getattr(orig, "args", ())
    if not (args and args[0] in _PACKET_CODES and type(orig).__module__.startswith("pymysql")):
        return None
    sizes = [
        {c: len(v.encode()) if isinstance(v, str) else len(v) for c, v in row.items() if _sized(v)}
        for row in rows
    ]
    largest = max((sum(s.values()) for s in sizes), default=0)
    if largest == 0:
        return None
    try:
        with engine.connect() as conn:
            limit = int(conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar() or 0)
    except SQLAlchemyError:
        return None
    for index, size in enumerate(sizes):
        total = sum(size.values())
        if limit and total >= limit:
            column = max(size, key=lambda c: size[c])
            return OutputValueError(
                f"cannot write row {index} to {where}: its values are {total} bytes "
                f"(column {column!r} {size[column]}), more than the server's "
                f"max_allowed_packet ({limit} bytes), so the server dropped the connection "
                f"({args[0]}, not a network failure). Writing it again cannot help: raise "
                "max_allowed_packet on the server (SET GLOBAL and its configuration file) "
                "or write a smaller value",
                table=where,
                column=column,
                value_type=type(rows[index][column]).__name__,
                row=index,
            )
    return None


def _sized(value: Any) -> bool:
    return isinstance(value, (str, bytes, bytearray))


def _not_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, Decimal):
        return not value.is_finite()
    return False


def _holds_nul(value: Any) -> bool:
    return isinstance(value, str) and "\x00" in value


def type_text(kind: Any) -> str:
    """How an error names a column's type: ``VARCHAR(20)``, or the name of its
    class when it cannot render itself."""
    try:
        return str(kind)
    except Exception:  # noqa: BLE001 - a type that cannot render itself is still a type
        return type(kind).__name__


def _refused(
    where: str, index: int, column: str, kind: Any, value: Any, why: str
) -> OutputValueError:
    shown = type_text(kind)
    return OutputValueError(
        f"cannot write row {index} to {where}: the value of column {column!r} ({shown}) "
        f"{why}. Writing it again cannot help",
        table=where,
        column=column,
        value_type=type(value).__name__,
        row=index,
    )


__all__ = [
    "MariaDbJson",
    "in_key_order",
    "mark_json_columns",
    "misfit",
    "packet_misfit",
    "refuse_values",
    "type_text",
    "unserializable_json",
]
