"""The store contract against every checkpoint store.

In memory, local files, SQL (SQLite, PostgreSQL, MariaDB: an isolated schema
per test), Blob and Table storage (Azurite: a container or table per test).
Wrappers that must be transparent (``CountingStore``, ``FaultyStore``) run it
in their own test modules. What is specific to one store lives in that store's
module; the file store's cross-process race and its key rules are here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore
from dbtrigger.errors import CasConflictError, StoreUnavailableError, UnsafeIdentifierError
from dbtrigger.state.stores import (
    BlobCheckpointStore,
    SqlCheckpointStore,
    TableCheckpointStore,
)
from dbtrigger.testing import StoreContract
from tests.azurite import Azurite
from tests.contracts.nested import nested_failures
from tests.databases import TestDatabase
from tests.race_processes import race_context
from tests.store_kinds import blob_store, table_store


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> InMemoryCheckpointStore:
        return InMemoryCheckpointStore()


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> FileCheckpointStore:
        return FileCheckpointStore(tmp_path / "state")


class TestSqlStore(StoreContract):
    @pytest.fixture
    def store(self, db: TestDatabase) -> Iterator[SqlCheckpointStore]:
        store = SqlCheckpointStore(url=db.url, schema=db.schema)
        yield store
        store.close()


@pytest.mark.azurite
class TestBlobStore(StoreContract):
    @pytest.fixture
    def store(self, azurite: Azurite) -> Iterator[BlobCheckpointStore]:
        yield from blob_store(azurite)


@pytest.mark.azurite
class TestTableStore(StoreContract):
    @pytest.fixture
    def store(self, azurite: Azurite) -> Iterator[TableCheckpointStore]:
        yield from table_store(azurite)


def _race_writer(directory: str, etag: str, index: int, barrier: Any, results: Any) -> None:
    store = FileCheckpointStore(directory)
    barrier.wait()
    try:
        store.write("race", f"process-{index}".encode(), if_match=etag)
        results.put(("won", index))
    except CasConflictError:
        results.put(("lost", index))


def test_file_store_processes_racing_one_etag_exactly_one_wins(tmp_path: Path) -> None:
    ctx = race_context()
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


# --- the suite can fail -------------------------------------------------------------

pytest_plugins = ["pytester"]

#: Each broken store, and a test of the suite that must catch it.
CAUGHT_BY = {
    "last_writer_wins": "test_stale_etag_is_rejected_and_changes_nothing",
    "content_etag": "test_etag_changes_even_for_identical_bytes",
}


def test_the_suite_passes_the_memory_store_and_fails_every_broken_one(
    pytester: pytest.Pytester,
) -> None:
    makes = {"correct": {"store": "broken.InMemoryCheckpointStore()"}}
    for name in CAUGHT_BY:
        makes[name] = {"store": f"broken.BROKEN_STORES[{name!r}]()"}
    failures = nested_failures(pytester, "StoreContract", makes)
    assert failures.pop("correct") == set()
    missed = {name: got for name, got in failures.items() if CAUGHT_BY[name] not in got}
    assert missed == {}, f"a broken store the suite did not catch as expected: {missed}"
