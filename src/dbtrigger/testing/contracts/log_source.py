"""The contract of a *log-based* source, run against every implementation.

A log source (PostgreSQL logical decoding, a MySQL/MariaDB binlog reader, the
in-memory :class:`~dbtrigger.testing.MemoryLogSource`) delivers *changes*, not
current rows: an update is a new event even for a key delivered before, a
delete is an event, and the order is commit order, which no column of the
table holds. The cursor-polling contract (:mod:`dbtrigger.testing.contracts.source`)
does not describe that, so this one does. What the runtime relies on:

* changes come in commit order, transactions whole and never interleaved,
  each change at its own ``LogPosition`` (commit, ordinal) in ``cursor``;
* ``fetch(after, limit)`` returns the first ``limit`` changes strictly after
  ``after``, *inside* a transaction too: a checkpoint written after the third
  row of a ten-row statement resumes at the fourth (Debezium's DBZ-1554 lost
  the other seven);
* events carry ``op``, ``before``/``after`` and the row's key; their ids are
  equal on every redelivery and distinct per change;
* nothing of a rolled-back transaction, nothing of one not yet committed;
* with :class:`~dbtrigger.sources.base.AcknowledgesCheckpoints`, acknowledging
  a checkpoint never loses what comes after it, for this process or a new one.

The harness owns a table ``(id integer primary key, note text)`` and writes to
it; subclass :class:`LogSourceContract` and provide a ``log_harness`` fixture.

A *sequence* log - a table a trigger appends to, numbered by a database
sequence (:class:`~dbtrigger.changelog.ChangeLogSource`) - is a log source
too, with one difference that is its nature, not a defect: a change is
numbered when it is written, not when its transaction commits, so
transactions come in the order they wrote (the visibility guard makes sure
none is skipped), and a position is that number (no commit/ordinal pair, no
transaction boundary in the metadata). Its suite sets ``commit_ordered =
False`` (and ``position_field`` to the column holding the number); every
other rule is the same.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import pytest

from dbtrigger.cdc.position import LogPosition
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import SerializationError
from dbtrigger.events import RowChange
from dbtrigger.sources.base import AcknowledgesCheckpoints, SourceAdapter, position_of
from dbtrigger.state.document import position_from_json, position_to_json

_POLLER = "contract"


@dataclass(frozen=True)
class LogOp:
    """One statement: ``insert``/``update`` the row ``id`` with ``note``, or ``delete`` it."""

    op: str
    id: int
    note: str = ""


@runtime_checkable
class LogSourceHarness(Protocol):
    """What the log suite needs to drive one log source."""

    def open(self) -> SourceAdapter:
        """A source over the harness's table whose log starts now (its slot/position set up)."""
        ...

    def reopen(self, source: SourceAdapter) -> SourceAdapter:
        """A new instance of the same source (same definition, same log position): a
        restart. The suite closes ``source`` first, as a restart would; it may then
        use ``source`` again (a closed source opens again on its next fetch)."""
        ...

    def open_changed(self) -> SourceAdapter:
        """A source whose definition differs (another table, slot...): another fingerprint."""
        ...

    def commit(self, ops: Sequence[LogOp]) -> None:
        """Apply ``ops`` in one transaction, in order; committed when this returns."""
        ...

    def rollback(self, ops: Sequence[LogOp]) -> None:
        """Apply ``ops`` in one transaction and roll it back."""
        ...

    def commit_crossed(self, first: Sequence[LogOp], second: Sequence[LogOp]) -> None:
        """Begin a transaction with ``first``, then commit one with ``second``, then the first."""
        ...

    @property
    def secrets(self) -> Sequence[str]: ...


def through_json(position: Position) -> Position:
    return position_from_json(json.loads(json.dumps(position_to_json(position))))


def changes_of(events: Sequence[RowChange]) -> list[tuple[str, int, str | None]]:
    """``(op, id, note after the change)`` per event."""
    return [(e.op, e.pk["id"], None if e.after is None else e.after.get("note")) for e in events]


class LogSourceContract:
    """The log-source contract: inherit and define a ``log_harness`` fixture."""

    #: Transactions come in commit order, each change at a ``LogPosition``
    #: (commit, ordinal) with ``last_in_transaction`` in its metadata. False
    #: for a sequence log: in the order written, positions its sequence.
    commit_ordered = True
    #: The field of a fetched record that holds its position.
    position_field = "position"

    @pytest.fixture
    def log_harness(self) -> LogSourceHarness:
        raise NotImplementedError("define a log_harness fixture returning a LogSourceHarness")

    @staticmethod
    def _all(source: SourceAdapter, after: Position = BEGINNING) -> list[RowChange]:
        return source.to_events(list(source.fetch(after, 1000)), poller=_POLLER, batch_id="all")

    # --- identity --------------------------------------------------------------------

    def test_is_a_source_adapter_with_a_stable_fingerprint(
        self, log_harness: LogSourceHarness
    ) -> None:
        source = log_harness.open()
        changed = log_harness.open_changed()
        again = log_harness.reopen(source)
        try:
            assert isinstance(source, SourceAdapter)
            assert source.name
            json.dumps(source.describe())
            digest = source.fingerprint().removeprefix("sha256:")
            assert len(digest) == 64
            assert again.fingerprint() == source.fingerprint()
            assert changed.fingerprint() != source.fingerprint()
            log_harness.commit([LogOp("insert", 1, "a")])
            self._all(source)
            assert source.fingerprint() == again.fingerprint(), "not a function of the data"
            shown = " ".join((source.name, source.fingerprint(), json.dumps(source.describe())))
            for secret in log_harness.secrets:
                assert secret not in shown
        finally:
            for s in (source, again, changed):
                s.close()
        source.close()  # twice is harmless

    # --- what the log holds ----------------------------------------------------------------

    def test_an_empty_log_fetches_nothing(self, log_harness: LogSourceHarness) -> None:
        with closing(log_harness.open()) as source:
            assert list(source.fetch(BEGINNING, 10)) == []
            assert source.to_events([], poller=_POLLER, batch_id="b") == []

    def test_inserts_updates_and_deletes_in_commit_order(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", 1, "a"), LogOp("insert", 2, "b")])
            log_harness.commit([LogOp("update", 1, "a2")])
            log_harness.commit([LogOp("delete", 2)])
            log_harness.commit([LogOp("update", 1, "a3"), LogOp("update", 1, "a4")])
            events = self._all(source)
            assert changes_of(events) == [
                ("insert", 1, "a"),
                ("insert", 2, "b"),
                ("update", 1, "a2"),
                ("delete", 2, None),
                ("update", 1, "a3"),
                ("update", 1, "a4"),
            ]
            delete = events[3]
            assert delete.after is None
            assert delete.before is not None
            assert delete.before["id"] == 2, "a delete carries at least the key it removed"
            for event in events:
                assert event.source == source.name
                assert event.metadata["poller"] == _POLLER
                assert through_json(position_of(event)) == position_of(event)
                if self.commit_ordered:
                    assert isinstance(event.cursor, str)

    def test_each_change_of_a_transaction_has_its_own_position(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", i, f"n{i}") for i in range(1, 6)])
            log_harness.commit([LogOp("insert", 6, "n6")])
            events = self._all(source)
            assert len({e.cursor for e in events}) == 6
            assert [e.cursor for e in events] == sorted(e.cursor for e in events)
            if not self.commit_ordered:
                return
            positions = [LogPosition.parse(e.cursor) for e in events]
            assert positions == sorted(positions), "positions follow the log"
            assert {p.commit for p in positions[:5]} == {positions[0].commit}
            assert [p.ordinal for p in positions[:5]] == [1, 2, 3, 4, 5]
            assert [e.metadata["last_in_transaction"] for e in events] == [
                False,
                False,
                False,
                False,
                True,
                True,
            ]

    def test_fetch_is_strictly_after_each_change_inside_a_transaction(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", i, f"n{i}") for i in range(1, 5)])
            log_harness.commit([LogOp("update", 1, "u"), LogOp("delete", 2)])
            events = self._all(source)
            expected = changes_of(events)
            assert len(expected) == 6
            for i, event in enumerate(events):
                after = through_json(position_of(event))
                rest = source.to_events(
                    list(source.fetch(after, 100)), poller=_POLLER, batch_id="b"
                )
                assert changes_of(rest) == expected[i + 1 :], f"after change {i + 1}"
                first = source.to_events(list(source.fetch(after, 1)), poller=_POLLER, batch_id="b")
                assert changes_of(first) == expected[i + 1 : i + 2]

    def test_paging_by_checkpoint_delivers_every_change_once(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", i, f"n{i}") for i in range(1, 8)])
            log_harness.commit([LogOp("update", 3, "x")])
            log_harness.commit([LogOp("delete", 3), LogOp("insert", 3, "again")])
            expected = changes_of(self._all(source))
            for limit in (1, 2, 3, 5):
                seen: list[tuple[str, int, str | None]] = []
                checkpoint = BEGINNING
                for _ in range(len(expected) + 2):
                    rows = list(source.fetch(checkpoint, limit))
                    assert len(rows) <= limit
                    if not rows:
                        break
                    events = source.to_events(rows, poller=_POLLER, batch_id="b")
                    seen.extend(changes_of(events))
                    checkpoint = through_json(position_of(events[-1]))
                assert seen == expected, f"limit={limit}"

    def test_event_ids_name_the_change(self, log_harness: LogSourceHarness) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", 1, "a"), LogOp("update", 1, "b")])
            log_harness.commit([LogOp("update", 1, "c")])
            first = self._all(source)
            source.close()
            again = log_harness.reopen(source)
            try:
                second = self._all(again)
            finally:
                again.close()
            ids = [e.event_id for e in first]
            assert len(set(ids)) == 3, "one key changed three times: three ids"
            assert [e.event_id for e in second] == ids, "a redelivery has the same ids"

    def test_transactions_arrive_in_commit_order_not_start_order(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit_crossed(
                [LogOp("insert", 1, "started first"), LogOp("insert", 2, "started first")],
                [LogOp("insert", 3, "committed first")],
            )
            first = [("insert", 1, "started first"), ("insert", 2, "started first")]
            second = [("insert", 3, "committed first")]
            # A sequence log numbers changes as they are written: whole
            # transactions, in the order they wrote.
            expected = second + first if self.commit_ordered else first + second
            assert changes_of(self._all(source)) == expected

    def test_a_rolled_back_transaction_never_appears(self, log_harness: LogSourceHarness) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", 1, "kept")])
            log_harness.rollback([LogOp("insert", 2, "gone"), LogOp("update", 1, "gone")])
            log_harness.commit([LogOp("insert", 3, "kept")])
            assert changes_of(self._all(source)) == [("insert", 1, "kept"), ("insert", 3, "kept")]

    def test_changes_committed_after_a_fetch_follow_the_checkpoint(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", 1, "a")])
            events = self._all(source)
            checkpoint = through_json(position_of(events[-1]))
            assert list(source.fetch(checkpoint, 10)) == []
            log_harness.commit([LogOp("update", 1, "b"), LogOp("insert", 2, "c")])
            later = self._all(source, checkpoint)
            assert changes_of(later) == [("update", 1, "b"), ("insert", 2, "c")]

    def test_a_record_without_its_position_is_a_serialization_error(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            log_harness.commit([LogOp("insert", 1, "a")])
            (row,) = source.fetch(BEGINNING, 1)
            broken = {k: v for k, v in row.items() if k != self.position_field}
            with pytest.raises(SerializationError):
                source.to_events([broken], poller=_POLLER, batch_id="b")

    def test_acknowledging_a_checkpoint_keeps_everything_after_it(
        self, log_harness: LogSourceHarness
    ) -> None:
        with closing(log_harness.open()) as source:
            if not isinstance(source, AcknowledgesCheckpoints):
                pytest.skip("the source holds nothing until checkpointed")
            log_harness.commit([LogOp("insert", i, f"n{i}") for i in range(1, 5)])
            log_harness.commit([LogOp("update", 2, "u")])
            events = self._all(source)
            expected = changes_of(events)
            # Acknowledge inside the first transaction, then after it.
            for i in (1, 3, 4):
                checkpoint = through_json(position_of(events[i]))
                source.acknowledge(checkpoint)
                rest = self._all(source, checkpoint)
                assert changes_of(rest) == expected[i + 1 :]
                source.close()
                restarted = log_harness.reopen(source)
                try:
                    assert changes_of(self._all(restarted, checkpoint)) == expected[i + 1 :]
                finally:
                    restarted.close()


def crossed(
    begin: Callable[[], None], other: Callable[[], None], finish: Callable[[], None]
) -> None:
    """Helper for harnesses: run ``begin``, then ``other`` to completion, then ``finish``."""
    begin()
    done = threading.Event()

    def run() -> None:
        other()
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    finish()


__all__ = ["LogOp", "LogSourceContract", "LogSourceHarness", "changes_of", "crossed"]
