"""The ``SourceAdapter`` contract, run against every implementation.

What the runtime relies on, and so what every source must do (see
:mod:`dbtrigger.sources.base`): ``fetch(after, limit)`` returns the first
``limit`` rows strictly after ``after`` in ``(cursor, *pk)`` order; each event
``to_events`` builds sits exactly at its row's position, so a checkpoint
written from the last event of a batch (through the state document's JSON)
resumes right after it; and the fingerprint identifies the definition, not
the data. A source that breaks any of these loses or repeats rows.

The suite works on a small table of :class:`ContractRow` values with integer
``seq`` (the cursor order), a two-column key ``(tenant, id)`` (``tenant``
lowercase ASCII text, ``id`` an integer, compared as numbers: 2 before 10) and
a ``note``. A :class:`SourceHarness` puts those rows where the source reads
them and says which cursor value a ``seq`` becomes (an integer, a timestamp,
text...). Subclass :class:`SourceContract` and provide a ``source_harness``
fixture::

    class TestMySource(SourceContract):
        @pytest.fixture
        def source_harness(self) -> MyHarness:
            return MyHarness(...)

Rows the harness puts must be visible to a fetch as soon as ``put`` returns:
a source with a visibility guard needs test data the guard releases (cursor
values in the past, no writer still open).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pytest

from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import SerializationError
from dbtrigger.events import RowChange
from dbtrigger.sources.base import SourceAdapter, position_of
from dbtrigger.state.document import position_from_json, position_to_json

#: The key columns every contract table has, in order.
PK_COLUMNS = ("tenant", "id")
_POLLER = "contract"


@dataclass(frozen=True)
class ContractRow:
    """One row of the contract table.

    ``seq`` orders rows (the harness turns it into the cursor value);
    ``(tenant, id)`` is the key; ``note`` is payload the event must carry.
    """

    seq: int
    tenant: str
    id: int
    note: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.tenant, self.id)

    @property
    def pk(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "id": self.id}


@runtime_checkable
class SourceHarness(Protocol):
    """What the source suite needs to drive one source implementation."""

    def put(self, rows: Sequence[ContractRow]) -> None:
        """Store rows, replacing any with the same ``(tenant, id)``; visible on return."""
        ...

    def open(self) -> SourceAdapter:
        """A new source over the contract table (same definition every time)."""
        ...

    def open_changed(self) -> SourceAdapter:
        """A source whose *definition* differs (another table, cursor or filter):
        its fingerprint must differ."""
        ...

    def cursor_value(self, seq: int) -> Any:
        """The cursor value a row with ``seq`` has in events and positions."""
        ...

    @property
    def secrets(self) -> Sequence[str]:
        """Text the source was configured with that must never show (passwords)."""
        ...


# A table with ties on the cursor, keys that sort differently as text and as
# numbers (2 < 10), and a tenant that outranks the id. Put in a scrambled
# order, so a source that returns insertion order fails.
ROWS = (
    ContractRow(30, "b", 1, "late"),
    ContractRow(20, "a", 10, "tie a10"),
    ContractRow(10, "a", 1, "first"),
    ContractRow(20, "c", 1, "tie c1"),
    ContractRow(40, "a", 3, "last"),
    ContractRow(20, "a", 2, "tie a2"),
    ContractRow(20, "b", 3, "tie b3"),
)
ORDERED = tuple(sorted(ROWS, key=lambda r: (r.seq, r.key)))


def keys(rows: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """``(tenant, id)`` of each fetched row, in the order fetched."""
    return [(row["tenant"], row["id"]) for row in rows]


def expected(rows: Sequence[ContractRow]) -> list[tuple[str, int]]:
    return [r.key for r in rows]


def through_json(position: Position) -> Position:
    """The position as the next tick sees it: written to and read from the state document."""
    return position_from_json(json.loads(json.dumps(position_to_json(position))))


class SourceContract:
    """The source contract: inherit and define a ``source_harness`` fixture.

    Each test opens its sources through the harness and closes them.
    """

    @pytest.fixture
    def source_harness(self) -> SourceHarness:
        raise NotImplementedError("define a source_harness fixture returning a SourceHarness")

    @staticmethod
    def _position(harness: SourceHarness, row: ContractRow) -> Position:
        return Position(cursor=harness.cursor_value(row.seq), pk=row.pk)

    @staticmethod
    def _fetch_all(source: SourceAdapter, after: Position = BEGINNING) -> list[Any]:
        return list(source.fetch(after, len(ROWS) + 10))

    # --- identity -------------------------------------------------------------------

    def test_is_a_source_adapter(self, source_harness: SourceHarness) -> None:
        with closing(source_harness.open()) as source:
            assert isinstance(source, SourceAdapter)
            assert isinstance(source.name, str)
            assert source.name
            description = source.describe()
            assert isinstance(description, dict)
            json.dumps(description)  # status output prints it as JSON

    def test_fingerprint_is_a_sha256_of_the_definition(self, source_harness: SourceHarness) -> None:
        with closing(source_harness.open()) as source:
            before = source.fingerprint()
            assert before.startswith("sha256:")
            digest = before.removeprefix("sha256:")
            assert len(digest) == 64
            assert all(c in "0123456789abcdef" for c in digest)
            source_harness.put(ROWS)
            self._fetch_all(source)
            assert source.fingerprint() == before, "the fingerprint must not depend on data"

    def test_fingerprint_is_stable_across_instances_and_follows_the_definition(
        self, source_harness: SourceHarness
    ) -> None:
        one, two, changed = (
            source_harness.open(),
            source_harness.open(),
            source_harness.open_changed(),
        )
        try:
            assert one.fingerprint() == two.fingerprint()
            assert changed.fingerprint() != one.fingerprint()
        finally:
            for source in (one, two, changed):
                source.close()

    def test_no_secret_in_name_fingerprint_or_description(
        self, source_harness: SourceHarness
    ) -> None:
        with closing(source_harness.open()) as source:
            shown = " ".join((source.name, source.fingerprint(), json.dumps(source.describe())))
            for secret in source_harness.secrets:
                assert secret not in shown

    def test_close_twice_is_harmless(self, source_harness: SourceHarness) -> None:
        source = source_harness.open()
        source.close()
        source.close()

    # --- fetch ----------------------------------------------------------------------

    def test_empty_source_fetches_nothing(self, source_harness: SourceHarness) -> None:
        with closing(source_harness.open()) as source:
            assert list(source.fetch(BEGINNING, 10)) == []
            assert source.to_events([], poller=_POLLER, batch_id="b1") == []

    def test_rows_come_in_cursor_then_key_order(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            assert keys(self._fetch_all(source)) == expected(ORDERED)

    def test_equal_cursors_are_ordered_by_the_whole_key(
        self, source_harness: SourceHarness
    ) -> None:
        # Every row on one cursor value: the key alone decides, tenant first,
        # ids as numbers.
        rows = [
            ContractRow(50, "b", 1),
            ContractRow(50, "a", 10),
            ContractRow(50, "a", 9),
            ContractRow(50, "c", 0),
            ContractRow(50, "a", 100),
        ]
        source_harness.put(rows)
        with closing(source_harness.open()) as source:
            assert keys(self._fetch_all(source)) == [
                ("a", 9),
                ("a", 10),
                ("a", 100),
                ("b", 1),
                ("c", 0),
            ]

    def test_limit_returns_the_first_rows(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            for limit in (1, 2, 3, 4, len(ROWS), len(ROWS) + 1):
                got = keys(source.fetch(BEGINNING, limit))
                assert got == expected(ORDERED[:limit]), f"limit={limit}"

    def test_fetch_is_strictly_after_each_row(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            for i, row in enumerate(ORDERED):
                got = keys(self._fetch_all(source, self._position(source_harness, row)))
                assert got == expected(ORDERED[i + 1 :]), f"after {row}"
                first = keys(source.fetch(self._position(source_harness, row), 1))
                assert first == expected(ORDERED[i + 1 : i + 2]), f"limit 1 after {row}"

    def test_positions_between_rows(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        cursor = source_harness.cursor_value
        with closing(source_harness.open()) as source:
            # Inside the tie on 20: between (a, 2) and (a, 10), a key no row has.
            between_keys = Position(cursor=cursor(20), pk={"tenant": "a", "id": 5})
            assert keys(self._fetch_all(source, between_keys)) == [
                ("a", 10),
                ("b", 3),
                ("c", 1),
                ("b", 1),
                ("a", 3),
            ]
            # A cursor value no row has.
            between_cursors = Position(cursor=cursor(25), pk={"tenant": "a", "id": 0})
            assert keys(self._fetch_all(source, between_cursors)) == [("b", 1), ("a", 3)]
            # Before the first and after the last row.
            before = Position(cursor=cursor(5), pk={"tenant": "z", "id": 999})
            assert keys(self._fetch_all(source, before)) == expected(ORDERED)
            after = Position(cursor=cursor(40), pk={"tenant": "a", "id": 4})
            assert list(source.fetch(after, 10)) == []

    def test_after_the_last_row_is_an_empty_batch(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            last = self._position(source_harness, ORDERED[-1])
            assert list(source.fetch(last, 10)) == []
            assert list(source.fetch(through_json(last), 1)) == []

    # --- events and positions -------------------------------------------------------

    def test_events_sit_at_their_rows_positions(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            rows = self._fetch_all(source)
            events = source.to_events(rows, poller=_POLLER, batch_id="b1")
            assert len(events) == len(ORDERED)
            for event, row in zip(events, ORDERED, strict=True):
                assert isinstance(event, RowChange)
                assert dict(event.pk) == row.pk
                assert event.cursor == source_harness.cursor_value(row.seq)
                assert position_of(event) == self._position(source_harness, row)
                assert event.after is not None
                assert event.after["note"] == row.note
                assert event.source == source.name
                assert event.metadata["poller"] == _POLLER
                assert event.metadata["batch_id"] == "b1"

    def test_paging_by_checkpoint_delivers_every_row_once_in_order(
        self, source_harness: SourceHarness
    ) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            for limit in (1, 2, 3, 5):
                seen: list[tuple[Any, ...]] = []
                checkpoint = BEGINNING
                for _ in range(len(ROWS) + 2):
                    rows = source.fetch(checkpoint, limit)
                    assert len(rows) <= limit
                    if not rows:
                        break
                    events = source.to_events(rows, poller=_POLLER, batch_id=f"b{len(seen)}")
                    seen.extend(tuple(e.pk[c] for c in PK_COLUMNS) for e in events)
                    checkpoint = through_json(position_of(events[-1]))
                assert seen == expected(ORDERED), f"limit={limit}"

    def test_event_ids_name_the_row_state(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        one, two = source_harness.open(), source_harness.open()
        try:
            first = one.to_events(self._fetch_all(one), poller=_POLLER, batch_id="b1")
            again = two.to_events(self._fetch_all(two), poller=_POLLER, batch_id="b2")
            ids = [e.event_id for e in first]
            assert all(isinstance(i, str) and i for i in ids)
            assert len(set(ids)) == len(ids), "every row state has its own id"
            assert [e.event_id for e in again] == ids, "a redelivery has the same ids"
            source_harness.put([ContractRow(60, "a", 1, "updated")])
            moved = one.to_events(self._fetch_all(one), poller=_POLLER, batch_id="b3")
            updated = next(e for e in moved if dict(e.pk) == {"tenant": "a", "id": 1})
            assert updated.event_id not in ids, "a new cursor is a new row state"
        finally:
            one.close()
            two.close()

    def test_an_updated_row_moves_to_its_new_position(self, source_harness: SourceHarness) -> None:
        source_harness.put(ROWS)
        with closing(source_harness.open()) as source:
            checkpoint = self._position(source_harness, ORDERED[-1])
            source_harness.put([ContractRow(50, "a", 1, "updated")])
            rows = self._fetch_all(source, checkpoint)
            assert keys(rows) == [("a", 1)]
            assert rows[0]["note"] == "updated"
            everything = keys(self._fetch_all(source))
            assert everything.count(("a", 1)) == 1
            assert everything[-1] == ("a", 1)

    def test_rows_put_after_a_fetch_are_found_after_the_checkpoint(
        self, source_harness: SourceHarness
    ) -> None:
        source_harness.put(ORDERED[:3])
        with closing(source_harness.open()) as source:
            events = source.to_events(self._fetch_all(source), poller=_POLLER, batch_id="b1")
            assert [tuple(e.pk[c] for c in PK_COLUMNS) for e in events] == expected(ORDERED[:3])
            checkpoint = through_json(position_of(events[-1]))
            source_harness.put(ORDERED[3:])
            assert keys(self._fetch_all(source, checkpoint)) == expected(ORDERED[3:])

    def test_a_row_without_its_key_is_a_serialization_error(
        self, source_harness: SourceHarness
    ) -> None:
        source_harness.put(ROWS[:1])
        with closing(source_harness.open()) as source:
            (row,) = source.fetch(BEGINNING, 1)
            broken = {k: v for k, v in row.items() if k != "id"}
            with pytest.raises(SerializationError):
                source.to_events([broken], poller=_POLLER, batch_id="b1")


__all__ = ["ORDERED", "PK_COLUMNS", "ROWS", "ContractRow", "SourceContract", "SourceHarness"]
