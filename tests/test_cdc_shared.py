"""The database-neutral parts of log capture: positions, the change shape, the read-ahead
buffer, snapshot requests."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest

from dbtrigger.cdc.buffer import Transaction, TransactionBuffer
from dbtrigger.cdc.changes import UNCHANGED, Change, Unchanged, to_events, transactions
from dbtrigger.cdc.pg_control import ControlRow
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cdc.snapshots import Snapshot, add_request, watched
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import ConfigurationError, CorruptStateError, SerializationError
from dbtrigger.sources.base import position_of
from dbtrigger.state.document import position_from_json, position_to_json

# --- positions -----------------------------------------------------------------------------


def test_position_text_round_trips_and_sorts_as_the_log() -> None:
    positions = [
        LogPosition("00000001/00000000", 1),
        LogPosition("00000000/FFFFFFFF", 12),
        LogPosition("00000000/FFFFFFFF", 2),
        LogPosition("00000000/0000000A", 100),
    ]
    for p in positions:
        assert LogPosition.parse(p.text) == p
    assert sorted(positions) == sorted(positions, key=lambda p: p.text)
    assert sorted(positions)[0] == LogPosition("00000000/0000000A", 100)


def test_a_checkpoint_of_a_log_position_survives_the_state_document() -> None:
    p = LogPosition("00000000/019562A8", 3)
    stored = Position(cursor=p.text, pk={"id": 7})
    again = position_from_json(json.loads(json.dumps(position_to_json(stored))))
    assert LogPosition.of(again) == p
    assert LogPosition.of(BEGINNING) is None


@pytest.mark.parametrize(
    "cursor", [17, "0/1", "0/1#3", "#0000000001", "a#b", "0/1#00000000001", "0/1#-000000001"]
)
def test_a_cursor_that_is_not_a_log_position_is_corrupt_state(cursor: object) -> None:
    with pytest.raises(CorruptStateError, match="not a log position"):
        LogPosition.parse(cursor)


@pytest.mark.parametrize(("commit", "ordinal"), [("", 1), ("a#b", 1), ("x", -1), ("x", 10**10)])
def test_invalid_positions_are_refused(commit: str, ordinal: int) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        LogPosition(commit, ordinal)


# --- the unchanged marker --------------------------------------------------------------------


def test_unchanged_is_one_object_never_none_and_survives_copies() -> None:
    assert Unchanged() is UNCHANGED
    assert UNCHANGED is not None
    assert UNCHANGED != None  # noqa: E711 - the point: it is not NULL
    assert pickle.loads(pickle.dumps(UNCHANGED)) is UNCHANGED  # noqa: S301 - our own bytes
    assert copy.deepcopy({"v": UNCHANGED})["v"] is UNCHANGED
    assert repr(UNCHANGED) == "UNCHANGED"


# --- changes into events -----------------------------------------------------------------------


def change(commit: str, ordinal: int, key: int, **kw: object) -> Change:
    fields: dict[str, object] = {
        "op": "insert",
        "table": "public.t",
        "pk": {"id": key},
        "before": None,
        "after": {"id": key, "doc": UNCHANGED},
    }
    fields.update(kw)
    return Change(position=LogPosition(commit, ordinal), **fields)  # type: ignore[arg-type]


def test_events_sit_at_their_log_positions() -> None:
    changes = [
        change("00000000/00000010", 1, 5, unchanged=("doc",)),
        change("00000000/00000010", 2, 5, op="update", before={"id": 5}, before_image="key"),
        change("00000000/00000020", 1, 6, op="delete", after=None, last_in_transaction=True),
    ]
    events = to_events(changes, poller="p", batch_id="b1", source="postgresql:db")
    assert [e.op for e in events] == ["insert", "update", "delete"]
    assert [position_of(e) for e in events] == [
        Position(cursor=c["position"].text, pk=c["pk"]) for c in changes
    ]
    assert len({e.event_id for e in events}) == 3  # two changes of one key in one commit
    first, second, third = events
    assert first.after is not None
    assert first.after["doc"] is UNCHANGED
    assert first.metadata["unchanged"] == ("doc",)
    assert second.before == {"id": 5}
    assert second.metadata["before_image"] == "key"
    assert third.after is None
    assert third.metadata["last_in_transaction"] is True
    assert first.metadata["commit"] == "00000000/00000010"
    assert first.metadata["ordinal"] == 1
    again = to_events(changes, poller="p", batch_id="b2", source="postgresql:db")
    assert [e.event_id for e in again] == [e.event_id for e in events]


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"op": "insert", "table": "t", "pk": {}}, "lacks"),
        ({"position": "0/1#0000000001", "op": "insert", "table": "t", "pk": {}}, "no log position"),
        (
            {"position": LogPosition("a", 1), "op": "merge", "table": "t", "pk": {}},
            "unknown operation",
        ),
        (
            {"position": LogPosition("a", 1), "op": "insert", "table": "t", "pk": {"k": object()}},
            "cannot be stored",
        ),
    ],
)
def test_broken_change_records_are_serialization_errors(
    record: dict[str, object], problem: str
) -> None:
    with pytest.raises(SerializationError, match=problem):
        to_events([record], poller="p", batch_id="b", source="s")


def test_transactions_groups_a_batch_by_commit() -> None:
    changes = [change("a", 1, 1), change("a", 2, 2), change("b", 1, 3), change("c", 1, 4)]
    events = to_events(changes, poller="p", batch_id="b", source="s")
    assert [[e.pk["id"] for e in g] for g in transactions(events)] == [[1, 2], [3], [4]]


# --- the read-ahead buffer -----------------------------------------------------------------------


def txn(commit: int, n: int) -> Transaction[int]:
    return Transaction(
        commit=f"{commit:04d}",
        start=commit,
        end=commit + 5,
        commit_time=None,
        transaction_id=commit,
        changes=list(range(n)),
    )


def materialise(t: Transaction[int], ordinal: int, raw: int) -> Change:
    return change(t.commit, ordinal, raw)


def filled(
    *txns: Transaction[int], floor: LogPosition | None = None, through: int | None = None
) -> TransactionBuffer[int]:
    buffer: TransactionBuffer[int] = TransactionBuffer(materialise)
    buffer.reset(floor)
    for t in txns:
        buffer.append(t)
    buffer.finish(complete=through is not None, through=through)
    return buffer


def positions(changes: list[Change]) -> list[tuple[str, int]]:
    return [(c["position"].commit, c["position"].ordinal) for c in changes]


def test_take_pages_through_transactions_from_any_position() -> None:
    buffer = filled(txn(10, 3), txn(20, 1), txn(30, 2), through=99)
    everything = [("0010", 1), ("0010", 2), ("0010", 3), ("0020", 1), ("0030", 1), ("0030", 2)]
    assert positions(buffer.take(None, 100)) == everything
    for i, (commit, ordinal) in enumerate(everything):
        after = LogPosition(commit, ordinal)
        assert positions(buffer.take(after, 100)) == everything[i + 1 :]
        assert positions(buffer.take(after, 2)) == everything[i + 1 : i + 3]
        assert buffer.pending(after) == len(everything) - i - 1
    # Between commits (a commit this buffer has not got): from the next one on.
    assert positions(buffer.take(LogPosition("0015", 9), 2)) == [("0020", 1), ("0030", 1)]
    assert buffer.last == LogPosition("0030", 2)


def test_empty_transactions_are_not_kept_and_order_is_enforced() -> None:
    buffer = filled(txn(10, 0), txn(20, 1))
    assert buffer.changes == 1
    with pytest.raises(ValueError, match="commit order"):
        buffer.append(txn(15, 1))


def test_covers_only_what_the_read_started_after() -> None:
    unloaded: TransactionBuffer[int] = TransactionBuffer(materialise)
    assert not unloaded.covers(None)
    buffer = filled(txn(10, 3), floor=LogPosition("0005", 1))
    assert buffer.covers(LogPosition("0005", 1))
    assert buffer.covers(LogPosition("0010", 2))
    assert not buffer.covers(LogPosition("0004", 9))
    assert not buffer.covers(None)


@pytest.mark.parametrize(
    ("acked", "through", "point"),
    [
        (LogPosition("0010", 1), 99, 10),  # inside the first: up to its start only
        (LogPosition("0010", 3), 99, 15),  # the first delivered whole: past its end
        (LogPosition("0020", 1), 99, 25),
        (LogPosition("0030", 1), 99, 30),
        (LogPosition("0030", 2), 99, 99),  # nothing after: all the read covered
        (LogPosition("0030", 2), None, 35),  # ... unless the read stopped short
        (LogPosition("0001", 1), 99, None),  # before everything: nothing to release
    ],
)
def test_release_point(acked: LogPosition, through: int | None, point: int | None) -> None:
    buffer = filled(
        txn(10, 3), txn(20, 1), txn(30, 2), floor=LogPosition("0001", 1), through=through
    )
    assert buffer.release_point(acked) == point


def test_a_read_from_a_later_position_releases_nothing_for_an_earlier_checkpoint() -> None:
    # A prefetch filled the buffer after a position not committed yet.
    buffer = filled(txn(30, 2), floor=LogPosition("0020", 1), through=99)
    assert buffer.release_point(LogPosition("0010", 3)) is None


def test_trim_forgets_what_the_checkpoint_passed() -> None:
    buffer = filled(txn(10, 3), txn(20, 1), txn(30, 2), through=99)
    buffer.trim(LogPosition("0020", 1))
    assert buffer.changes == 2
    assert buffer.floor == LogPosition("0020", 1)
    assert positions(buffer.take(LogPosition("0020", 1), 10)) == [("0030", 1), ("0030", 2)]
    buffer.trim(LogPosition("0030", 1))  # inside a transaction: its delivered part goes
    assert buffer.changes == 1
    assert positions(buffer.take(LogPosition("0030", 1), 10)) == [("0030", 2)]
    assert buffer.last == LogPosition("0030", 2)


# --- snapshot requests ---------------------------------------------------------------------


def test_a_snapshot_request_names_a_watched_table_of_an_installed_source() -> None:
    tables = ["public.orders", "public.items"]
    assert watched("public.items", tables) == "public.items"
    with pytest.raises(ConfigurationError, match=r"^public.x is not one of this source's tables "
                       r"\(public.orders, public.items\)$"):  # fmt: skip
        watched("public.x", tables)

    class Source:  # the control row of one slot, kept in memory
        poller = "p"
        snapshot_lock_timeout = 2.0
        infos: dict[str, Any] = {}  # noqa: RUF012 - read only
        row: ControlRow | None = None
        saved: list[list[Snapshot]] = []  # noqa: RUF012 - one source per test

        def connection(self) -> None:
            return None

        def read_control(self, conn: Any, *, lock: bool = False) -> ControlRow | None:
            assert lock
            return self.row

        def save_snapshots(self, conn: Any, snapshots: list[Snapshot]) -> None:
            self.saved.append(list(snapshots))

    source = Source()
    with pytest.raises(
        ConfigurationError,
        match=r"^slot s1 is not installed yet: run the poller or dbtrigger cdc install$",
    ):
        add_request(source, None, "public.orders", None, reader="slot s1")

    done = Snapshot("public.items", done=True)
    source.row = ControlRow("s1", "p", tables, None, snapshots=[done])
    request = add_request(source, None, "public.orders", "id < 10", reader="slot s1")
    assert source.saved == [[done, request]]
    assert (request.table, request.where, request.done) == ("public.orders", "id < 10", False)
    assert request.requested_at is not None
    assert request.log_position is None  # none asked for: not known to be after anything

    def position(row: ControlRow) -> str:
        assert row is source.row  # the row read under the lock, in the request's transaction
        return "0000000003:000000005001"

    placed = add_request(source, None, "public.orders", None, reader="s1", position=position)
    assert placed.log_position == "0000000003:000000005001"
    assert Snapshot.from_json(placed.to_json()) == placed
