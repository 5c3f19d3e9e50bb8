"""The history's per-event lines made a batch at a time equal those made event by event.

A committed batch's history lines (event id, key, image CRC) and its digests
are computed for every delivered row, so the common batch (rows from one
source read, a one-column int or text key) takes a faster path; these tests
hold it to the reference, value for value, including the awkward values.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import marshal
import uuid
import zlib
from typing import Any

import pytest

from dbtrigger.errors import ReplayRefusedError
from dbtrigger.events import RowChange, RowShape, event_ids, events_from_rows, key_dict
from dbtrigger.history import images
from dbtrigger.history import records as rec
from dbtrigger.history.recorder import MAX_RECORD_BYTES, HistoryRecorder
from dbtrigger.history.records import _RECORD_KEYS
from dbtrigger.history.store import EncodedRecord, encode_json, encode_line, numbered
from dbtrigger.state.document import JournalRecord, digest_event_ids

UTC = dt.timezone.utc

CASES: list[tuple[tuple[str, ...], tuple[str, ...], str, list[tuple[Any, ...]]]] = [
    (
        ("id", "updated_at", "payload"),
        ("id",),
        "updated_at",
        [(i, i // 3, f"p{i}") for i in range(50)],
    ),
    (
        ("k", "ts", "v"),
        ("k",),
        "ts",
        [
            (
                f'k\u00e9{i}"\\x%',
                dt.datetime(2026, 1, 1, tzinfo=UTC) + dt.timedelta(seconds=i),
                decimal.Decimal("1.5"),
            )
            for i in range(20)
        ],
    ),
    (
        ("k", "ts", "v"),
        ("k",),
        "ts",
        [(f"k{i}", dt.datetime(2026, 1, 1) + dt.timedelta(seconds=i), None) for i in range(9)],
    ),
    (("id", "ts", "v"), ("id",), "ts", [(i, float(i) + 0.5, "\ud800 lone") for i in range(5)]),
    (("id", "ts", "v"), ("id",), "ts", [(i, i, {"nested": [1, 2]}) for i in range(5)]),
    (("id", "ts", "v"), ("id",), "ts", [(i, i, b"\x00\xff") for i in range(5)]),
    (("id", "ts", "v"), ("id",), "ts", [(-(2**70) + i, i, "big") for i in range(5)]),
    (("id",), ("id",), "id", [(i,) for i in range(3)]),
    (("a", "b", "ts"), ("a", "b"), "ts", [(i, f"x{i}", i) for i in range(5)]),
    (("id", "ts", "v"), ("id",), "ts", [(uuid.UUID(int=i), i, "u") for i in range(5)]),
    (("id", "ts", "v"), ("id",), "ts", [(True, 1, "bool key"), (2, 2, "int key")]),
]


def _shape(columns: tuple[str, ...], pk: tuple[str, ...], cursor: str) -> RowShape:
    return RowShape(
        columns, cursor_column=cursor, pk_columns=pk, source="s", poller='p%"q', batch_id="b"
    )


@pytest.mark.parametrize(("columns", "pk", "cursor", "rows"), CASES)
def test_batch_event_ids_equal_the_ids_read_one_by_one(
    columns: tuple[str, ...], pk: tuple[str, ...], cursor: str, rows: list[tuple[Any, ...]]
) -> None:
    shape = _shape(columns, pk, cursor)
    events = events_from_rows(shape, rows)
    ids = event_ids(events)
    assert ids == [shape.event_id(r) for r in rows]
    assert [e._event_id for e in events] == ids  # kept by the events
    digest = hashlib.sha256()
    for eid in ids:
        digest.update(eid.encode() + b"\n")
    assert digest_event_ids(ids) == "sha256:" + digest.hexdigest()


@pytest.mark.parametrize(("columns", "pk", "cursor", "rows"), CASES)
def test_the_batch_columns_equal_what_each_event_says(
    columns: tuple[str, ...], pk: tuple[str, ...], cursor: str, rows: list[tuple[Any, ...]]
) -> None:
    # The columns are computed a batch at a time; read back, each line is the
    # event's own key and image CRC (the reference a replay computes event by event).
    shape = _shape(columns, pk, cursor)
    events = events_from_rows(shape, rows)
    detail = rec.batch_detail(events)
    lines = rec.detail_lines({"detail": json.loads(json.dumps(detail))})
    assert lines is not None
    assert [line.key for line in lines] == [rec._key(e) for e in events]
    form = detail["format"]
    assert [line.image for line in lines] == [f"{rec.image_crc(e, form):08x}" for e in events]
    assert all(e._event_id is None for e in events)  # no id was computed for them
    # A row changed in any column (cursor included) changes its CRC.
    changed = events_from_rows(shape, [(*rows[0][:-1], "changed"), *rows[1:]])
    assert rec.image_crc(changed[0]) != rec.image_crc(events[0])
    assert rec.columns_digest(rec.batch_detail(changed)) != rec.columns_digest(detail)


@pytest.mark.parametrize(("columns", "pk", "cursor", "rows"), CASES)
def test_a_rows_key_as_a_dict_is_its_views(
    columns: tuple[str, ...], pk: tuple[str, ...], cursor: str, rows: list[tuple[Any, ...]]
) -> None:
    # key_dict (what position_of reads) takes a plain row's key from its tuple.
    for plain in (True, False):
        shape = RowShape(
            columns,
            cursor_column=cursor,
            pk_columns=pk,
            source="s",
            poller="p",
            batch_id="b",
            plain=plain,
        )
        events = events_from_rows(shape, rows)
        keys = [key_dict(e) for e in events]
        assert keys == [dict(e.pk) for e in events]
        assert [list(k) for k in keys] == [list(pk)] * len(rows)  # in pk_columns order
        assert keys[0] is not key_dict(events[0])  # a new dict each time


def test_a_key_dict_of_another_event_is_its_pk() -> None:
    other = RowChange("e9", "upsert", "s", 1, {"id": 9}, None, {"id": 9})
    assert key_dict(other) == {"id": 9}


def test_the_common_batch_keeps_its_keys_as_one_column() -> None:
    shape = _shape(("id", "updated_at", "payload"), ("id",), "updated_at")
    detail = rec.batch_detail(events_from_rows(shape, [(1, 1, "a"), (2, 1, "b")]))
    assert (detail["column"], detail["kind"], detail["values"]) == ("id", "int", [1, 2])
    text = _shape(("k", "ts"), ("k",), "ts")
    assert rec.batch_detail(events_from_rows(text, [("a", 1)]))["kind"] == "str"


def test_outcomes_name_the_marked_events_only() -> None:
    shape = _shape(("id", "updated_at", "payload"), ("id",), "updated_at")
    events = events_from_rows(shape, [(i, i, "x") for i in range(4)])
    ids = event_ids(events)
    detail = rec.batch_detail(events, rejected={ids[1]: "bad row"}, retried={ids[2]: "later"})
    assert detail["outcomes"] == [[1, "rejected", "bad row"], [2, "retried", "later"]]
    lines = rec.detail_lines({"detail": detail})
    assert lines is not None
    assert [(line.outcome, line.reason) for line in lines] == [
        ("accepted", None),
        ("rejected", "bad row"),
        ("retried", "later"),
        ("accepted", None),
    ]


def test_records_of_the_first_format_are_still_read() -> None:
    key = {"id": ["int", 1]}
    record = {"detail": {"event_ids": "sha256:x", "events": [["e1", key, "0000abcd"]]}}
    assert rec.detail_lines(record) == [rec.EventLine(key=key, image="0000abcd", event_id="e1")]


@pytest.mark.parametrize(
    "detail",
    [
        {"format": 4, "rows": 2, "crcs": "packed", "keys": "packed"},  # read as "no lines"
        {"format": 4, "rows": 1, "keys": [{"id": ["int", 1]}], "crcs": [1]},  # as format 3
        {"format": "2", "rows": 1, "keys": [{"id": ["int", 1]}], "crcs": [1]},
    ],
)
def test_a_detail_of_a_newer_format_is_refused_not_misread(detail: dict[str, Any]) -> None:
    """A newer dbtrigger's history (packed columns, say) must not be read as a commit
    with no lines, or as an older format: a replay would compare nothing, or the
    wrong thing, and say the batch replayed."""
    record = {"seq": 7, "at": "2026-11-27T06:00:00Z", "detail": detail}
    with pytest.raises(ReplayRefusedError, match=r"record 7 .* upgrade dbtrigger") as info:
        rec.detail_lines(record)
    assert f"format {detail['format']!r}" in str(info.value)
    # what this version writes is what it reads
    assert (
        rec.batch_detail(events_from_rows(_shape(("id",), ("id",), "id"), [(1,)]))["format"]
        == rec.DETAIL_FORMAT
    )


def test_a_record_too_large_keeps_its_digest_but_not_its_columns() -> None:
    shape = _shape(("id", "updated_at"), ("id",), "updated_at")
    small = rec.batch_detail(events_from_rows(shape, [(f"k{i}", i) for i in range(10)]))
    assert HistoryRecorder._fitted({"seq": 0, "detail": small})["detail"] == small
    rows = [("k" * 2000 + str(i), i) for i in range(MAX_RECORD_BYTES // 2000 + 5)]
    big = rec.batch_detail(events_from_rows(shape, rows))
    slim = HistoryRecorder._fitted({"seq": 0, "detail": big})["detail"]
    assert "values" not in slim
    assert "crcs" not in slim
    assert slim["events_omitted"] == len(rows)
    assert slim["digest"] == rec.columns_digest(big)


class _Multiline:
    """A value whose ``repr`` writes a newline (a foreign object's might)."""

    def __repr__(self) -> str:
        return "Multiline(\n)"


class _Plain:
    """A value with no value ``repr`` (``<... at 0x...>``)."""


VALUES: list[Any] = [
    0,
    -1,
    2**31,
    2**63 + 7,
    -(10**40),
    True,
    1.5,
    -0.0,
    float("inf"),
    float("nan"),
    1e300,
    "",
    "plain",
    "it's",
    'say "hi"',
    "both ' and \"",
    "back\\slash",
    "tab\tnew\nline\r",
    "caf\u00e9 \u4e2d\u6587 \U0001f600",
    "lone \ud800 surrogate \udfff",
    "\x00\x7f\x80\x9f",
    None,
    decimal.Decimal("1.10"),
    decimal.Decimal("-1E+3"),
    decimal.Decimal("NaN"),
    dt.datetime(2026, 1, 1, 12, 30, 1, 5, tzinfo=UTC),
    dt.datetime(2026, 1, 1, 12, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5, minutes=-30))),
    dt.datetime(2026, 1, 1),
    dt.date(2026, 2, 3),
    dt.time(4, 5, 6, 7),
    dt.timedelta(days=-1, microseconds=3),
    b"",
    b"\x00\xff'\"\n",
    bytearray(b"ba"),
    uuid.UUID(int=12345),
    [1, "two", None],
    {"k": [1, {"n": "\u00e9"}]},
    (1,),
    (),
    frozenset(),
]


@pytest.mark.parametrize("width", [1, 2, 3, 5])
def test_the_rows_texts_made_for_the_batch_are_each_rows_repr(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each row's text (what its image CRC hashes) is made by one format for the
    # whole batch; byte for byte it is repr(tuple(row)) encoded, for every kind of
    # value, and no row is made by the row-by-row path.
    columns = tuple(f"c{i}" for i in range(width))
    shape = _shape(columns, ("c0",), columns[-1])
    rows = [tuple(VALUES[(r * width + c) % len(VALUES)] for c in range(width)) for r in range(97)]
    expected = [repr(row).encode("utf-8", "surrogatepass") for row in rows]

    def row_by_row(row: Any) -> bytes:
        raise AssertionError("a batch of value reprs was made row by row")

    monkeypatch.setattr(images, "_row_text", row_by_row)
    texts, joined = images._row_texts(shape, rows)
    assert texts == expected
    assert joined == b"".join(t + b"\n" for t in expected)


def test_rows_that_are_not_tuples_give_their_tuples_texts() -> None:
    shape = _shape(("id", "v"), ("id",), "id")
    rows = [[1, "a"], (2, "b"), [3, None]]
    texts, _ = rec._row_texts(shape, rows)
    assert texts == [repr(tuple(r)).encode() for r in rows]


@pytest.mark.parametrize(
    "rows",
    [
        [(1, _Multiline()), (2, "b")],  # a value's repr writes a newline
        [(1, "a"), (2, "b", "extra")],  # rows of another width
    ],
)
def test_rows_the_batch_format_cannot_split_are_made_one_by_one(rows: list[Any]) -> None:
    shape = _shape(("id", "v"), ("id",), "id")
    texts, joined = rec._row_texts(shape, rows)
    assert texts == [repr(tuple(r)).encode() for r in rows]
    assert joined == b"\n".join(texts)


def test_the_batch_crcs_equal_the_reference_with_every_kind_of_value() -> None:
    columns = ("id", "ts", "a", "b")
    shape = _shape(columns, ("id",), "ts")
    rows = [(i, i, VALUES[i % len(VALUES)], VALUES[-1 - i % len(VALUES)]) for i in range(60)]
    rows.append((60, 60, _Plain(), "x"))  # hashed from its JSON, as image_crc does
    events = events_from_rows(shape, rows)
    # Format 2 (records written before format 3, made again to replay them): each
    # row's repr.
    old = rec.batch_detail(events, form=2)
    assert old["format"] == 2
    assert old["crcs"] == [rec.image_crc(e, 2) for e in events]
    assert old["crcs"][:-1] == [
        zlib.crc32(repr(r).encode("utf-8", "surrogatepass"), rec._seed(shape)) for r in rows[:-1]
    ]
    # A value marshal cannot write (a timestamp, a decimal): the batch is written in
    # format 2.
    assert rec.batch_detail(events) == old
    # Format 3 made again for it (a replay of a format-3 record over rows that hold
    # such values now): a row's marshal bytes, else its format-2 image.
    remade = rec.batch_detail(events, form=3)
    assert remade["format"] == 3
    assert remade["crcs"] == [rec.image_crc(e, 3) for e in events]

    def marshalled(row: tuple[Any, ...]) -> bytes | None:
        try:
            return marshal.dumps(row, 2)
        except ValueError:
            return None

    texts = [marshalled(r) for r in rows]
    assert 0 < sum(t is not None for t in texts) < len(rows)
    assert remade["crcs"] == [
        crc if text is None else zlib.crc32(text, rec._seed(shape))
        for text, crc in zip(texts, old["crcs"], strict=True)
    ]


@pytest.mark.parametrize(("columns", "pk", "cursor", "rows"), CASES)
@pytest.mark.parametrize("extras", [False, True])
def test_a_detail_written_from_its_columns_is_its_json(
    columns: tuple[str, ...],
    pk: tuple[str, ...],
    cursor: str,
    rows: list[tuple[Any, ...]],
    extras: bool,
) -> None:
    # The recorder writes a detail's JSON from its columns instead of encoding it;
    # byte for byte it is what encoding the detail writes.
    shape = _shape(columns, pk, cursor)
    events = events_from_rows(shape, rows)
    options: dict[str, Any] = {}
    if extras:
        ids = event_ids(events)
        options = {
            "rejected": {ids[0]: 'bad "row" \u00e9'},
            "retried": {ids[-1]: "later"},
            "waiting": {"count": 2, "oldest_due": "2026-01-01T00:00:00Z", "owed": {"s\u00e9": 1}},
            "source": "src \u00e9",
        }
    detail, text = rec.encoded_detail(events, **options)
    assert detail == rec.batch_detail(events, **options)
    assert text == encode_json(detail)


ENTRIES: list[dict[str, Any]] = [
    {"type": "commit", "batch_id": "b1", "from": None, "to": {"cursor": ["int", 3]}, "rows": 2,
     "owner_id": "h/1/ab", "fencing_token": 4, "committed_at": "2026-01-01T00:00:00.000001Z",
     "duration_ms": 1.25, "outcomes": {"accepted": 1, "subscribers": {"s\u00e9": {"a": 1}}}},
    {"type": "commit", "batch_id": 'q"\\\u00e9', "rows": 0},  # no time: "at" is null
    {},
    {"type": "manual", "at": "2026-01-02T00:00:00Z", "note": "reset"},  # names "at" itself
    {"type": "x", "seq": 99, "id": "theirs", "detail": {"n": 1}},  # names record keys
]  # fmt: skip


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("with_detail", [False, True])
def test_a_record_made_from_its_entrys_text_is_the_encoded_record(
    entry: dict[str, Any], with_detail: bool
) -> None:
    # A record of a journal entry as the document holds it keeps the line made from
    # the entry's own JSON; numbered, it is byte for byte the encoded record, in
    # every store's way of numbering (numbered()) and of writing (encode_line()).
    shape = _shape(("id", "updated_at", "payload"), ("id",), "updated_at")
    detail, text = rec.encoded_detail(events_from_rows(shape, [(1, 1, "a\u00e9"), (2, 1, None)]))
    made = JournalRecord(entry)
    record = rec.record_of(
        made, *((detail,) if with_detail else ()), detail_json=text if with_detail else None
    )
    plain = rec.record_of(dict(entry), detail if with_detail else None)
    assert record == plain
    for numbered_record, numbered_plain in zip(
        numbered([record, record], 41), numbered([plain, plain], 41), strict=True
    ):
        assert numbered_record == numbered_plain
        assert encode_line(numbered_record) == (
            json.dumps(numbered_plain, separators=(",", ":"), ensure_ascii=True, default=str) + "\n"
        ).encode("ascii")
    assert isinstance(record, EncodedRecord) == _RECORD_KEYS.isdisjoint(entry)


def test_an_encoded_record_is_read_only() -> None:
    record = rec.record_of(JournalRecord({"type": "commit", "batch_id": "b"}))
    assert isinstance(record, EncodedRecord)
    with pytest.raises(TypeError):
        record["type"] = "other"
    with pytest.raises(TypeError):
        record.update(x=1)
    copy = dict(record)
    copy["type"] = "other"
    assert encode_line(copy) != encode_line(record)


def test_a_batch_read_in_two_fetches_has_the_crcs_of_one() -> None:
    # A replay reads a recorded range in as many fetches as it takes (two shape
    # objects for the same columns): each event's image CRC is still its own.
    columns, pk, cursor = ("id", "ts", "v"), ("id",), "ts"
    rows = [(i, i, f"v{i}") for i in range(6)]
    one = rec.batch_detail(events_from_rows(_shape(columns, pk, cursor), rows))
    two = events_from_rows(_shape(columns, pk, cursor), rows[:3]) + events_from_rows(
        _shape(columns, pk, cursor), rows[3:]
    )
    assert rec.batch_detail(two)["crcs"] == one["crcs"]
    assert rec.columns_digest(rec.batch_detail(two)) == rec.columns_digest(one)
