"""A decoder for PostgreSQL's ``pgoutput`` logical replication messages.

Pure functions over bytes, no database: :func:`decode` turns one message (one
row of ``pg_logical_slot_peek_binary_changes``, or one ``XLogData`` payload of
the streaming protocol) into a small frozen record. Protocol version 1 is
decoded in full; version 2's streaming messages (a large transaction sent in
pieces before it commits) are decoded too, for a reader that asks for them.
The format is documented in PostgreSQL's "Logical Replication Message
Formats"; every field below is named as there.

Column values stay as the server sent them: bytes of the type's text output
(``pgoutput`` sends text unless asked for binary), None for NULL, and
:data:`~dbtrigger.cdc.changes.UNCHANGED` for an unchanged TOASTed value. Turning
text into Python values by type OID is :func:`convert`, also pure.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from struct import Struct
from struct import error as struct_error
from typing import Any

from dbtrigger.cdc.changes import UNCHANGED, Unchanged

_I16 = Struct(">h")
_I32 = Struct(">i")
_U32 = Struct(">I")
_I64 = Struct(">q")
_U64 = Struct(">Q")

#: PostgreSQL's epoch for timestamps in the protocol: microseconds since this.
PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)

Value = bytes | None | Unchanged


class DecodeError(ValueError):
    """The bytes are not a well-formed pgoutput message."""


# --- records -------------------------------------------------------------------------


@dataclass(frozen=True)
class Begin:
    """A transaction starts; ``final_lsn`` is where it commits (its position in the log)."""

    final_lsn: int
    commit_time: dt.datetime
    xid: int


@dataclass(frozen=True)
class Commit:
    """The transaction ends; ``end_lsn`` is where the log may be released past it."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: dt.datetime


@dataclass(frozen=True)
class Origin:
    """The transaction was replayed from another node (logical replication origin)."""

    lsn: int
    name: str


@dataclass(frozen=True)
class Column:
    """One column of a Relation: its name, type and whether it is in the replica identity."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """Part of the replica identity (under ``FULL``: every column)."""
        return bool(self.flags & 1)


@dataclass(frozen=True)
class Relation:
    """A table's shape, sent before its first change in a decoding session (and again
    after it changed); changes name their table by ``oid``."""

    oid: int
    namespace: str
    name: str
    replica_identity: str  # d(efault), n(othing), f(ull), i(ndex)
    columns: tuple[Column, ...]
    xid: int | None = None

    @property
    def qualified(self) -> str:
        return f"{self.namespace or 'pg_catalog'}.{self.name}"


@dataclass(frozen=True)
class Type:
    """A non-built-in type used by a Relation's column."""

    oid: int
    namespace: str
    name: str
    xid: int | None = None


@dataclass(frozen=True)
class Insert:
    """A new row (``new`` holds every column's text value)."""

    relation_oid: int
    new: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True)
class Update:
    """A changed row; ``old`` is the key (``K``) or the whole row (``O``) when the replica
    identity and the change make the server send it."""

    relation_oid: int
    old_kind: str | None  # "K" (key columns only), "O" (the whole old row), None
    old: tuple[Value, ...] | None
    new: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True)
class Delete:
    """A deleted row: its key (``K``) or, under ``REPLICA IDENTITY FULL``, the whole row (``O``)."""

    relation_oid: int
    old_kind: str  # "K" or "O"
    old: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True)
class Truncate:
    """``TRUNCATE`` of one or more tables (no row events follow)."""

    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool
    xid: int | None = None


@dataclass(frozen=True)
class Message:
    """A logical message (``pg_logical_emit_message``): heartbeats and snapshot chunks."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes
    xid: int | None = None


@dataclass(frozen=True)
class StreamStart:
    """Protocol 2+: part of an in-progress transaction follows (not used by this reader)."""

    xid: int
    first_segment: bool


@dataclass(frozen=True)
class StreamStop:
    """Protocol 2+: the streamed part ends."""


@dataclass(frozen=True)
class StreamCommit:
    """Protocol 2+: a streamed transaction committed."""

    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: dt.datetime


@dataclass(frozen=True)
class StreamAbort:
    """Protocol 2+: a streamed (sub)transaction rolled back."""

    xid: int
    subxid: int


Decoded = (
    Begin
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | Message
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
)


# --- the reader ----------------------------------------------------------------------


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = bytes(data)
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise DecodeError(f"message ends at byte {len(self.data)}, needed {end}")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise DecodeError("message ends early")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def char(self) -> str:
        return chr(self.byte())

    def i16(self) -> int:
        return int(_I16.unpack(self._take(2))[0])

    def i32(self) -> int:
        return int(_I32.unpack(self._take(4))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self._take(8))[0])

    def timestamp(self) -> dt.datetime:
        micros = int(_I64.unpack(self._take(8))[0])
        return PG_EPOCH + dt.timedelta(microseconds=micros)

    def string(self) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise DecodeError("unterminated string")
        out = self.data[self.pos : end].decode()
        self.pos = end + 1
        return out

    def tuple_data(self) -> tuple[Value, ...]:
        values, self.pos = read_tuple(self.data, self.pos)
        return values

    def done(self) -> None:
        if self.pos != len(self.data):
            raise DecodeError(f"{len(self.data) - self.pos} trailing byte(s)")


_UNPACK_I16 = _I16.unpack_from
_UNPACK_I32 = _I32.unpack_from


def read_tuple(data: bytes, pos: int) -> tuple[tuple[Value, ...], int]:
    """TupleData starting at ``pos``: its values and the position after it.

    The hot path of every change, so written without the reader object.

    Raises:
        DecodeError: truncated data or an unknown column kind.
    """
    try:
        (count,) = _UNPACK_I16(data, pos)
        pos += 2
        values: list[Value] = []
        append = values.append
        for _ in range(count):
            kind = data[pos]
            pos += 1
            if kind == 0x74 or kind == 0x62:  # 't', 'b'  # noqa: PLR1714 - two byte codes
                (length,) = _UNPACK_I32(data, pos)
                pos += 4
                end = pos + length
                if end > len(data):
                    raise DecodeError(f"message ends at byte {len(data)}, needed {end}")
                append(data[pos:end])
                pos = end
            elif kind == 0x6E:  # 'n'
                append(None)
            elif kind == 0x75:  # 'u'
                append(UNCHANGED)
            else:
                raise DecodeError(f"unknown column kind {chr(kind)!r} in tuple data")
    except (IndexError, struct_error) as exc:
        raise DecodeError(f"message ends early: {exc}") from None
    return tuple(values), pos


def _xid(r: _Reader, in_stream: bool) -> int | None:
    return r.u32() if in_stream else None


def _relation(r: _Reader, xid: int | None) -> Relation:
    oid = r.u32()
    namespace = r.string()
    name = r.string()
    identity = r.char()
    count = r.i16()
    columns = []
    for _ in range(count):
        flags = r.byte()
        column = r.string()
        type_oid = r.u32()
        modifier = r.i32()
        columns.append(Column(flags, column, type_oid, modifier))
    return Relation(oid, namespace, name, identity, tuple(columns), xid)


def _update(r: _Reader, xid: int | None) -> Update:
    oid = r.u32()
    kind = r.char()
    old_kind: str | None = None
    old = None
    if kind in ("K", "O"):
        old_kind, old = kind, r.tuple_data()
        kind = r.char()
    if kind != "N":
        raise DecodeError(f"update: expected new tuple 'N', got {kind!r}")
    return Update(oid, old_kind, old, r.tuple_data(), xid)


def _delete(r: _Reader, xid: int | None) -> Delete:
    oid = r.u32()
    kind = r.char()
    if kind not in ("K", "O"):
        raise DecodeError(f"delete: expected 'K' or 'O', got {kind!r}")
    return Delete(oid, kind, r.tuple_data(), xid)


def _truncate(r: _Reader, xid: int | None) -> Truncate:
    count = r.i32()
    options = r.byte()
    oids = tuple(r.u32() for _ in range(count))
    return Truncate(oids, bool(options & 1), bool(options & 2), xid)


def _message(r: _Reader, xid: int | None) -> Message:
    flags = r.byte()
    lsn = r.u64()
    prefix = r.string()
    length = r.i32()
    return Message(bool(flags & 1), lsn, prefix, r._take(length), xid)


def decode(data: bytes | bytearray | memoryview, *, in_stream: bool = False) -> Decoded:
    """One pgoutput message.

    ``in_stream``: the message sits between a Stream Start and a Stream Stop
    (protocol version 2), where data messages carry the transaction id first.

    Raises:
        DecodeError: unknown message type, truncated or trailing bytes.
    """
    r = _Reader(data)
    kind = r.char()
    out: Decoded
    if kind == "B":
        out = Begin(r.u64(), r.timestamp(), r.u32())
    elif kind == "C":
        out = Commit(r.byte(), r.u64(), r.u64(), r.timestamp())
    elif kind == "O":
        out = Origin(r.u64(), r.string())
    elif kind == "R":
        out = _relation(r, _xid(r, in_stream))
    elif kind == "Y":
        xid = _xid(r, in_stream)
        out = Type(r.u32(), r.string(), r.string(), xid)
    elif kind == "I":
        xid = _xid(r, in_stream)
        oid = r.u32()
        tag = r.char()
        if tag != "N":
            raise DecodeError(f"insert: expected new tuple 'N', got {tag!r}")
        out = Insert(oid, r.tuple_data(), xid)
    elif kind == "U":
        out = _update(r, _xid(r, in_stream))
    elif kind == "D":
        out = _delete(r, _xid(r, in_stream))
    elif kind == "T":
        out = _truncate(r, _xid(r, in_stream))
    elif kind == "M":
        out = _message(r, _xid(r, in_stream))
    elif kind == "S":
        out = StreamStart(r.u32(), r.byte() == 1)
    elif kind == "E":
        out = StreamStop()
    elif kind == "c":
        out = StreamCommit(r.u32(), r.byte(), r.u64(), r.u64(), r.timestamp())
    elif kind == "A":
        out = StreamAbort(r.u32(), r.u32())
        r.pos = len(r.data)  # version 4 adds the abort LSN and time: not needed here
    else:
        raise DecodeError(f"unknown pgoutput message type {kind!r}")
    r.done()
    return out


# --- LSNs ----------------------------------------------------------------------------


def lsn_text(lsn: int) -> str:
    """PostgreSQL's own spelling: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_token(lsn: int) -> str:
    """A fixed-width spelling whose text order is LSN order: ``00000016/B374D848``."""
    return f"{lsn >> 32:08X}/{lsn & 0xFFFFFFFF:08X}"


def parse_lsn(text: str) -> int:
    """``16/B374D848`` (or the fixed-width form) as an integer.

    Raises:
        ValueError: not an LSN.
    """
    high, sep, low = text.partition("/")
    if not sep or not high or not low or len(high) > 8 or len(low) > 8:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(high, 16) << 32) | int(low, 16)


# --- values --------------------------------------------------------------------------

#: Type OIDs of the built-in types converted to Python values.
BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, FLOAT4, FLOAT8, BPCHAR, VARCHAR, DATE, TIME = 114, 700, 701, 1042, 1043, 1082, 1083
TIMESTAMP, TIMESTAMPTZ, NUMERIC, UUID, JSONB = 1114, 1184, 1700, 2950, 3802


_FROMISOFORMAT_READS_POSTGRES = sys.version_info >= (3, 11)
_TIMESTAMP = re.compile(
    r"^(\d{4,}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d{1,6}))?([+-]\d\d(?::?\d\d)?)?$"
)


def _timestamp(text: str) -> dt.datetime | str:
    """``timestamp``/``timestamptz`` output as Python (``infinity`` and BC dates stay text).

    Python 3.11's ``fromisoformat`` reads PostgreSQL's output as it is; 3.10's
    accepts neither trimmed fractions (``.12``) nor ``+00`` offsets, so there
    it is spelled out.
    """
    if _FROMISOFORMAT_READS_POSTGRES:
        try:
            return dt.datetime.fromisoformat(text)
        except ValueError:
            return text  # infinity, -infinity, BC dates, years past 9999
    match = _TIMESTAMP.match(text)
    if match is None:
        return text  # infinity, -infinity, BC dates, years past 9999: no Python value
    base, fraction, offset = match.groups()
    value = dt.datetime.fromisoformat(base)
    if fraction:
        value = value.replace(microsecond=int(fraction.ljust(6, "0")))
    if offset:
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        minutes = int(digits[:2]) * 60 + int(digits[2:4] or 0)
        value = value.replace(tzinfo=dt.timezone(sign * dt.timedelta(minutes=minutes)))
        if minutes == 0:
            value = value.replace(tzinfo=dt.timezone.utc)
    return value


def _date(text: str) -> dt.date | str:
    if text in ("infinity", "-infinity") or text.endswith(" BC"):
        return text
    return dt.date.fromisoformat(text)


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    raise ValueError("bytea not in hex output format (set bytea_output = 'hex')")


def _json(text: str) -> Any:
    return json.loads(text, parse_float=decimal.Decimal)


_CONVERTERS: dict[int, Callable[[str], Any]] = {
    BOOL: lambda t: t == "t",
    INT2: int,
    INT4: int,
    INT8: int,
    OID: int,
    FLOAT4: float,
    FLOAT8: float,
    NUMERIC: decimal.Decimal,
    TEXT: str,
    VARCHAR: str,
    BPCHAR: str,
    NAME: str,
    CHAR: str,
    UUID: uuid.UUID,
    DATE: _date,
    TIME: dt.time.fromisoformat,
    TIMESTAMP: _timestamp,
    TIMESTAMPTZ: _timestamp,
    BYTEA: _bytea,
    JSON: _json,
    JSONB: _json,
}


def converter(type_oid: int) -> Callable[[str], Any] | None:
    """The text-to-Python conversion for a type OID; None: the text is the value."""
    found = _CONVERTERS.get(type_oid)
    return None if found is str else found


def convert(type_oid: int, value: Value) -> Any:
    """One column value as Python: NULL -> None, unchanged stays :data:`UNCHANGED`.

    The text is the type's output as the server wrote it (the session runs with
    ``TimeZone=UTC``, ``DateStyle=ISO`` and ``bytea_output=hex``, so timestamps
    with a zone come back aware in UTC). A value the conversion cannot read is
    kept as text rather than failing the batch.
    """
    if value is None or value is UNCHANGED:
        return value
    text = bytes(value).decode()  # type: ignore[arg-type]
    convert_text = converter(type_oid)
    if convert_text is None:
        return text
    try:
        return convert_text(text)
    except (ValueError, ArithmeticError):
        return text


__all__ = [
    "PG_EPOCH",
    "Begin",
    "Column",
    "Commit",
    "DecodeError",
    "Decoded",
    "Delete",
    "Insert",
    "Message",
    "Origin",
    "Relation",
    "StreamAbort",
    "StreamCommit",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "Type",
    "Update",
    "convert",
    "converter",
    "decode",
    "lsn_text",
    "lsn_token",
    "parse_lsn",
]
