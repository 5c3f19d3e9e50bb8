"""The fault-injection wrappers: transparent without a plan, precise with one."""

from __future__ import annotations

from pathlib import Path

import pytest

from dbtrigger import FetchError, FileCheckpointStore, InMemoryCheckpointStore
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    StoreAuthError,
    StoreUnavailableError,
)
from dbtrigger.faults import Fault, FaultPlan, FaultySource, FaultyStore
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.base import StoredDocument as Stored
from dbtrigger.testing import StoreContract
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_source, items_table


class TestFaultyStoreOverMemoryPassesTheContract(StoreContract):
    @pytest.fixture
    def store(self) -> CheckpointStore:
        return FaultyStore(InMemoryCheckpointStore())


class TestFaultyStoreOverFilePassesTheContract(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> CheckpointStore:
        return FaultyStore(FileCheckpointStore(tmp_path / "state"))


def faulty(*rules: tuple[str, Fault], **kw: object) -> FaultyStore:
    plan = FaultPlan()
    for op, fault in rules:
        plan.add(op, fault, **kw)  # type: ignore[arg-type]
    return FaultyStore(InMemoryCheckpointStore(), plan)


def test_conflict_refuses_and_writes_nothing() -> None:
    store = faulty(("write", Fault.CONFLICT), skip=1)
    etag = store.write("k", b"one", if_match=None)
    with pytest.raises(CasConflictError):
        store.write("k", b"two", if_match=etag)
    assert store.read("k") == Stored(b"one", etag)
    etag2 = store.write("k", b"three", if_match=etag)  # rule exhausted (times=1)
    assert store.read("k") == Stored(b"three", etag2)


def test_ambiguous_landed_writes_then_raises() -> None:
    store = faulty(("write", Fault.AMBIGUOUS_LANDED))
    with pytest.raises(AmbiguousWriteError):
        store.write("k", b"one", if_match=None)
    got = store.read("k")
    assert got is not None
    assert got.data == b"one"


def test_ambiguous_lost_raises_without_writing() -> None:
    store = faulty(("write", Fault.AMBIGUOUS_LOST))
    with pytest.raises(AmbiguousWriteError):
        store.write("k", b"one", if_match=None)
    assert store.read("k") is None


@pytest.mark.parametrize(
    ("fault", "error"), [(Fault.UNAVAILABLE, StoreUnavailableError), (Fault.AUTH, StoreAuthError)]
)
@pytest.mark.parametrize("op", ["read", "write", "delete", "list_keys"])
def test_unavailable_and_auth_on_every_operation(
    fault: Fault, error: type[Exception], op: str
) -> None:
    inner = InMemoryCheckpointStore()
    etag = inner.write("k", b"one", if_match=None)
    plan = FaultPlan()
    plan.add(op, fault)
    store = FaultyStore(inner, plan)
    calls = {
        "read": lambda: store.read("k"),
        "write": lambda: store.write("k", b"two", if_match=etag),
        "delete": lambda: store.delete("k"),
        "list_keys": store.list_keys,
    }
    with pytest.raises(error):
        calls[op]()
    assert inner.read("k") == Stored(b"one", etag), "a refused call changed the document"
    calls[op]()  # the rule fired once; the call now goes through


def test_write_only_faults_never_fire_on_reads() -> None:
    plan = FaultPlan()
    rule = plan.add("*", Fault.CONFLICT, times=None)
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    assert store.read("k") is None
    assert rule.fired == 0
    with pytest.raises(CasConflictError):
        store.write("k", b"x", if_match=None)


def test_slow_proceeds_and_before_hook_runs_first() -> None:
    order: list[str] = []
    plan = FaultPlan()
    plan.add("read", Fault.SLOW, delay=0.01, before=lambda call: order.append(f"hook:{call.op}"))
    inner = InMemoryCheckpointStore()
    inner.write("k", b"v", if_match=None)
    store = FaultyStore(inner, plan)
    got = store.read("k")
    order.append("returned")
    assert got is not None
    assert got.data == b"v"
    assert order == ["hook:read", "returned"]


def test_before_hook_can_make_a_real_conflict() -> None:
    inner = InMemoryCheckpointStore()
    etag = inner.write("k", b"one", if_match=None)
    plan = FaultPlan()
    plan.add(
        "write",
        Fault.NONE,
        before=lambda call: inner.write("k", b"competitor", if_match=call.if_match),
    )
    store = FaultyStore(inner, plan)
    with pytest.raises(CasConflictError):
        store.write("k", b"mine", if_match=etag)
    got = inner.read("k")
    assert got is not None
    assert got.data == b"competitor"


def test_skip_times_match_and_counts() -> None:
    plan = FaultPlan()
    rule = plan.add("write", Fault.UNAVAILABLE, skip=2, times=2, match=lambda c: c.key == "a")
    store = FaultyStore(InMemoryCheckpointStore(), plan)
    etag = store.write("a", b"0", if_match=None)  # 1st matching: skipped
    store.write("b", b"x", if_match=None)  # not matching
    etag = store.write("a", b"1", if_match=etag)  # 2nd matching: skipped
    for _ in range(2):
        with pytest.raises(StoreUnavailableError):
            store.write("a", b"2", if_match=etag)
    store.write("a", b"2", if_match=etag)
    assert rule.fired == 2
    assert plan.count("write") == 6
    assert plan.count("write", Fault.UNAVAILABLE) == 2
    assert [i.call.index for i in plan.calls] == list(range(6))
    assert plan.calls[0].call.document is None  # not a state document


def test_probability_is_reproducible_from_the_seed() -> None:
    def run(seed: int) -> list[bool]:
        plan = FaultPlan(seed=seed)
        plan.add("read", Fault.UNAVAILABLE, times=None, probability=0.5)
        store = FaultyStore(InMemoryCheckpointStore(), plan)
        out = []
        for _ in range(40):
            try:
                store.read("k")
                out.append(True)
            except StoreUnavailableError:
                out.append(False)
        return out

    assert run(7) == run(7)
    assert 5 < run(7).count(False) < 35
    with pytest.raises(ValueError, match="probability"):
        FaultPlan().add("read", Fault.UNAVAILABLE, probability=1.5)


def test_faulty_source_passes_through_and_injects(sqlite_db: TestDatabase) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    inner = items_source(sqlite_db)
    plan = FaultPlan()
    plan.add("fetch", Fault.CONNECTION_DROP)
    plan.add("fetch", Fault.QUERY_ERROR)
    source = FaultySource(inner, plan)
    assert source.name == inner.name
    assert source.fingerprint() == inner.fingerprint()
    assert source.describe() == inner.describe()
    with pytest.raises(FetchError, match="connection dropped") as dropped:
        source.fetch(BEGINNING, 10)
    assert isinstance(dropped.value.__cause__, ConnectionResetError)
    with pytest.raises(FetchError, match="query error"):
        source.fetch(BEGINNING, 10)
    rows = source.fetch(BEGINNING, 10)
    assert [r["id"] for r in rows] == [1, 2, 3]
    events = source.to_events(rows, poller="p", batch_id="b")
    assert [e.pk["id"] for e in events] == [1, 2, 3]
    assert source.null_cursor_keys() == []  # optional extras pass through
    assert plan.count("fetch") == 3
    source.close()
