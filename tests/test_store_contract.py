"""The store contract against the in-memory and local-file stores."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import (
    CasConflictError,
    FileCheckpointStore,
    InMemoryCheckpointStore,
    StoreUnavailableError,
    UnsafeIdentifierError,
)
from tests.contracts.store_contract import StoreContract


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> InMemoryCheckpointStore:
        return InMemoryCheckpointStore()


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> FileCheckpointStore:
        return FileCheckpointStore(tmp_path / "state")


def _race_writer(directory: str, etag: str, index: int, barrier: Any, results: Any) -> None:
    store = FileCheckpointStore(directory)
    barrier.wait()
    try:
        store.write("race", f"process-{index}".encode(), if_match=etag)
        results.put(("won", index))
    except CasConflictError:
        results.put(("lost", index))


def test_file_store_processes_racing_one_etag_exactly_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    store = FileCheckpointStore(tmp_path / "state")
    for round_ in range(3):
        etag = (
            store.write("race", b"start", if_match=None) if round_ == 0 else store.read("race").etag
        )  # type: ignore[union-attr]
        n = 6
        barrier = ctx.Barrier(n)
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_race_writer, args=(str(tmp_path / "state"), etag, i, barrier, results)
            )
            for i in range(n)
        ]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        winners = [i for status, i in outcomes if status == "won"]
        assert len(winners) == 1, outcomes
        got = store.read("race")
        assert got is not None
        assert got.data == f"process-{winners[0]}".encode()


def test_file_store_reads_a_hand_placed_document(tmp_path: Path) -> None:
    """A restored backup copied in by hand has no etag file: it still gets a stable etag."""
    store = FileCheckpointStore(tmp_path)
    (tmp_path / "p.json").write_bytes(b"{}")
    first = store.read("p")
    assert first is not None
    assert first == store.read("p")
    etag = store.write("p", b"{ }", if_match=first.etag)
    assert store.read("p") == (b"{ }", etag)


def test_file_store_rejects_unsafe_keys(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    for key in ("../escape", "a/b", "", ".hidden"):
        with pytest.raises(UnsafeIdentifierError):
            store.read(key)


def test_file_store_missing_directory_is_unavailable(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path / "nope", create=False)
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        store.read("p")
