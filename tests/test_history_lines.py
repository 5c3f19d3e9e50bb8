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
import uuid
from typing import Any

import pytest

from dbtrigger.events import RowShape, event_ids, events_from_rows
from dbtrigger.history import records as rec
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
def test_batch_lines_equal_the_lines_made_event_by_event(
    columns: tuple[str, ...], pk: tuple[str, ...], cursor: str, rows: list[tuple[Any, ...]]
) -> None:
    shape = _shape(columns, pk, cursor)
    fast = rec._batch_lines(events_from_rows(shape, rows))
    reference = rec._lines_one_by_one(events_from_rows(shape, rows))
    if fast is not None:
        assert fast == reference
    detail = rec.batch_detail(events_from_rows(shape, rows))
    assert detail["events"] == reference[0]
    assert detail["images"] == "sha256:" + hashlib.sha256(reference[1]).hexdigest()
    assert detail["images"] == rec.digest_images(events_from_rows(shape, rows))
    assert [line[2] for line in detail["events"]] == [
        rec.image_digest(e) for e in events_from_rows(shape, rows)
    ]


def test_the_common_batch_takes_the_batch_path() -> None:
    shape = _shape(("id", "updated_at", "payload"), ("id",), "updated_at")
    assert rec._batch_lines(events_from_rows(shape, [(1, 1, "a"), (2, 1, "b")])) is not None
    text = _shape(("k", "ts"), ("k",), "ts")
    assert rec._batch_lines(events_from_rows(text, [("a", 1)])) is not None


def test_outcomes_are_added_to_the_lines_of_the_batch_path() -> None:
    shape = _shape(("id", "updated_at", "payload"), ("id",), "updated_at")
    events = events_from_rows(shape, [(i, i, "x") for i in range(4)])
    ids = event_ids(events)
    lines = rec.event_lines(events, rejected={ids[1]: "bad row"}, retried={ids[2]: "later"})
    assert [line[3:] for line in lines] == [[], ["rejected", "bad row"], ["retried", "later"], []]
