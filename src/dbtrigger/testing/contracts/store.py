"""The ``CheckpointStore`` contract, run against every implementation.

Subclass :class:`StoreContract` in a pytest module and provide a ``store``
fixture returning a fresh, empty store::

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store(self) -> MyStore:
            return MyStore(...)

A fake that fails any of these is a bug, exactly like a real adapter that does.
The races are real threads on one store object, so a store that is not
thread-safe fails them.
"""

from __future__ import annotations

import pytest

from dbtrigger.errors import CasConflictError
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument
from dbtrigger.testing.contracts._threads import run_together


class StoreContract:
    """The store contract: inherit and define a ``store`` fixture (fresh and empty)."""

    def test_is_a_checkpoint_store(self, store: CheckpointStore) -> None:
        assert isinstance(store, CheckpointStore)

    def test_read_missing_is_none(self, store: CheckpointStore) -> None:
        assert store.read("absent") is None

    def test_create_then_read_returns_bytes_and_etag(self, store: CheckpointStore) -> None:
        etag = store.write("p1", b'{"a": 1}', if_match=None)
        got = store.read("p1")
        assert got == StoredDocument(b'{"a": 1}', etag)

    def test_create_only_refuses_existing(self, store: CheckpointStore) -> None:
        store.write("p1", b"one", if_match=None)
        with pytest.raises(CasConflictError):
            store.write("p1", b"two", if_match=None)
        got = store.read("p1")
        assert got is not None
        assert got.data == b"one"

    def test_update_with_current_etag(self, store: CheckpointStore) -> None:
        e1 = store.write("p1", b"one", if_match=None)
        e2 = store.write("p1", b"two", if_match=e1)
        assert e2 != e1
        got = store.read("p1")
        assert got == StoredDocument(b"two", e2)

    def test_stale_etag_is_rejected_and_changes_nothing(self, store: CheckpointStore) -> None:
        e1 = store.write("p1", b"one", if_match=None)
        e2 = store.write("p1", b"two", if_match=e1)
        with pytest.raises(CasConflictError):
            store.write("p1", b"three", if_match=e1)
        assert store.read("p1") == StoredDocument(b"two", e2)

    def test_update_of_missing_document_is_a_conflict(self, store: CheckpointStore) -> None:
        with pytest.raises(CasConflictError):
            store.write("never-created", b"x", if_match='"some-etag"')

    def test_etag_changes_even_for_identical_bytes(self, store: CheckpointStore) -> None:
        e1 = store.write("p1", b"same", if_match=None)
        e2 = store.write("p1", b"same", if_match=e1)
        assert e1 != e2
        with pytest.raises(CasConflictError):
            store.write("p1", b"same", if_match=e1)

    def test_keys_are_independent(self, store: CheckpointStore) -> None:
        ea = store.write("a", b"A", if_match=None)
        eb = store.write("b", b"B", if_match=None)
        store.write("a", b"A2", if_match=ea)
        assert store.read("b") == StoredDocument(b"B", eb)
        assert store.list_keys() == ["a", "b"]

    def test_delete(self, store: CheckpointStore) -> None:
        e1 = store.write("p1", b"one", if_match=None)
        e2 = store.write("p1", b"two", if_match=e1)
        with pytest.raises(CasConflictError):
            store.delete("p1", if_match=e1)
        store.delete("p1", if_match=e2)
        assert store.read("p1") is None
        store.delete("p1")  # absent is fine
        store.write("p1", b"again", if_match=None)

    def test_large_document_round_trips(self, store: CheckpointStore) -> None:
        data = b'{"journal": "' + b"x" * 200_000 + b'"}'
        store.write("big", data, if_match=None)
        got = store.read("big")
        assert got is not None
        assert got.data == data

    def test_describe_is_text(self, store: CheckpointStore) -> None:
        assert isinstance(store.describe(), str)
        assert store.describe()

    @staticmethod
    def _race(
        store: CheckpointStore, key: str, writers: int, label: str, *, if_match: str | None
    ) -> tuple[list[int], list[int]]:
        """``writers`` threads write ``key`` at once (``{label}-{i}``) with the same
        ``if_match``: which of them won, and which lost the CAS."""
        wins: list[int] = []
        conflicts: list[int] = []

        def attempt(i: int) -> None:
            try:
                store.write(key, f"{label}-{i}".encode(), if_match=if_match)
                wins.append(i)
            except CasConflictError:
                conflicts.append(i)

        assert run_together(writers, attempt) == []
        return wins, conflicts

    @pytest.mark.parametrize("writers", [8])
    def test_racing_writers_on_one_etag_exactly_one_wins(
        self, store: CheckpointStore, writers: int
    ) -> None:
        etag = store.write("race", b"start", if_match=None)
        wins, conflicts = self._race(store, "race", writers, "writer", if_match=etag)
        assert len(wins) == 1, (wins, conflicts)
        assert len(conflicts) == writers - 1
        got = store.read("race")
        assert got is not None
        assert got.data == f"writer-{wins[0]}".encode()

    def test_racing_creators_exactly_one_wins(self, store: CheckpointStore) -> None:
        wins, _ = self._race(store, "fresh", 6, "creator", if_match=None)
        assert len(wins) == 1
