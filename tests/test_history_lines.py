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
import uuid
from typing import Any

import pytest

from dbtrigger.events import RowShape, event_ids, events_from_rows
from dbtrigger.history import records as rec
from dbtrigger.history.recorder import MAX_RECORD_BYTES, HistoryRecorder
from dbtrigger.state.document import digest_event_ids

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
    assert [line.image for line in lines] == [f"{rec.image_crc(e):08x}" for e in events]
    assert all(e._event_id is None for e in events)  # no id was computed for them
    # A row changed in any column (cursor included) changes its CRC.
    changed = events_from_rows(shape, [(*rows[0][:-1], "changed"), *rows[1:]])
    assert rec.image_crc(changed[0]) != rec.image_crc(events[0])
    assert rec.columns_digest(rec.batch_detail(changed)) != rec.columns_digest(detail)


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
    "values",
    [
        [1, -(10**18), 10**19 - 1, -(10**19) + 1],
        ["a", "é" * 50, "\U0001f600" * 7, '"\\\n'],
        [10**30],
        [],
    ],
)
def test_a_column_size_bound_is_never_below_the_encoded_size(values: list[Any]) -> None:
    kind = "int" if all(type(v) is int for v in values) else "str"
    detail = {"format": 2, "rows": len(values), "column": "id\u00e9", "kind": kind}
    detail |= {"values": values, "crcs": [2**32 - 1] * len(values)}
    bound = rec.columns_size_bound(detail)
    columns = {k: detail[k] for k in ("column", "kind", "values", "crcs")}
    if bound is not None:
        assert bound >= len(json.dumps(columns, separators=(",", ":"), ensure_ascii=True))
    else:
        assert values == [10**30]


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
