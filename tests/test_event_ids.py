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
import os
import uuid
from types import MappingProxyType
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SerializationError
from dbtrigger.cursor import (
    Position,
    canonical_json,
    encode_value,
    encoded_json,
    encoded_pk,
    pk_hash,
)
from dbtrigger.event_identity import EventIds, make_event_id
from dbtrigger.events import RowShape, events_from_rows
from dbtrigger.sources.rows import Rows, rows_to_events


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


#: Generated rows per property: 120 by default (CI time: about 14 ms each, generation
#: most of it), DBTRIGGER_PROPERTY_EXAMPLES=2000 for a longer search.
EXAMPLES = int(os.environ.get("DBTRIGGER_PROPERTY_EXAMPLES", "120"))


@settings(max_examples=EXAMPLES)
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


def lazy_events(
    rows: list[tuple[Any, ...]],
    columns: tuple[str, ...] = ("id", "c", "x"),
    *,
    cursor: str = "c",
    pk: tuple[str, ...] = ("id",),
    poller: str = "p",
    plain: bool = False,
) -> list[RowChange]:
    shape = RowShape(
        columns,
        cursor_column=cursor,
        pk_columns=pk,
        source="s",
        poller=poller,
        batch_id="b",
        plain=plain,
    )
    return events_from_rows(shape, rows)


# The views of a row whose columns may hold nested values (copied on read) and
# of one whose column types only yield scalars (no check): the same behaviour.
VIEWS = pytest.mark.parametrize("plain", [False, True], ids=["guarded", "plain"])


@VIEWS
def test_lazy_events_equal_constructed_ones(plain: bool) -> None:
    key = uuid.UUID(int=1)
    (fast,) = lazy_events([(key, 3, "y")], plain=plain)
    built = RowChange(
        event_id=make_event_id("p", {"id": key}, 3),
        op="upsert",
        source="s",
        cursor=3,
        pk={"id": key},
        before=None,
        after={"id": key, "c": 3, "x": "y"},
        metadata={"poller": "p", "batch_id": "b"},
    )
    assert fast == built
    assert built == fast
    assert repr(fast) == repr(built)
    assert fast.after == fast.after
    assert fast.dedup_key() == built.dedup_key()
    with pytest.raises(TypeError):
        fast.after["x"] = "z"  # type: ignore[index]
    with pytest.raises(TypeError):
        fast.pk["id"] = 2  # type: ignore[index]
    for name in ("event_id", "op", "cursor", "pk", "after", "before", "metadata"):
        with pytest.raises(AttributeError):
            setattr(fast, name, None)
        with pytest.raises(AttributeError):
            setattr(built, name, None)
    assert fast != lazy_events([(key, 4, "y")])[0]


@VIEWS
def test_lazy_pk_and_after_behave_like_read_only_dicts(plain: bool) -> None:
    # pk and after are views of the row tuple, not MappingProxyType: every
    # read-only operation must give what a mappingproxy of the row's dict gives.
    (event,) = lazy_events(
        [(7, 3, "y", 1.5)], ("id", "c", "x", "id2"), pk=("id2", "id"), plain=plain
    )
    row = {"id": 7, "c": 3, "x": "y", "id2": 1.5}
    for view, expected in ((event.after, MappingProxyType(row)), (event.pk, {"id2": 1.5, "id": 7})):
        proxy = MappingProxyType(dict(expected))
        assert view == proxy
        assert proxy == view
        assert view == dict(expected)
        assert dict(expected) == view
        assert view != {**expected, "extra": 1}
        assert view != list(expected)
        assert dict(view) == dict(expected)
        assert list(view) == list(expected)
        assert list(reversed(view)) == list(reversed(proxy))
        assert list(view.items()) == list(proxy.items())
        assert list(view.values()) == list(proxy.values())
        assert view.keys() == proxy.keys()
        assert view.copy() == proxy.copy()
        assert type(view.copy()) is dict
        assert len(view) == len(proxy)
        assert "id" in view
        assert "nope" not in view
        assert view.get("id") == 7
        assert view.get("nope") is None
        assert view.get("nope", 5) == 5
        assert view | {"z": 1} == proxy | {"z": 1}
        assert {"z": 1} | view == {"z": 1} | proxy
        assert view | view == proxy | proxy
        assert repr(view) == repr(proxy)
        with pytest.raises(KeyError):
            view["nope"]
        with pytest.raises(TypeError):
            view["id"] = 2  # type: ignore[index]
        with pytest.raises(TypeError):
            del view["id"]  # type: ignore[attr-defined]
        with pytest.raises(TypeError):
            hash(view)
    assert event.after["x"] == "y"
    assert event.pk == {"id2": 1.5, "id": 7}


@settings(max_examples=EXAMPLES)
@given(poller=st.text(), pk=KEYS, cursor=VALUES)
def test_lazy_event_ids_equal_the_canonical_encoding(
    poller: str, pk: dict[str, Any], cursor: Any
) -> None:
    columns = (*pk, "\x00cursor")
    row = (*pk.values(), cursor)
    if any(v is None for v in pk.values()):
        with pytest.raises(SerializationError, match="NULL primary key"):
            lazy_events([row], columns, cursor="\x00cursor", pk=tuple(pk), poller=poller)
        return
    (event,) = lazy_events([row], columns, cursor="\x00cursor", pk=tuple(pk), poller=poller)
    assert event.event_id == reference_id(poller, pk, cursor)
    assert dict(event.pk) == pk
    assert event.cursor is cursor


def test_the_same_row_state_keeps_its_pinned_id() -> None:
    # Ids are stored in failure records: redelivery skips rows by id, so the id
    # of a row state must not change with how events are built.
    ts = dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=dt.timezone.utc)
    material = '["orders",{"id":["int",12093]},["timestamp","2026-04-07T01:23:45.123456Z"]]'
    expected = hashlib.sha256(material.encode()).hexdigest()[:32]
    (event,) = lazy_events([(12093, ts, "n")], poller="orders")
    assert event.event_id == expected
    composite = '["orders",{"a":["str","x"],"b":["int",2]},["int",7]]'
    (event,) = lazy_events(
        [(2, 7, "x")], ("b", "c", "a"), cursor="c", pk=("b", "a"), poller="orders"
    )
    assert event.event_id == hashlib.sha256(composite.encode()).hexdigest()[:32]


@pytest.mark.parametrize("bad", [dt.timedelta(1), decimal.Decimal("NaN"), object(), [1]])
def test_a_batch_with_an_unencodable_key_or_cursor_is_refused_before_delivery(bad: Any) -> None:
    with pytest.raises(SerializationError, match=r"key \{'id': 2\}: column 'c'") as info:
        lazy_events([(1, 1, "a"), (2, bad, "b")])
    assert info.value.fields["column"] == "c"
    with pytest.raises(SerializationError, match=r"column 'id'"):
        lazy_events([(1, 1, "a"), (bad, 2, "b")])


def test_a_batch_with_a_null_or_missing_key_is_refused() -> None:
    with pytest.raises(SerializationError, match=r"NULL primary key \{'id': None\}"):
        lazy_events([(1, 1, "a"), (None, 2, "b")])
    with pytest.raises(SerializationError, match="lacks column 'id'"):
        lazy_events([(1, 1)], ("key", "c"))


def test_unchecked_events_equal_constructed_ones() -> None:
    built = RowChange(
        event_id="e1",
        op="upsert",
        source="s",
        cursor=3,
        pk={"id": 1},
        before=None,
        after={"id": 1, "x": "y"},
        metadata={"p": 1},
    )
    fast = RowChange._unchecked(
        "e1",
        "upsert",
        "s",
        3,
        MappingProxyType({"id": 1}),
        None,
        MappingProxyType({"id": 1, "x": "y"}),
        MappingProxyType({"p": 1}),
    )
    assert fast == built
    assert repr(fast) == repr(built)


def test_a_batch_delivered_once_computes_no_event_id() -> None:
    # A handler that never reads an id pays nothing for it: the runtime reads
    # ids only to skip rows an earlier delivery of the batch settled. The history
    # (kept by default) records keys and image CRCs, and ids only of marked events.
    rows = Rows(("id", "c", "x"), [(i, i, "x") for i in range(25)])

    class Source:
        name = "memory:rows"

        def fingerprint(self) -> str:
            return "sha256:test"

        def fetch(self, after: Position, limit: int) -> Rows:
            start = 0 if after.is_beginning else after.cursor + 1
            return Rows(rows.columns, rows.tuples[start : start + limit])

        def to_events(self, batch: Any, *, poller: str, batch_id: str) -> list[RowChange]:
            return rows_to_events(
                batch,
                cursor_column="c",
                pk_columns=["id"],
                source=self.name,
                poller=poller,
                batch_id=batch_id,
            )

        def describe(self) -> dict[str, Any]:
            return {}

        def close(self) -> None:
            return None

    seen: list[RowChange] = []
    trigger = PollTrigger(
        name="p",
        source=Source(),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=10,
    )
    assert trigger.drain(seen.extend) == 25
    assert trigger.history is not None
    assert [e.pk["id"] for e in seen] == list(range(25))
    assert all(e._event_id is None for e in seen)
    assert seen[3].event_id == make_event_id("p", {"id": 3}, 3)
