"""Binlog row values made the values a query of the same row gives.

The replication package decodes a few column types differently from PyMySQL,
which reads the table for a snapshot chunk (and for cursor polling): a ``SET``
comes as a Python ``set`` (and an empty one as None, as if NULL), a ``BIT(n)``
as a text of ``0``/``1`` digits, MariaDB's ``UUID`` and ``INET6`` as their 16
stored bytes, a ``BINARY(n)`` (those two included) without the zero bytes it
ends with (the log stores it so), an empty binary value as the text ``''``, a
``FLOAT`` as the single-precision number's exact double (``0.10000000149011612``
where the query gives ``0.1``, printed with 6 significant digits) and the
year ``0000`` as 1900. One row would then have one value (and for a ``UUID`` key, one
key) in its snapshot event and another in every change after it: a consumer
keyed by ``pk`` saw two rows, and a set's ``repr`` (its image's CRC in the
history) changed from process to process. So each table map gets a converter
per column that turns the decoded value into what the query returns:
``'a,c'`` (members in definition order, ``''`` when empty), ``bytes`` of the
column's width, the canonical text of the UUID or address, the float rounded
as the server prints it, and 0. (``FLOAT(M,D)``, printed with ``D`` decimals,
still differs.)

Dates and times the package gets wrong are put right too. A negative ``TIME``
with a fraction is stored as one negative packed number (whole seconds one
lower, fraction counted back from the next second); the package negates the
two parts apart, so ``-00:00:01.25`` came as ``-00:00:01.75``. A zero date
(``0000-00-00``, which MariaDB accepts by default) is text in a query
(PyMySQL cannot make it a date), but the package makes a ``DATE`` or
``DATETIME`` one None, a real NULL, and a ``TIMESTAMP`` one 1970-01-01 00:00:00,
a moment no ``TIMESTAMP`` can hold (its range starts a second later): each is
now the query's zero text. A date with a zero part only (``2026-00-00``,
refused under ``NO_ZERO_IN_DATE``) is None in the log too and cannot be told
from the zero date: it arrives as the zero date.

A snapshot chunk's values travel as JSON (:func:`encode_value`, tagged for the
types JSON lacks) and come back as the same Python values.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import ipaddress
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dbtrigger.errors import SerializationError

Converter = Callable[[Any, str | None], Any]
"""(decoded value, the package's reason for a None or None) -> the query's value."""

_SET = 248  # pymysqlreplication.constants.FIELD_TYPE.SET
_BIT = 16  # FIELD_TYPE.BIT
_FLOAT = 4  # FIELD_TYPE.FLOAT
_YEAR = 13  # FIELD_TYPE.YEAR
_YEAR_ZERO = 1900  # the package's YEAR is the stored byte + 1900; 0 is the year 0000
_TIMESTAMP, _TIMESTAMP2 = 7, 17  # FIELD_TYPE.TIMESTAMP, TIMESTAMP2
_DATE, _NEWDATE, _DATETIME, _DATETIME2 = 10, 14, 12, 18
_TIME2 = 19  # FIELD_TYPE.TIME2: TIME with fractional seconds (MySQL 5.6+, MariaDB 10.1+)
_EPOCH = dt.datetime(1970, 1, 1)  # the package's naive UTC
_SECOND = dt.timedelta(seconds=1)
EMPTY_SET = "empty set"  # pymysqlreplication.constants.NONE_SOURCE.EMPTY_SET


def _set(members: Sequence[str]) -> Converter:
    def convert(value: Any, none_source: str | None) -> Any:
        if value is None:
            return "" if none_source == EMPTY_SET else None
        if isinstance(value, (set, frozenset)):
            return ",".join(m for m in members if m in value)
        return value

    return convert


def _bit(width: int) -> Converter:
    def convert(value: Any, none_source: str | None) -> Any:
        if isinstance(value, str) and value and set(value) <= {"0", "1"}:
            return int(value, 2).to_bytes(width, "big")
        return value

    return convert


def _binary(width: int) -> Converter:
    """Bytes (``''`` when empty), padded with the zero bytes the log left off to ``width``."""

    def convert(value: Any, none_source: str | None) -> Any:
        if value == "":
            value = b""
        if isinstance(value, (bytes, bytearray)) and len(value) < width:
            return bytes(value).ljust(width, b"\0")
        return value

    return convert


def _float(value: Any, none_source: str | None) -> Any:
    """A ``FLOAT`` as the server prints it (6 significant digits), not the float32's double."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def _year(value: Any, none_source: str | None) -> Any:
    return 0 if value == _YEAR_ZERO else value


def _zero_text(fsp: int, *, date_only: bool = False) -> str:
    """The zero date as the server prints it (``0000-00-00 00:00:00.000`` for ``(3)``)."""
    if date_only:
        return "0000-00-00"
    return "0000-00-00 00:00:00" + (f".{'0' * fsp}" if fsp else "")


def _zero_date(fsp: int, *, date_only: bool = False) -> Converter:
    """A ``DATE``/``DATETIME`` the package made None for being out of range: the zero date."""
    zero = _zero_text(fsp, date_only=date_only)

    def convert(value: Any, none_source: str | None) -> Any:
        if value is None and none_source is not None and none_source.startswith("out of date"):
            return zero
        return value

    return convert


def _zero_timestamp(fsp: int) -> Converter:
    """A ``TIMESTAMP`` stored as 0 (the zero date), which the package made the epoch."""
    zero = _zero_text(fsp)

    def convert(value: Any, none_source: str | None) -> Any:
        return zero if value == _EPOCH else value

    return convert


def _time2(value: Any, none_source: str | None) -> Any:
    """A negative ``TIME`` with a fraction as stored: ``-(s + f)``, not ``-(s + 1 - f)``.

    The package reads ``-(whole + 1 - fraction)`` (the stored whole part is one
    lower, the stored fraction counts back from it) and negates them apart;
    whole values and positive ones it reads right.
    """
    if isinstance(value, dt.timedelta) and value < dt.timedelta(0):
        back = -value
        fraction = back % _SECOND
        if fraction:
            return -(back - fraction + (_SECOND - fraction))
    return value


_VARBINARY = _binary(0)
_BYTES16 = _binary(16)


def _uuid(value: Any, none_source: str | None) -> Any:
    value = _BYTES16(value, none_source)
    if isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return str(uuid.UUID(bytes=bytes(value)))
    return value


def inet6_text(raw: bytes) -> str:
    """An ``INET6`` value as MariaDB prints it (IPv4-mapped and -compatible in dotted form)."""
    address = ipaddress.IPv6Address(raw)
    mapped = address.ipv4_mapped
    if mapped is not None:
        return f"::ffff:{mapped}"
    if raw[:12] == bytes(12) and int.from_bytes(raw[12:], "big") > 1:
        return f"::{ipaddress.IPv4Address(raw[12:])}"
    return address.compressed


def _inet6(value: Any, none_source: str | None) -> Any:
    value = _BYTES16(value, none_source)
    if isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return inet6_text(bytes(value))
    return value


_BY_CATALOG_TYPE: Mapping[str, Converter] = {
    "uuid": _uuid,
    "inet6": _inet6,
    **dict.fromkeys(("varbinary", "tinyblob", "blob", "mediumblob", "longblob"), _VARBINARY),
}


def converters(
    columns: Sequence[Any], names: Sequence[str], catalog: Mapping[str, str]
) -> tuple[Converter | None, ...] | None:
    """One converter (or None) per column of a table map; None when no column needs one.

    ``columns`` are the table map's columns, ``names`` their names, ``catalog``
    each column's ``information_schema`` ``DATA_TYPE`` now (``UUID``, ``INET6``
    and binary strings are strings in the log, told apart only by the catalog).
    """
    out: list[Converter | None] = []
    for column, name in zip(columns, names, strict=False):
        kind = getattr(column, "type", None)
        if kind == _SET and getattr(column, "set_values", None):
            out.append(_set(tuple(column.set_values)))
        elif kind == _BIT:
            out.append(_bit(int(getattr(column, "bytes", 0)) or 1))
        elif kind == _FLOAT:
            out.append(_float)
        elif kind == _YEAR:
            out.append(_year)
        elif kind == _TIME2:
            out.append(_time2)
        elif kind in (_TIMESTAMP, _TIMESTAMP2):
            out.append(_zero_timestamp(int(getattr(column, "fsp", 0) or 0)))
        elif kind in (_DATE, _NEWDATE):
            out.append(_zero_date(0, date_only=True))
        elif kind in (_DATETIME, _DATETIME2):
            out.append(_zero_date(int(getattr(column, "fsp", 0) or 0)))
        elif catalog.get(name) == "binary":
            out.append(_binary(int(getattr(column, "max_length", 0) or 0)))
        else:
            out.append(_BY_CATALOG_TYPE.get(catalog.get(name, "")))
    return tuple(out) if any(c is not None for c in out) else None


def values(
    image: Mapping[str, Any],
    none_sources: Mapping[str, str] | None,
    convert: Sequence[Converter | None] | None,
) -> tuple[Any, ...]:
    """A decoded row image as the value tuple the query of the row gives."""
    raw = tuple(image.values())
    if convert is None:
        return raw
    sources = none_sources or {}
    names = tuple(image.keys())
    return tuple(
        v if c is None else c(v, sources.get(n))
        for v, c, n in zip(raw, convert, names, strict=False)
    )


# --- snapshot chunk values ------------------------------------------------------------------


def encode_value(value: Any) -> Any:
    """A column value as JSON that :func:`decode_value` turns back into the same type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, decimal.Decimal):
        return {"$dec": str(value)}
    if isinstance(value, dt.datetime):
        return {"$dt": value.isoformat()}
    if isinstance(value, dt.date):
        return {"$date": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {"$td": value.total_seconds()}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (set, frozenset)):
        return {"$set": sorted(str(v) for v in value)}
    return str(value)


def decode_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    ((tag, raw),) = value.items()
    if tag == "$dec":
        return decimal.Decimal(raw)
    if tag == "$dt":
        return dt.datetime.fromisoformat(raw)
    if tag == "$date":
        return dt.date.fromisoformat(raw)
    if tag == "$td":
        return dt.timedelta(seconds=raw)
    if tag == "$b":
        return base64.b64decode(raw)
    if tag == "$set":
        return set(raw)
    raise SerializationError(f"snapshot chunk value with unknown tag {tag!r}")


__all__ = ["Converter", "converters", "decode_value", "encode_value", "inet6_text", "values"]
