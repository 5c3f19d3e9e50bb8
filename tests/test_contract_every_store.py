"""The contract's failure cases at the tick level, on every checkpoint store.

``test_failures_scenarios.py`` and ``test_failures_windows.py`` provoke each
case once, against the in-memory store (behind ``FaultyStore``). The store
contract suite shows each store's compare-and-swap on its own. This module
joins the two: the cases whose outcome depends on what a store really does
with a document (a failure record and a release written by CAS, a takeover
that must refuse a stale commit, a hand-damaged or foreign document, a dead
holder's lease, an unreachable service) run through ``PollTrigger`` against
memory, files, SQL on SQLite, PostgreSQL and MariaDB, Blob and Table storage
(Azurite). Each asserts what the contract promises: the typed error, the
handler not called (or called again with the same events), the checkpoint
where it was, and no lease left behind.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.core.credentials import AzureNamedKeyCredential

from dbtrigger import (
    CommitError,
    FetchError,
    FileCheckpointStore,
    HandlerError,
    LostLeaseError,
    RowChange,
    SerializationError,
)
from dbtrigger.errors import CasConflictError, CorruptStateError, FingerprintMismatchError
from dbtrigger.faults import Fault, FaultPlan, FaultySource, FaultyStore
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import document as docmod
from dbtrigger.state.stores import (
    BlobCheckpointStore,
    SqlCheckpointStore,
    TableCheckpointStore,
)
from dbtrigger.state.stores.base import CheckpointStore
from tests.azurite import ACCOUNT, KEY
from tests.databases import TestDatabase
from tests.reliability_support import (
    Clock,
    Recorder,
    add_items,
    checkpoint_id,
    commit_writes,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    steal_lease,
    wait_for,
)
from tests.store_kinds import open_store

#: Bound on every wait for an outcome.
BOUND = 30.0

STORES = ["memory", "file", "sql-sqlite", "sql-postgresql", "sql-mariadb", "blob", "table"]
_MARKS = {
    "sql-postgresql": [pytest.mark.postgresql],
    "sql-mariadb": [pytest.mark.mariadb],
    "blob": [pytest.mark.azurite],
    "table": [pytest.mark.azurite],
}


@pytest.fixture(params=[pytest.param(s, marks=_MARKS.get(s, [])) for s in STORES])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    yield from open_store(request.param, request, tmp_path)


@pytest.fixture
def five(sqlite_db: TestDatabase) -> TestDatabase:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 6))
    return sqlite_db


def _more(db: TestDatabase, ids: range) -> None:
    add_items(db, sa.Table("items", sa.MetaData(), schema=db.schema, autoload_with=db.engine), ids)


def _no_lease_held(store: CheckpointStore) -> bool:
    lease = read_doc(store).lease
    return lease is None or lease.released


# --- 5.5 / §6: the handler raises -----------------------------------------------------------


def test_a_handler_error_keeps_the_checkpoint_releases_and_redelivers(
    five: TestDatabase, store: CheckpointStore
) -> None:
    trigger = make_trigger(items_source(five), store, batch_size=5)
    assert trigger.tick(Recorder()) == 5
    _more(five, range(6, 11))
    handler = Recorder(fail_on={8})
    with pytest.raises(HandlerError) as info:
        trigger.tick(handler)
    assert isinstance(info.value.__cause__, ValueError)
    assert checkpoint_id(store) == 5, "the checkpoint moved past a failed batch"
    assert _no_lease_held(store)
    failure = read_doc(store).failure
    assert failure is not None
    assert failure.attempts == 1
    handler.fail_on.clear()
    assert trigger.tick(handler) == 5
    assert handler.event_ids[0] == handler.event_ids[1], "not the same events again"
    assert checkpoint_id(store) == 10
    assert read_doc(store).failure is None
    assert trigger.tick(handler) == 0, "a committed batch came again"


# --- 5.1 / 8.1: the lease is held elsewhere ----------------------------------------------------


def test_a_live_lease_elsewhere_is_a_quiet_zero_that_writes_nothing(
    five: TestDatabase, store: CheckpointStore
) -> None:
    holder = make_trigger(items_source(five), store, owner_id="holder")
    other = make_trigger(items_source(five), store, owner_id="other")
    other_handler = Recorder()
    seen: list[tuple[int, bool]] = []

    def handler(events: list[RowChange]) -> None:
        before = store.read("items")
        seen.append((other.tick(other_handler), store.read("items") == before))

    assert holder.tick(handler) == 5
    assert seen == [(0, True)], "the refused tick ran or changed the state"
    assert other_handler.calls == 0
    assert checkpoint_id(store) == 5


# --- W4 / 5.6 / spec §11: the lease expires and another instance takes over ---------------------


def test_a_takeover_mid_batch_refuses_the_stale_commit(
    five: TestDatabase, store: CheckpointStore
) -> None:
    slow = make_trigger(items_source(five), store, owner_id="slow", heartbeat_interval_seconds=0)
    later = Clock()
    later.advance(3600)
    other = make_trigger(items_source(five), store, owner_id="other", clock=later)
    other_handler = Recorder()

    def handler(events: list[RowChange]) -> None:
        assert other.tick(other_handler) == 5  # the takeover happens while we work

    with pytest.raises(LostLeaseError) as info:
        slow.tick(handler)
    assert info.value.fencing_token == 1
    assert other_handler.ids == [1, 2, 3, 4, 5]
    doc = read_doc(store)
    assert doc.lease is not None
    assert (doc.lease.owner_id, doc.lease.fencing_token) == ("other", 2)
    assert [entry["fencing_token"] for entry in doc.journal] == [2], "a stale commit landed"
    assert checkpoint_id(store) == 5


# --- W2 / W6: a holder died mid-batch -----------------------------------------------------------


def test_a_dead_holders_lease_blocks_until_expiry_then_the_batch_is_redelivered(
    five: TestDatabase, store: CheckpointStore
) -> None:
    clock = Clock()
    trigger = make_trigger(items_source(five), store, lease_ttl_seconds=30, clock=clock)
    handler = Recorder()
    assert trigger.tick(handler) == 5
    _more(five, range(6, 11))
    # Another instance took the lease and was killed before committing or releasing.
    dead_token = steal_lease(store, owner="dead", ttl=30, after=clock.now - Clock().now)
    assert trigger.tick(handler) == 0, "a live lease was stolen"
    clock.advance(31)  # expired a second ago, but inside the 5 s grace window for clock skew
    assert trigger.tick(handler) == 0, "the lease was taken inside its grace window"
    clock.advance(5)
    assert trigger.tick(handler) == 5
    assert handler.ids == list(range(1, 11))
    assert handler.deliveries[-1][1] == dead_token + 1
    assert checkpoint_id(store) == 10
    assert _no_lease_held(store)


# --- 5.2 / spec §9: a malformed or foreign state document ---------------------------------------


@pytest.mark.parametrize(
    "damage",
    [b"not json {", b'{"version": 1, "poller_name": 7}', b'{"version": 999}', b"[]"],
    ids=["not-json", "wrong-types", "future-version", "not-an-object"],
)
def test_a_malformed_state_document_is_refused_and_left_as_it_is(
    five: TestDatabase, store: CheckpointStore, damage: bytes
) -> None:
    trigger = make_trigger(items_source(five), store)
    assert trigger.tick(Recorder()) == 5
    stored = store.read("items")
    assert stored is not None
    store.write("items", damage, if_match=stored.etag)
    damaged = store.read("items")
    handler = Recorder()
    with pytest.raises(CorruptStateError) as info:
        trigger.tick(handler)
    assert handler.calls == 0
    assert store.read("items") == damaged, "the tick wrote over the damaged document"
    assert "items" in str(info.value)


def test_a_changed_source_definition_is_refused_and_left_as_it_is(
    five: TestDatabase, store: CheckpointStore
) -> None:
    trigger = make_trigger(items_source(five), store)
    assert trigger.tick(Recorder()) == 5
    stored = store.read("items")
    assert stored is not None
    doc = docmod.loads(stored.data)
    foreign = docmod.StateDocument(
        poller_name=doc.poller_name,
        source_fingerprint="sha256:" + "0" * 64,
        checkpoint=doc.checkpoint,
        lease=doc.lease,
    )
    store.write("items", docmod.dumps(foreign), if_match=stored.etag)
    before = store.read("items")
    _more(five, range(6, 8))
    handler = Recorder()
    with pytest.raises(FingerprintMismatchError):
        trigger.tick(handler)
    assert handler.calls == 0
    assert store.read("items") == before


# --- 5.2 / 5.10: the store cannot be reached ----------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


UNREACHABLE = ["file", "sql-sqlite", "sql-postgresql", "sql-mariadb", "blob", "table"]


def _unreachable(kind: str, tmp_path: Path) -> CheckpointStore:
    port = _closed_port()
    if kind == "file":
        return FileCheckpointStore(tmp_path / "gone", create=False)
    if kind == "sql-sqlite":
        return SqlCheckpointStore(url=f"sqlite:///{tmp_path / 'missing-dir' / 'state.db'}")
    if kind == "sql-postgresql":
        return SqlCheckpointStore(
            url=f"postgresql+psycopg://app:pw@127.0.0.1:{port}/state?connect_timeout=3"
        )
    if kind == "sql-mariadb":
        return SqlCheckpointStore(
            url=f"mysql+pymysql://app:pw@127.0.0.1:{port}/state?connect_timeout=3"
        )
    if kind == "blob":
        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
        )
        return BlobCheckpointStore.from_connection_string(conn, app_name="app", container="state")
    return TableCheckpointStore(
        endpoint=f"http://127.0.0.1:{port}/{ACCOUNT}",
        credential=AzureNamedKeyCredential(ACCOUNT, KEY),
        retries=0,
    )


@pytest.mark.parametrize("kind", UNREACHABLE)
def test_an_unreachable_store_is_a_fetch_error_before_any_handler(
    five: TestDatabase, tmp_path: Path, kind: str
) -> None:
    store = _unreachable(kind, tmp_path)
    handler = Recorder()
    try:
        with pytest.raises(FetchError) as info:
            make_trigger(items_source(five), store).tick(handler)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    assert handler.calls == 0
    assert "pw" not in str(info.value)
    assert KEY not in str(info.value)


# --- 5.8 / spec §7: the heartbeat is refused mid-handler ------------------------------------------


def test_a_refused_heartbeat_cancels_the_batch_and_commits_nothing(
    five: TestDatabase, store: CheckpointStore
) -> None:
    trigger = make_trigger(
        items_source(five), store, lease_ttl_seconds=3, heartbeat_interval_seconds=0.1
    )
    flags: list[bool] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        stolen: list[int] = []

        def steal() -> bool:
            try:
                stolen.append(steal_lease(store))
            except CasConflictError:  # our own heartbeat wrote in between: read again
                return False
            return True

        wait_for(steal, BOUND)
        ctx.lease_lost.wait(BOUND)
        flags.append(ctx.cancelled)

    with pytest.raises(LostLeaseError):
        trigger.tick(handler)
    assert flags == [True]
    assert checkpoint_id(store) is None
    lease = read_doc(store).lease
    assert lease is not None
    assert lease.owner_id == "thief", "the stale owner wrote over the new holder"


# --- a handler that hangs past its lease --------------------------------------------------------


def test_a_handler_hung_past_its_lease_is_taken_over_and_its_late_return_writes_nothing(
    five: TestDatabase, store: CheckpointStore
) -> None:
    hung = make_trigger(
        items_source(five),
        store,
        lease_ttl_seconds=1.0,
        handler_timeout_seconds=0.5,
        owner_id="hung",
    )
    other = make_trigger(items_source(five), store, lease_ttl_seconds=1.0, owner_id="other")
    entered, release = threading.Event(), threading.Event()
    outcome: list[BaseException | int] = []

    def stuck(events: list[RowChange]) -> None:
        entered.set()
        release.wait(BOUND)

    def run() -> None:
        try:
            outcome.append(hung.tick(stuck))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert entered.wait(BOUND)
        recorder = Recorder()
        delivered: list[int] = []
        wait_for(lambda: delivered.append(other.tick(recorder)) or sum(delivered) == 5, BOUND)
        assert recorder.ids == [1, 2, 3, 4, 5]
        committed = store.read("items")
    finally:
        release.set()
        thread.join(BOUND)
    assert not thread.is_alive()
    (result,) = outcome
    assert isinstance(result, LostLeaseError)
    assert store.read("items") == committed, "the late return wrote to the state"
    assert checkpoint_id(store) == 5


# --- W1 / W5: the commit fails, or its answer is lost ---------------------------------------------


def test_a_failed_commit_releases_and_the_same_batch_comes_again(
    five: TestDatabase, store: CheckpointStore
) -> None:
    plan = FaultPlan()
    plan.add("write", Fault.UNAVAILABLE, times=None, match=commit_writes(store))
    faulty = FaultyStore(store, plan)
    trigger = make_trigger(items_source(five), faulty)
    handler = Recorder()
    with pytest.raises(CommitError) as info:
        trigger.tick(handler)
    assert not isinstance(info.value, LostLeaseError)
    assert read_doc(store).checkpoint is None
    assert _no_lease_held(store)
    plan.clear()
    assert trigger.tick(handler) == 5
    assert handler.event_ids[0] == handler.event_ids[1]
    assert checkpoint_id(store) == 5


@pytest.mark.parametrize(
    ("fault", "redelivered"), [(Fault.AMBIGUOUS_LANDED, False), (Fault.AMBIGUOUS_LOST, True)]
)
def test_an_ambiguous_commit_ends_in_a_duplicate_at_worst_never_a_loss(
    five: TestDatabase, store: CheckpointStore, fault: Fault, redelivered: bool
) -> None:
    plan = FaultPlan()
    plan.add("write", fault, match=commit_writes(store))
    plan.add("read", Fault.UNAVAILABLE, skip=1, times=None)  # the read-back cannot settle it
    clock = Clock()
    trigger = make_trigger(
        items_source(five), FaultyStore(store, plan), clock=clock, lease_ttl_seconds=30
    )
    with pytest.raises(CommitError):
        trigger.tick(Recorder())
    plan.clear()
    clock.advance(36)  # the release could not be written either: past our own lease
    again = Recorder()
    assert trigger.tick(again) == (5 if redelivered else 0)
    assert checkpoint_id(store) == 5
    _more(five, range(6, 8))
    assert trigger.tick(again) == 2, "rows after the settled commit were lost"


# --- 5.3 / 5.4: the source fails while the lease is held ----------------------------------------


def test_a_fetch_failing_with_the_lease_held_commits_what_was_handled_and_releases(
    five: TestDatabase, store: CheckpointStore
) -> None:
    plan = FaultPlan()
    plan.add("fetch", Fault.QUERY_ERROR, skip=1, times=None)  # batch 2's fetch
    trigger = make_trigger(
        FaultySource(items_source(five), plan), store, batch_size=3, max_batches_per_tick=2
    )
    handler = Recorder()
    with pytest.raises(FetchError):
        trigger.tick(handler)
    assert handler.ids == [1, 2, 3]
    assert checkpoint_id(store) == 3
    assert _no_lease_held(store)
    plan.clear()
    assert trigger.tick(handler) == 2
    assert handler.ids == [1, 2, 3, 4, 5]


def test_a_row_that_cannot_become_a_checkpoint_stops_the_poller_there(
    five: TestDatabase, store: CheckpointStore
) -> None:
    """SQLite keeps text in an integer column: the row is refused, every time, and
    the checkpoint stays at the row before it."""
    five.execute("INSERT INTO items (id, version, payload) VALUES (6, 'soon', 'p6')")
    trigger = make_trigger(items_source(five), store, batch_size=5)
    handler = Recorder()
    assert trigger.tick(handler) == 5
    for _ in range(2):  # a poison configuration: the same failure every tick
        with pytest.raises(SerializationError, match="soon"):
            trigger.tick(handler)
        assert handler.ids == [1, 2, 3, 4, 5]
        assert checkpoint_id(store) == 5
        assert _no_lease_held(store)
