"""The fast event-id path hashes exactly the text the canonical encoder produces.

Event ids and key hashes end up in users' dedup tables, so the faster encoding
(direct JSON for ints, strings and timestamps; per-poller parts built once) must
give the same text as ``canonical_json`` over the state document's encoding,
for every kind of value, every time zone, any key order. The reference here is
the encoding written out the slow way.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import uuid
from types import MappingProxyType
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbtrigger import RowChange, SerializationError, make_event_id
from dbtrigger.cursor import canonical_json, encode_value, encoded_json, encoded_pk, pk_hash
from dbtrigger.events import EventIds


def reference_id(poller: str, pk: dict[str, Any], cursor: Any) -> str:
    material = canonical_json([poller, encoded_pk(pk), list(encode_value(cursor))])
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def reference_pk_hash(pk: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(encoded_pk(pk)).encode()).hexdigest()[:16]


ZONES = st.sampled_from(
    [
        dt.timezone.utc,
        ZoneInfo("Etc/UTC"),
        ZoneInfo("Europe/Berlin"),
        ZoneInfo("America/St_Johns"),
        ZoneInfo("Asia/Kathmandu"),
        dt.timezone(dt.timedelta(hours=-3, minutes=-30)),
        dt.timezone(dt.timedelta(seconds=30)),
    ]
)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(),
    st.floats(allow_nan=False),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.datetimes(),
    st.datetimes(timezones=ZONES),
    st.dates(),
    st.uuids(),
    st.binary(max_size=16),
)
KEYS = st.dictionaries(st.text(min_size=1), VALUES, min_size=1, max_size=3)


@settings(max_examples=400)
@given(poller=st.text(), pk=KEYS, cursor=VALUES)
def test_fast_ids_equal_the_canonical_encoding(
    poller: str, pk: dict[str, Any], cursor: Any
) -> None:
    expected = reference_id(poller, pk, cursor)
    assert make_event_id(poller, pk, cursor) == expected
    assert EventIds(poller, list(pk))(pk, cursor) == expected
    assert EventIds(poller, reversed(list(pk)))(pk, cursor) == expected
    assert pk_hash(pk) == reference_pk_hash(pk)
    assert encoded_json(cursor) == canonical_json(list(encode_value(cursor)))


def test_a_known_id_does_not_change() -> None:
    # Pinned: ids live in users' dedup tables, so the algorithm may never drift.
    ts = dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=dt.timezone.utc)
    material = '["orders",{"id":["int",12093]},["timestamp","2026-04-07T01:23:45.123456Z"]]'
    expected = hashlib.sha256(material.encode()).hexdigest()[:32]
    assert make_event_id("orders", {"id": 12093}, ts) == expected
    berlin = ts.astimezone(ZoneInfo("Europe/Berlin"))
    assert EventIds("orders", ["id"])({"id": 12093}, berlin) == expected


@pytest.mark.parametrize("bad", [dt.timedelta(1), decimal.Decimal("NaN"), object(), [1], {"a": 1}])
def test_unencodable_values_raise_serialization_error(bad: Any) -> None:
    ids = EventIds("p", ["id"])
    with pytest.raises(SerializationError):
        ids({"id": bad}, 1)
    with pytest.raises(SerializationError):
        ids({"id": 1}, bad)


def test_unchecked_events_equal_constructed_ones() -> None:
    fields: dict[str, Any] = {
        "event_id": "e1",
        "op": "upsert",
        "source": "s",
        "cursor": 3,
        "before": None,
    }
    built = RowChange(
        pk={"id": uuid.UUID(int=1)}, after={"id": 1, "x": "y"}, metadata={"p": 1}, **fields
    )
    fast = RowChange._unchecked(
        fields["event_id"],
        "upsert",
        "s",
        3,
        MappingProxyType({"id": uuid.UUID(int=1)}),
        None,
        MappingProxyType({"id": 1, "x": "y"}),
        MappingProxyType({"p": 1}),
    )
    assert fast == built
    assert repr(fast) == repr(built)
    with pytest.raises(TypeError):
        fast.after["x"] = "z"  # type: ignore[index]
