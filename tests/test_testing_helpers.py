"""dbtrigger.testing: the helpers are public, so they are tested like the rest."""

from __future__ import annotations

import threading

import pytest

from dbtrigger import InMemoryCheckpointStore
from dbtrigger.errors import CasConflictError
from dbtrigger.testing import CountingStore, StoreCall, StoreContract, StoreCounts


class TestCountingStoreIsAStore(StoreContract):
    """Wrapping must not change the semantics it measures."""

    @pytest.fixture
    def store(self) -> CountingStore:
        return CountingStore(InMemoryCheckpointStore())


def test_counts_each_call_and_logs_failures() -> None:
    store = CountingStore(InMemoryCheckpointStore())
    assert store.counts == StoreCounts()
    assert store.read("p") is None
    etag = store.write("p", b"1", if_match=None)
    with pytest.raises(CasConflictError):
        store.write("p", b"2", if_match=None)
    store.write("p", b"3", if_match=etag)
    assert store.list_keys() == ["p"]
    store.delete("p")
    assert store.describe() == "memory"  # not an operation
    assert store.counts == StoreCounts(reads=1, writes=3, deletes=1, lists=1)
    assert store.calls == [
        StoreCall("read", "p"),
        StoreCall("write", "p"),
        StoreCall("write", "p", "CasConflictError"),
        StoreCall("write", "p"),
        StoreCall("list", None),
        StoreCall("delete", "p"),
    ]


def test_reset_returns_the_counts_and_starts_over() -> None:
    store = CountingStore(InMemoryCheckpointStore())
    store.write("p", b"1", if_match=None)
    store.read("p")
    assert store.reset() == StoreCounts(reads=1, writes=1)
    assert store.counts == StoreCounts()
    assert store.calls == []
    store.read("p")
    assert store.counts == StoreCounts(reads=1)


def test_counting_is_thread_safe() -> None:
    store = CountingStore(InMemoryCheckpointStore())
    store.write("p", b"x", if_match=None)
    store.reset()

    def reader() -> None:
        for _ in range(500):
            store.read("p")

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.counts == StoreCounts(reads=2000)


def test_importing_dbtrigger_or_its_testing_helpers_does_not_import_pytest() -> None:
    """Only the contract suites need pytest, and only they import it."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = (
        "import sys, dbtrigger, dbtrigger.testing\n"
        "from dbtrigger.testing import CountingStore, MemoryQuarantineSink, MemorySource\n"
        "assert 'pytest' not in sys.modules, 'pytest imported too early'\n"
        "from dbtrigger.testing import SinkContract, SourceContract, StoreContract\n"
        "assert 'pytest' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
