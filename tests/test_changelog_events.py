"""Change-log rows as events (dbtrigger.changelog.events): what the constructor would make,
checked before any handler runs, with the id and metadata made only when read."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.changelog.events import EVENT_COLUMNS, log_events
from dbtrigger.errors import SerializationError
from dbtrigger.event_identity import make_event_id
from dbtrigger.history import records as rec
from dbtrigger.sources.rows import Rows
from tests.databases import TestDatabase

AT = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.timezone.utc)
COLUMNS = (*EVENT_COLUMNS, "id")


def row(seq: int, op: str, before: Any, after: Any, key: Any = None) -> tuple[Any, ...]:
    return (seq, op, before, after, 1000 + seq, AT, seq if key is None else key)


def expected(values: tuple[Any, ...], *, pk: tuple[str, ...] = ("id",)) -> RowChange:
    """The event as the constructor makes it from the row's fields (what the source made
    before events were built lazily)."""
    import json  # noqa: PLC0415

    seq, op, before, after, txid, changed_at, *keys = values
    key = dict(zip(pk, keys, strict=True))

    def image(raw: Any) -> Any:
        return None if raw is None else json.loads(raw, parse_float=Decimal)

    return RowChange(
        event_id=make_event_id("p", key, seq),
        op=op,
        source="sqlite:orders+changelog",
        cursor=seq,
        pk=key,
        before=image(before),
        after=image(after),
        metadata={
            "poller": "p",
            "batch_id": "b",
            "txid": txid,
            "changed_at": changed_at,
            "snapshot": op == "upsert",
        },
    )


def events_of(rows: Any, pk: tuple[str, ...] = ("id",)) -> list[RowChange]:
    return log_events(
        rows, pk_columns=pk, source="sqlite:orders+changelog", poller="p", batch_id="b"
    )


ROWS = [
    row(1, "insert", None, '{"id": 1, "status": "new", "amount": 1.50, "tags": ["a"]}'),
    row(2, "update", '{"id": 1, "status": "new"}', '{"id": 1, "status": "paid", "n": {"x": 1}}'),
    row(3, "delete", '{"id": 1, "status": "paid"}', None),
    row(4, "upsert", None, '{"id": "k\\u00e9y", "v": null}', key="k\u00e9y"),
]


@pytest.mark.parametrize("as_mappings", [False, True])
def test_events_equal_what_the_constructor_makes(as_mappings: bool) -> None:
    rows: Any = Rows(COLUMNS, list(ROWS))
    if as_mappings:
        rows = [dict(zip(COLUMNS, r, strict=True)) for r in ROWS]
    made = events_of(rows)
    want = [expected(r) for r in ROWS]
    assert made == want
    assert repr(made) == repr(want)
    assert [e.metadata for e in made] == [e.metadata for e in want]
    # The history's digests of the images are those it always recorded.
    assert [rec.image_crc(e) for e in made] == [rec.image_crc(e) for e in want]
    assert rec.digest_images(made) == rec.digest_images(want)
    assert made[0].after is not None
    assert made[0].after["amount"] == Decimal("1.50")


def test_nested_values_are_handed_out_as_copies() -> None:
    [event] = events_of(Rows(COLUMNS, [ROWS[0]]))
    assert event.after is not None
    event.after["tags"].append("b")
    assert event.after["tags"] == ["a"]
    with pytest.raises(TypeError):
        event.after["status"] = "x"  # type: ignore[index]


def test_ids_are_computed_when_read_and_kept() -> None:
    made = events_of(Rows(COLUMNS, list(ROWS)))
    assert all(e._event_id is None for e in made)  # what was not paid for
    assert made[1].event_id == make_event_id("p", {"id": 2}, 2)
    assert made[1]._event_id == made[1].event_id


def test_a_composite_key() -> None:
    columns = (*EVENT_COLUMNS, "a", "b")
    values = (7, "insert", None, '{"a": 1, "b": "x"}', 1, AT, 1, "x")
    [event] = events_of(Rows(columns, [values]), pk=("a", "b"))
    assert event == expected(values, pk=("a", "b"))


def test_a_key_that_cannot_be_encoded_fails_the_batch_not_a_read() -> None:
    # Keys of other types than int and str get their ids at once, so a value the
    # id cannot encode fails the batch before any handler sees it.
    values = row(1, "insert", None, '{"id": 1}', key=float("nan"))
    with pytest.raises(SerializationError):
        events_of(Rows(COLUMNS, [values]))
    fine = row(2, "insert", None, '{"id": 1}', key=Decimal("2.5"))
    [event] = events_of(Rows(COLUMNS, [fine]))
    assert event._event_id == make_event_id("p", {"id": Decimal("2.5")}, 2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (row(1, "merge", None, '{"id": 1}'), "unknown operation 'merge'"),
        (row(1, "insert", None, "{not json"), "dbt_after is not JSON"),
        (row(1, "update", "[1, 2]", '{"id": 1}'), "dbt_before is not a JSON object"),
    ],
)
def test_a_malformed_row_fails_the_batch(values: tuple[Any, ...], message: str) -> None:
    with pytest.raises(SerializationError, match=message):
        events_of(Rows(COLUMNS, [row(0, "insert", None, '{"id": 0}'), values]))


def test_a_missing_column_fails_the_batch() -> None:
    columns = tuple(c for c in COLUMNS if c != "dbt_txid")
    values = tuple(v for c, v in zip(COLUMNS, ROWS[0], strict=True) if c != "dbt_txid")
    with pytest.raises(SerializationError, match="lacks column 'dbt_txid'"):
        events_of(Rows(columns, [values]))
    with pytest.raises(SerializationError, match="lacks column 'dbt_txid'"):
        events_of([dict(zip(columns, values, strict=True))])
    assert events_of(Rows(columns, [])) == []


def test_a_drain_delivered_once_computes_no_event_id(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    # The history (on by default) records keys and image CRCs; ids only of marked events.
    sqlite_db.execute(
        f"CREATE TABLE {sqlite_db.qualified('orders')} (id INTEGER PRIMARY KEY, status TEXT)"
    )
    install(sqlite_db.engine, "orders")
    for i in range(1, 8):
        sqlite_db.execute(f"INSERT INTO {sqlite_db.qualified('orders')} VALUES ({i}, 'new')")
    seen: list[RowChange] = []
    source = ChangeLogSource(url=sqlite_db.url, table="orders", schema=sqlite_db.schema)
    trigger = PollTrigger(
        name="orders-log",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=3,
    )
    try:
        assert trigger.drain(seen.extend) == 7
        assert trigger.flush_history()
        assert trigger.history is not None
        assert [e.after["status"] for e in seen if e.after is not None] == ["new"] * 7
        assert all(e._event_id is None for e in seen)
    finally:
        trigger.close()
        source.close()
