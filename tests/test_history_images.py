"""Detail format 3: rows of plain values hashed as their marshal bytes; format 2 read exactly.

A commit record's image CRCs let a replay tell a changed row from an
unchanged one, so a record must be compared with images made exactly as its
writer made them, whichever format it is in (see dbtrigger.history.images).
"""

from __future__ import annotations

import datetime as dt
import marshal
import zlib
from typing import Any

import pytest

from dbtrigger.errors import ReplayRefusedError
from dbtrigger.events import RowShape, events_from_rows
from dbtrigger.history import images
from dbtrigger.history import records as rec
from dbtrigger.history.kept_rows import kept
from dbtrigger.replay.compare import compare

UTC = dt.timezone.utc
COLUMNS = ("id", "updated_at", "payload")


def _shape(columns: tuple[str, ...] = COLUMNS) -> RowShape:
    return RowShape(
        columns, cursor_column=columns[1], pk_columns=("id",), source="s", poller="p", batch_id="b"
    )


def _narrow(n: int = 20, payload: str = "p") -> list[tuple[Any, ...]]:
    return [(i, i // 3, f"{payload}{i}") for i in range(n)]


def test_marshal_writes_the_known_answer_here() -> None:
    # The bytes this Python's marshal (version 2) writes for the known values are
    # those every Python from 3.6 to 3.13 writes: format 3 is made and replayed.
    assert images.MARSHAL_STABLE


def test_a_batch_of_plain_values_is_written_in_format_3() -> None:
    shape = _shape()
    rows = _narrow()
    events = events_from_rows(shape, rows)
    for batch in (events, kept(events)):  # live events, and as the appender keeps them
        detail, text = rec.encoded_detail(batch)
        assert detail["format"] == 3
        assert text.startswith('{"format":3,')
        assert detail["crcs"] == [zlib.crc32(marshal.dumps(r, 2), rec._seed(shape)) for r in rows]
        lines = rec.detail_lines({"detail": detail})
        assert lines is not None
        assert [line.image for line in lines] == [f"{rec.image_crc(e, 3):08x}" for e in events]


def test_a_batch_with_no_marshalled_row_is_written_in_format_2() -> None:
    # (a timestamp in every row: the images are format 2's, and so is the record,
    # which a dbtrigger from before format 3 reads too)
    shape = _shape(("id", "ts", "v"))
    t0 = dt.datetime(2026, 1, 1, tzinfo=UTC)
    rows = [(i, t0 + dt.timedelta(seconds=i), "v") for i in range(5)]
    detail = rec.batch_detail(events_from_rows(shape, rows))
    assert detail["format"] == 2
    assert detail["crcs"] == [zlib.crc32(repr(r).encode(), rec._seed(shape)) for r in rows]


def test_json_values_are_marshalled_and_one_timestamp_makes_the_batch_format_2() -> None:
    shape = _shape(("id", "updated_at", "doc"))
    rows = [(i, i, {"k": [i, "v", None, 1.5]}) for i in range(5)]
    assert rec.batch_detail(events_from_rows(shape, rows))["format"] == 3
    rows.append((5, 5, dt.datetime(2026, 1, 1, tzinfo=UTC)))
    detail = rec.batch_detail(events_from_rows(shape, rows))
    assert detail["format"] == 2
    assert detail["crcs"] == [zlib.crc32(repr(r).encode(), rec._seed(shape)) for r in rows]


def _record(detail: dict[str, Any]) -> dict[str, Any]:
    return {"seq": 1, "type": "commit", "batch_id": "b", "detail": detail}


@pytest.mark.parametrize("form", [2, 3])
def test_a_record_of_either_format_replays_exactly(form: int) -> None:
    shape = _shape()
    rows = _narrow()
    recorded = rec.batch_detail(events_from_rows(shape, rows), form=form)
    assert recorded["format"] == form
    same = compare(_record(recorded), events_from_rows(shape, rows), None, "p")
    assert same.drift == []
    assert same.identical
    # One row changed since: that row, and only it, has drifted.
    now = [*rows[:5], (5, 1, "changed"), *rows[6:]]
    changed = compare(_record(recorded), events_from_rows(shape, now), None, "p")
    assert [(d.kind, d.key) for d in changed.drift] == [("changed", {"id": ["int", 5]})]
    assert not changed.identical


def test_a_row_whose_values_are_no_longer_marshalled_reads_as_changed() -> None:
    shape = _shape()
    rows = _narrow(3)
    recorded = rec.batch_detail(events_from_rows(shape, rows))
    assert recorded["format"] == 3
    now = [rows[0], (1, 0, dt.date(2026, 1, 1)), rows[2]]  # the column's type changed
    replay = compare(_record(recorded), events_from_rows(shape, now), None, "p")
    assert [(d.kind, d.key) for d in replay.drift] == [("changed", {"id": ["int", 1]})]


def test_a_row_another_batch_recorded_in_the_other_format_is_not_added() -> None:
    # A history spanning an upgrade: the range read for a format-3 record holds a
    # row that an older, format-2 batch delivered as it is (a retry waited).
    shape = _shape()
    rows = _narrow(4)
    ours = rec.batch_detail(events_from_rows(shape, [rows[0], rows[2], rows[3]]))
    theirs = rec.batch_detail(events_from_rows(shape, [rows[1]]), form=2)
    assert (ours["format"], theirs["format"]) == (3, 2)
    elsewhere = {('{"id":["int",1]}', f"{theirs['crcs'][0]:08x}")}
    replay = compare(_record(ours), events_from_rows(shape, rows), None, "p", lambda: elsewhere)
    assert replay.drift == []


def test_where_marshal_writes_other_bytes_format_2_is_written_and_3_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shape = _shape()
    rows = _narrow(3)
    recorded = rec.batch_detail(events_from_rows(shape, rows))
    monkeypatch.setattr(images, "MARSHAL_STABLE", False)
    written = rec.batch_detail(events_from_rows(shape, rows))
    assert written["format"] == 2
    assert compare(_record(written), events_from_rows(shape, rows), None, "p").drift == []
    with pytest.raises(ReplayRefusedError, match="marshal"):
        compare(_record(recorded), events_from_rows(shape, rows), None, "p")
