"""Cursor values and positions, and their exact JSON encoding.

A poller's progress is a *position*: the cursor column's value plus the
primary-key values of the last row delivered (the tiebreaker). Positions are
totally ordered the same way the fetch query orders rows:
``(cursor, pk...)`` ascending, with a NULL cursor sorting before every value.

The state document is JSON, which knows ints, strings and floats only. Every
other cursor type is written as a string plus a *kind* tag so that it reads back
as the very same Python value and can be bound to the query with its own type:
a timestamp is never compared as a string, a Decimal never loses digits, and
microseconds survive.

Naive timestamps are kept naive (kind ``naive_timestamp``): dbtrigger never
guesses a time zone for a ``TIMESTAMP WITHOUT TIME ZONE`` column, it writes the
wall-clock value exactly as the database returned it and binds it back the same
way. Aware timestamps are normalised to UTC (kind ``timestamp``), written with a
trailing ``Z``.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from dbtrigger.errors import CorruptStateError, SerializationError

#: Kinds a cursor or tiebreaker value can have in the state document.
KINDS = (
    "null",
    "int",
    "str",
    "float",
    "decimal",
    "timestamp",
    "naive_timestamp",
    "date",
    "uuid",
    "bytes",
    "bool",
)


def kind_of(value: Any) -> str:
    """Name the state-document kind of a Python value from a driver.

    Raises:
        SerializationError: the value has a type dbtrigger cannot round-trip.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "str"
    if isinstance(value, float):
        return "float"
    if isinstance(value, decimal.Decimal):
        return "decimal"
    if isinstance(value, dt.datetime):
        return "naive_timestamp" if value.tzinfo is None else "timestamp"
    if isinstance(value, dt.date):
        return "date"
    if isinstance(value, uuid.UUID):
        return "uuid"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    raise SerializationError(
        f"cursor/key value of type {type(value).__name__} cannot be stored in a checkpoint; "
        "use an integer, decimal, timestamp, date, uuid, string or binary column",
        value_type=type(value).__name__,
    )


#: Why a NaN cannot be a cursor or key value, and what to do about it.
_NAN = (
    "the value is NaN (not a number), which has no place in the order the poller walks "
    "(the database sorts it after every number, Python cannot compare it, and a checkpoint "
    "at NaN would pass every later row); put a number in that row, or keep NaN out of the "
    "column (PostgreSQL: CHECK (col <> 'NaN')) or out of the source (where=)"
)


def _iso_utc(value: dt.datetime) -> str:
    # Drivers hand back UTC values almost always (psycopg in a UTC session), and
    # then one isoformat() call is the whole job: its "+00:00" becomes "Z". Any
    # other offset is converted first. Both give the same text for the same instant.
    text = value.isoformat(timespec="microseconds")
    if text.endswith("+00:00"):
        return text[:-6] + "Z"
    utc = value.astimezone(dt.timezone.utc)
    return utc.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def encode_value(value: Any) -> tuple[str, Any]:
    """Encode a value as ``(kind, json_value)``; the pair decodes back exactly."""
    kind = kind_of(value)
    encoded: Any
    if kind in ("null", "int", "str", "bool"):
        encoded = value
    elif kind == "float":
        if math.isnan(value):
            raise SerializationError(_NAN, value_type="float")
        encoded = repr(value)  # repr round-trips IEEE doubles exactly (inf too)
    elif kind == "decimal":
        if value.is_nan():
            raise SerializationError(_NAN, value_type="Decimal")
        encoded = str(value)  # "Infinity"/"-Infinity" round-trip and order too
    elif kind == "timestamp":
        encoded = _iso_utc(value)
    elif kind == "naive_timestamp":
        encoded = value.isoformat(timespec="microseconds")
    elif kind == "date":
        encoded = value.isoformat()
    elif kind == "uuid":
        encoded = str(value)
    else:  # bytes
        encoded = bytes(value).hex()
    return kind, encoded


def decode_value(kind: str, encoded: Any) -> Any:
    """Inverse of :func:`encode_value`.

    Raises:
        CorruptStateError: the stored pair is not a valid encoding.
    """
    try:
        if kind == "null":
            if encoded is not None:
                raise ValueError("null kind with a value")
            return None
        if kind == "int":
            if not isinstance(encoded, int) or isinstance(encoded, bool):
                raise TypeError("expected an integer")
            return encoded
        if kind == "bool":
            if not isinstance(encoded, bool):
                raise TypeError("expected a boolean")
            return encoded
        if kind == "str":
            if not isinstance(encoded, str):
                raise TypeError("expected a string")
            return encoded
        if not isinstance(encoded, str):
            raise TypeError(f"expected a string for kind {kind!r}")
        if kind == "float":
            return float(encoded)
        if kind == "decimal":
            return decimal.Decimal(encoded)
        if kind == "timestamp":
            if not encoded.endswith("Z"):
                raise ValueError("aware timestamps are stored in UTC with a trailing Z")
            return dt.datetime.fromisoformat(encoded[:-1]).replace(tzinfo=dt.timezone.utc)
        if kind == "naive_timestamp":
            parsed = dt.datetime.fromisoformat(encoded)
            if parsed.tzinfo is not None:
                raise ValueError("naive timestamp carries an offset")
            return parsed
        if kind == "date":
            return dt.date.fromisoformat(encoded)
        if kind == "uuid":
            return uuid.UUID(encoded)
        if kind == "bytes":
            return bytes.fromhex(encoded)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise CorruptStateError(
            f"stored cursor value {encoded!r} is not a valid {kind!r}: {exc}"
        ) from exc
    raise CorruptStateError(f"unknown cursor kind {kind!r}; known kinds: {', '.join(KINDS)}")


def infer_kind(encoded: Any) -> str:
    """Kind of a tiebreaker value written without an explicit kind (seed format)."""
    if encoded is None or isinstance(encoded, (int, str)):  # bool is an int
        return kind_of(encoded)
    raise CorruptStateError(f"tiebreaker value {encoded!r} has no kind and is not an int or string")


@dataclass(frozen=True)
class Position:
    """Where a poller stands: the last delivered row's cursor and primary key.

    ``Position.BEGINNING`` (no cursor, no key) sorts before every row, including
    rows whose cursor is NULL.
    """

    cursor: Any = None
    pk: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_beginning(self) -> bool:
        return self.cursor is None and not self.pk

    def pk_tuple(self, pk_columns: tuple[str, ...]) -> tuple[Any, ...]:
        try:
            return tuple(self.pk[name] for name in pk_columns)
        except KeyError as exc:
            raise CorruptStateError(
                f"checkpoint tiebreaker lacks primary-key column {exc.args[0]!r}; "
                f"it has {sorted(self.pk)}"
            ) from exc


BEGINNING = Position()


def canonical_json(value: Any) -> str:
    """Deterministic JSON of encoded values, for hashes that must match across processes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def encoded_pk(pk: Mapping[str, Any]) -> dict[str, Any]:
    """Primary-key mapping with every value encoded as ``[kind, value]``."""
    return {name: list(encode_value(value)) for name, value in pk.items()}


#: ``text`` as a JSON string literal, escaped exactly as :func:`canonical_json`
#: escapes it (the same C routine ``json.dumps`` uses with ``ensure_ascii``).
json_string: Callable[[str], str] = encode_basestring_ascii


def encoded_json(value: Any) -> str:
    """``canonical_json(list(encode_value(value)))``, fast for the common key types.

    Event ids hash the canonical JSON of every row's key and cursor, so this
    runs once per key column per row. Exact ``int``, ``str`` and ``datetime``
    values (what drivers return for the usual key and cursor columns) are
    written directly; everything else goes through the general encoder. The
    text is identical either way: compact JSON of a list is its items' JSON
    joined by commas, and strings are escaped by the same routine ``json``
    uses with ``ensure_ascii``.

    Raises:
        SerializationError: the value has a type dbtrigger cannot round-trip.
    """
    kind = type(value)
    if value is None:  # a claim queue's rows have no cursor
        return '["null",null]'
    if kind is int:
        return '["int",' + int.__repr__(value) + "]"
    if kind is str:
        return '["str",' + json_string(value) + "]"
    if kind is dt.datetime:
        if value.tzinfo is None:
            wall: str = value.isoformat(timespec="microseconds")
            return '["naive_timestamp","' + wall + '"]'
        return '["timestamp","' + _iso_utc(value) + '"]'
    return canonical_json(list(encode_value(value)))


def pk_json(pk: Mapping[str, Any]) -> str:
    """``canonical_json(encoded_pk(pk))``: keys sorted, values as ``[kind, value]``."""
    if not all(type(name) is str for name in pk):
        return canonical_json(encoded_pk(pk))
    return "{" + ",".join(json_string(n) + ":" + encoded_json(pk[n]) for n in sorted(pk)) + "}"


def pk_hash(pk: Mapping[str, Any]) -> str:
    """Stable short hash of a primary key (same value, same hash, any driver)."""
    return hashlib.sha256(pk_json(pk).encode()).hexdigest()[:16]


def cursor_text(value: Any) -> str:
    """The cursor as stable text: the state document's encoding, ``null`` for NULL."""
    kind, encoded = encode_value(value)
    return "null" if kind == "null" else str(encoded)
