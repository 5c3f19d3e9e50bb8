"""The appender keeps a committed batch as its row tuples until it makes the
batch's detail, not as its events (which the collector would otherwise promote
and scan again while they wait), and the detail made from them is the one made
from the events, byte for byte."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from dbtrigger import PollTrigger
from dbtrigger.cursor import Position
from dbtrigger.events import RowChange, batch_shape, event_ids, events_from_rows
from dbtrigger.history import records as rec
from dbtrigger.history.kept_rows import KeptRows, kept
from dbtrigger.sources.rows import Rows, rows_to_events
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.test_history_appender import WAIT, GatedHistory
from tests.test_history_lines import CASES, VALUES, _Plain, _shape

ROWS_WITH_EVERY_VALUE = [(i, i, VALUES[i % len(VALUES)], _Plain()) for i in range(len(VALUES))]


@pytest.mark.parametrize(
    ("columns", "pk", "cursor", "rows"),
    [*CASES, (("id", "ts", "a", "b"), ("id",), "ts", ROWS_WITH_EVERY_VALUE)],
)
@pytest.mark.parametrize("extras", [False, True])
def test_the_detail_of_the_kept_rows_is_the_detail_of_the_events(
    columns: tuple[str, ...], pk: tuple[str, ...], cursor: str, rows: list[Any], extras: bool
) -> None:
    shape = _shape(columns, pk, cursor)
    events = events_from_rows(shape, rows)
    options: dict[str, Any] = {"source": "src"}
    if extras:
        ids = event_ids(events)
        options["rejected"] = {ids[0]: "bad"}
        options["retried"] = {ids[-1]: "later"}
    held = kept(events)
    assert type(held) is KeptRows
    assert rec.encoded_detail(held, **options) == rec.encoded_detail(events, **options)
    # An event read back is the event: fields, views and id.
    pairs = zip([held[0], held[-1], *held[1:3]], [events[0], events[-1], *events[1:3]], strict=True)
    for again, event in pairs:
        assert (again.pk, again.after, again.cursor, again.op, again.source, again.metadata) == (
            event.pk,
            event.after,
            event.cursor,
            event.op,
            event.source,
            event.metadata,
        )
        assert again.event_id == event.event_id


def test_events_of_several_kinds_are_kept_as_they_are() -> None:
    events = [
        *events_from_rows(_shape(("id", "ts"), ("id",), "ts"), [(1, 1)]),
        RowChange("e2", "upsert", "s", 2, {"id": 2}, None, {"id": 2, "ts": 2}),
    ]
    assert kept(events) == tuple(events)
    assert kept([]) == ()


def _changes() -> list[Any]:
    """Every way a list's own methods change its items (each takes the list and
    an event of another shape)."""
    return [
        lambda lst, e: lst.__setitem__(1, e),
        lambda lst, e: lst.__setitem__(slice(0, 1), [e]),
        lambda lst, e: lst.__delitem__(0),
        lambda lst, e: lst.__iadd__([e]),
        lambda lst, e: lst.__imul__(2),
        lambda lst, e: lst.append(e),
        lambda lst, e: lst.extend([e]),
        lambda lst, e: lst.insert(0, e),
        lambda lst, e: lst.pop(),
        lambda lst, e: lst.remove(lst[0]),
        lambda lst, e: lst.clear(),
        lambda lst, e: lst.reverse(),
        lambda lst, e: lst.sort(key=lambda event: -event.cursor),
    ]


@pytest.mark.parametrize("change", range(len(_changes())))
def test_a_batch_changed_after_it_was_made_is_walked_again(change: int) -> None:
    """events_from_rows' list says its one shape (batch_shape then does not walk
    it); once changed it says nothing, and the batch is proven item by item: an
    event of another shape put in is found, and the kept batch is the list as it
    is now, never the rows it was made from."""
    shape = _shape(("id", "ts"), ("id",), "ts")
    events = events_from_rows(shape, [(1, 1), (2, 2), (3, 3)])
    assert batch_shape(events) is shape
    assert batch_shape(events[:2]) is shape  # (a slice is a plain list: walked, same answer)
    other = events_from_rows(_shape(("id", "ts", "x"), ("id",), "ts"), [(9, 9, 9)])[0]
    _changes()[change](events, other)
    held = kept(events)
    assert [e.pk for e in held] == [e.pk for e in events]
    assert [e.after for e in held] == [e.after for e in events]
    if other in events:
        assert batch_shape(events) is None
        assert held == tuple(events)
    elif events:
        assert batch_shape(events) is shape


def test_an_event_of_another_kind_put_in_is_found() -> None:
    shape = _shape(("id", "ts"), ("id",), "ts")
    events = events_from_rows(shape, [(1, 1), (2, 2)])
    events[0] = RowChange("e2", "upsert", "s", 2, {"id": 2}, None, {"id": 2, "ts": 2})
    assert batch_shape(events) is None
    assert kept(events) == tuple(events)
    assert event_ids(events)[0] == "e2"


class TupleSource:
    """Rows read as tuples (:class:`~dbtrigger.sources.rows.Rows`), as a database
    source reads them: its events are made over the tuples."""

    name = "tuples:kept"
    cursor_column = "seq"
    pk_columns = ("id",)

    def __init__(self, count: int) -> None:
        self.rows = [(i, i, f"row {i}") for i in range(1, count + 1)]

    def fingerprint(self) -> str:
        return "sha256:tuples-kept"

    def fetch(self, after: Position, limit: int) -> Rows:
        start = 0 if after.is_beginning else after.cursor
        return Rows(("id", "seq", "v"), self.rows[start : start + limit], plain=True)

    def to_events(self, rows: Any, *, poller: str, batch_id: str) -> list[RowChange]:
        return rows_to_events(
            rows,
            cursor_column="seq",
            pk_columns=("id",),
            source=self.name,
            poller=poller,
            batch_id=batch_id,
        )

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def close(self) -> None:
        pass


def _live_events(source: str) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, RowChange) and o.source == source)


def test_batches_waiting_for_the_appender_hold_no_events() -> None:
    history = GatedHistory()
    source = TupleSource(50)
    trigger = PollTrigger(
        name="kept-rows",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=10,
        history=history,
    )
    try:
        assert trigger.tick_result(lambda events: None).rows == 10
        assert history.entered.wait(WAIT)  # the appender is stuck in the store
        for _ in range(4):  # four commits queued with their details still to make
            assert trigger.tick_result(lambda events: None).rows == 10
        assert _live_events(source.name) == 0
        history.gate.set()
        assert trigger.flush_history()
        written = list(history.inner.read("kept-rows"))
        assert [r["detail"]["rows"] for r in written] == [10] * 5
        assert all(len(r["detail"]["crcs"]) == 10 for r in written)
    finally:
        history.gate.set()
        trigger.close()
