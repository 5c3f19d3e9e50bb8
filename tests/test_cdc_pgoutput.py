"""The pgoutput decoder, table by table, without a database.

The golden messages were captured from PostgreSQL 15 (``pg_logical_slot_peek_binary_changes``
with ``proto_version 1``, ``messages true``) for this script::

    create table t (id int primary key, name text, big text, amount numeric,
                    at timestamptz, flag bool);            -- big: storage external
    create table f (k int, v text); alter table f replica identity full;
    insert into t values (1, 'a', repeat('x', 3000), 1.5, '2024-01-02 03:04:05.123456+00', true),
                         (2, null, 'small', null, null, false);
    update t set name = 'b' where id = 1;                 -- big stays unchanged (TOAST)
    update t set id = 5 where id = 2;                     -- the key changes
    delete from t where id = 5;
    insert into f values (1, 'x'); update f set v = 'y'; delete from f;
    select pg_logical_emit_message(true, 'pfx', 'hello');
    truncate t;

The streaming (protocol 2) messages are built by hand from the documented layout.
"""

from __future__ import annotations

import datetime as dt
import decimal
import struct
import uuid

import pytest

from dbtrigger.cdc import pgoutput as po
from dbtrigger.cdc.changes import UNCHANGED

X3000 = "78" * 3000
G = {
    "begin": "4200000000019562a800030427f243c23d000002e2",
    "relation_t": (
        "52000040127075626c69630074006400060169640000000017ffffffff006e616d65000000"
        "0019ffffffff006269670000000019ffffffff00616d6f756e7400000006a4ffffffff0061"
        "7400000004a0ffffffff00666c61670000000010ffffffff"
    ),
    "insert_1": (
        "49000040124e00067400000001317400000001617400000bb8"
        + X3000
        + "7400000003312e35740000001d323032342d30312d30322030333a30343a30352e3132333435"
        "362b3030740000000174"
    ),
    "insert_2": "49000040124e00067400000001326e7400000005736d616c6c6e6e740000000166",
    "commit": "430000000000019562a800000000019562d800030427f243c23d",
    "update_toast": (
        "55000040124e0006740000000131740000000162757400000003312e35740000001d323032"
        "342d30312d30322030333a30343a30352e3132333435362b3030740000000174"
    ),
    "update_key": (
        "55000040124b00067400000001326e6e6e6e6e4e00067400000001356e7400000005736d61"
        "6c6c6e6e740000000166"
    ),
    "delete_key": "44000040124b00067400000001356e6e6e6e6e",
    "relation_f": (
        "52000040197075626c6963006600660002016b0000000017ffffffff01760000000019ffffffff"
    ),
    "update_full": ("55000040194f00027400000001317400000001784e0002740000000131740000000179"),
    "delete_full": "44000040194f0002740000000131740000000179",
    "message": "4d010000000001956698706678000000000568656c6c6f",
    "truncate": "54000000010000004012",
}


def golden(name: str) -> po.Decoded:
    return po.decode(bytes.fromhex(G[name]))


AT = "2024-01-02 03:04:05.123456+00"


def test_begin_and_commit() -> None:
    begin = golden("begin")
    assert isinstance(begin, po.Begin)
    assert begin.final_lsn == po.parse_lsn("0/19562A8")
    assert begin.xid == 738
    assert begin.commit_time.tzinfo is dt.timezone.utc
    commit = golden("commit")
    assert isinstance(commit, po.Commit)
    assert commit.commit_lsn == begin.final_lsn  # Begin names the commit it ends with
    assert commit.end_lsn == po.parse_lsn("0/19562D8")
    assert commit.commit_time == begin.commit_time


def test_relation_under_default_and_full_identity() -> None:
    t = golden("relation_t")
    assert isinstance(t, po.Relation)
    assert (t.oid, t.qualified, t.replica_identity) == (0x4012, "public.t", "d")
    assert [(c.name, c.type_oid, c.is_key) for c in t.columns] == [
        ("id", po.INT4, True),
        ("name", po.TEXT, False),
        ("big", po.TEXT, False),
        ("amount", po.NUMERIC, False),
        ("at", po.TIMESTAMPTZ, False),
        ("flag", po.BOOL, False),
    ]
    assert all(c.type_modifier == -1 for c in t.columns)
    f = golden("relation_f")
    assert isinstance(f, po.Relation)
    assert f.replica_identity == "f"
    assert all(c.is_key for c in f.columns)  # FULL: every column is part of the identity


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("insert_1", (b"1", b"a", b"x" * 3000, b"1.5", AT.encode(), b"t")),
        ("insert_2", (b"2", None, b"small", None, None, b"f")),
    ],
)
def test_inserts(name: str, expected: tuple[object, ...]) -> None:
    message = golden(name)
    assert isinstance(message, po.Insert)
    assert message.relation_oid == 0x4012
    assert message.new == expected


def test_an_unchanged_toasted_value_is_the_marker_not_null() -> None:
    message = golden("update_toast")
    assert isinstance(message, po.Update)
    assert message.old is None  # DEFAULT identity, key untouched: no old image
    assert message.new[2] is UNCHANGED
    assert message.new[1] == b"b"


def test_update_of_the_key_carries_the_old_key() -> None:
    message = golden("update_key")
    assert isinstance(message, po.Update)
    assert message.old_kind == "K"
    assert message.old == (b"2", None, None, None, None, None)
    assert message.new[0] == b"5"


@pytest.mark.parametrize(
    ("name", "kind", "old"),
    [("delete_key", "K", (b"5", None, None, None, None, None)), ("delete_full", "O", (b"1", b"y"))],
)
def test_deletes(name: str, kind: str, old: tuple[object, ...]) -> None:
    message = golden(name)
    assert isinstance(message, po.Delete)
    assert (message.old_kind, message.old) == (kind, old)


def test_update_under_full_identity_carries_the_whole_old_row() -> None:
    message = golden("update_full")
    assert isinstance(message, po.Update)
    assert (message.old_kind, message.old, message.new) == ("O", (b"1", b"x"), (b"1", b"y"))


def test_logical_message_and_truncate() -> None:
    message = golden("message")
    assert message == po.Message(True, po.parse_lsn("0/1956698"), "pfx", b"hello")
    truncate = golden("truncate")
    assert truncate == po.Truncate((0x4012,), cascade=False, restart_identity=False)


# --- hand-built messages: the rest of the protocol -----------------------------------------


def s(text: str) -> bytes:
    return text.encode() + b"\0"


def tup(*cols: bytes | str | None) -> bytes:
    out = struct.pack(">h", len(cols))
    for col in cols:
        if col is None:
            out += b"n"
        elif col == "u":
            out += b"u"
        else:
            assert isinstance(col, bytes)
            out += b"t" + struct.pack(">i", len(col)) + col
    return out


XID = struct.pack(">I", 77)
TS = struct.pack(">q", 86_400_000_000)  # one day after 2000-01-01


@pytest.mark.parametrize(
    ("data", "in_stream", "expected"),
    [
        (b"O" + struct.pack(">Q", 5) + s("node1"), False, po.Origin(5, "node1")),
        (
            b"Y" + struct.pack(">I", 9) + s("public") + s("mood"),
            False,
            po.Type(9, "public", "mood"),
        ),
        (
            b"Y" + XID + struct.pack(">I", 9) + s("public") + s("mood"),
            True,
            po.Type(9, "public", "mood", 77),
        ),
        (
            b"I" + XID + struct.pack(">I", 3) + b"N" + tup(b"1"),
            True,
            po.Insert(3, (b"1",), 77),
        ),
        (
            b"D" + XID + struct.pack(">I", 3) + b"K" + tup(b"1"),
            True,
            po.Delete(3, "K", (b"1",), 77),
        ),
        (
            b"U" + struct.pack(">I", 3) + b"N" + tup(b"1", "u", None),
            False,
            po.Update(3, None, None, (b"1", UNCHANGED, None)),
        ),
        (
            b"T" + XID + struct.pack(">iB", 2, 3) + struct.pack(">II", 4, 5),
            True,
            po.Truncate((4, 5), cascade=True, restart_identity=True, xid=77),
        ),
        (
            b"M" + XID + b"\0" + struct.pack(">Q", 8) + s("p") + struct.pack(">i", 0),
            True,
            po.Message(False, 8, "p", b"", 77),
        ),
        (b"S" + XID + b"\x01", False, po.StreamStart(77, True)),
        (b"E", False, po.StreamStop()),
        (
            b"c" + XID + b"\0" + struct.pack(">QQ", 10, 20) + TS,
            False,
            po.StreamCommit(77, 0, 10, 20, po.PG_EPOCH + dt.timedelta(days=1)),
        ),
        (b"A" + XID + struct.pack(">I", 78), False, po.StreamAbort(77, 78)),
        (
            b"A" + XID + struct.pack(">I", 78) + struct.pack(">Q", 1) + TS,  # version 4
            False,
            po.StreamAbort(77, 78),
        ),
        (
            b"R" + struct.pack(">I", 3) + s("") + s("pg_class") + b"n" + struct.pack(">h", 0),
            False,
            po.Relation(3, "", "pg_class", "n", ()),
        ),
    ],
)
def test_every_message_type(data: bytes, in_stream: bool, expected: po.Decoded) -> None:
    assert po.decode(data, in_stream=in_stream) == expected


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "ends early"),
        (b"Z", "unknown pgoutput message type 'Z'"),
        (bytes.fromhex(G["begin"])[:-1], "message ends"),
        (bytes.fromhex(G["begin"]) + b"\0", "trailing"),
        (b"I" + struct.pack(">I", 3) + b"X" + tup(b"1"), "expected new tuple 'N'"),
        (b"U" + struct.pack(">I", 3) + b"Q" + tup(b"1"), "expected new tuple 'N'"),
        (b"D" + struct.pack(">I", 3) + b"N" + tup(b"1"), "expected 'K' or 'O'"),
        (b"I" + struct.pack(">I", 3) + b"N" + struct.pack(">h", 1) + b"z", "unknown column kind"),
        (b"R" + struct.pack(">I", 3) + b"public", "unterminated string"),
    ],
)
def test_malformed_messages_are_decode_errors(data: bytes, problem: str) -> None:
    with pytest.raises(po.DecodeError, match=problem):
        po.decode(data)


def test_a_binary_column_value_is_kept_as_bytes() -> None:
    data = b"I" + struct.pack(">I", 3) + b"N" + struct.pack(">h", 1) + b"b"
    data += struct.pack(">i", 2) + b"\x00\x01"
    assert po.decode(data) == po.Insert(3, (b"\x00\x01",))


# --- LSNs and values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value", "token"),
    [
        ("0/0", 0, "00000000/00000000"),
        ("0/19562A8", 0x19562A8, "00000000/019562A8"),
        ("16/B374D848", (0x16 << 32) | 0xB374D848, "00000016/B374D848"),
        ("FFFFFFFF/FFFFFFFF", 2**64 - 1, "FFFFFFFF/FFFFFFFF"),
    ],
)
def test_lsn_spellings(text: str, value: int, token: str) -> None:
    assert po.parse_lsn(text) == value
    assert po.parse_lsn(token) == value
    assert po.lsn_text(value) == text
    assert po.lsn_token(value) == token


def test_lsn_tokens_sort_as_lsns() -> None:
    values = [0x1_0000_0000, 0xFFFF_FFFF, 0x10, 0xA, 0x2_0000_0000]
    assert sorted(values, key=po.lsn_token) == sorted(values)


@pytest.mark.parametrize("text", ["", "12", "/1", "1/", "123456789/0", "x/1"])
def test_not_an_lsn(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message is incidental here
        po.parse_lsn(text)


UTC = dt.timezone.utc


@pytest.mark.parametrize(
    ("oid", "text", "value"),
    [
        (po.BOOL, "t", True),
        (po.BOOL, "f", False),
        (po.INT4, "-7", -7),
        (po.INT8, "9223372036854775807", 2**63 - 1),
        (po.NUMERIC, "1.50", decimal.Decimal("1.50")),
        (po.NUMERIC, "NaN", decimal.Decimal("NaN")),
        (po.FLOAT8, "Infinity", float("inf")),
        (po.TEXT, "héllo", "héllo"),
        (
            po.UUID,
            "12345678-1234-5678-1234-567812345678",
            uuid.UUID(int=0x12345678123456781234567812345678),
        ),
        (po.DATE, "2024-02-29", dt.date(2024, 2, 29)),
        (po.DATE, "infinity", "infinity"),
        (po.TIMESTAMP, "2024-01-02 03:04:05", dt.datetime(2024, 1, 2, 3, 4, 5)),
        (po.TIMESTAMP, "2024-01-02 03:04:05.12", dt.datetime(2024, 1, 2, 3, 4, 5, 120000)),
        (po.TIMESTAMPTZ, AT, dt.datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)),
        (
            po.TIMESTAMPTZ,
            "2024-01-02 03:04:05+05:30",
            dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
        ),
        (po.TIMESTAMPTZ, "-infinity", "-infinity"),
        (po.TIMESTAMP, "0044-03-15 12:00:00 BC", "0044-03-15 12:00:00 BC"),
        (po.BYTEA, "\\x00ff", b"\x00\xff"),
        (po.JSONB, '{"a": 1.5, "b": [1]}', {"a": decimal.Decimal("1.5"), "b": [1]}),
        (po.TIME, "12:34:56.5", dt.time(12, 34, 56, 500000)),
        (1009, "{1,2}", "{1,2}"),  # an array: kept as the server's text
        (po.INT4, "not a number", "not a number"),  # unreadable: text, never a failed batch
    ],
)
def test_convert(oid: int, text: str, value: object) -> None:
    got = po.convert(oid, text.encode())
    if isinstance(value, decimal.Decimal) and value.is_nan():
        assert isinstance(got, decimal.Decimal)
        assert got.is_nan()
    else:
        assert got == value
        assert type(got) is type(value)


def test_convert_keeps_null_and_unchanged() -> None:
    assert po.convert(po.TEXT, None) is None
    assert po.convert(po.TEXT, UNCHANGED) is UNCHANGED
