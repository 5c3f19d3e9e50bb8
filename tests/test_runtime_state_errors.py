"""What the tick says when writing its state goes wrong in ways that are not a race.

Each case drives the real poller over a real file store, with faults injected
between them (``dbtrigger.faults``) where the real store cannot misbehave on
demand.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import (
    DbBindings,
    FileCheckpointStore,
    HandlerError,
    PollTrigger,
    RetryPolicy,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.errors import (
    AmbiguousCommitError,
    CorruptStateError,
    FailureRecordError,
    OperatorError,
    PartialBatchError,
)
from dbtrigger.faults import Fault, FaultPlan, FaultyStore
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import MAX_DONE_IDS
from dbtrigger.state.stores.table import TableCheckpointStore
from tests.azurite import Azurite
from tests.databases import TestDatabase


def make_events(db: TestDatabase, rows: int) -> SqlAlchemySource:
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "seq": i} for i in range(1, rows + 1)])
    return SqlAlchemySource(url=db.url, table="events", cursor_column="seq", pk_columns=["id"])


def test_a_commit_without_answer_then_a_store_outage_is_ambiguous_not_a_conflict(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    inner = FileCheckpointStore(tmp_path)
    plan = FaultPlan()
    plan.add("write", Fault.AMBIGUOUS_LANDED, skip=1)  # the commit lands, its answer is lost
    plan.add("read", Fault.UNAVAILABLE, skip=1, times=None)  # ...and the store stays down
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 3),
        checkpoint_store=FaultyStore(inner, plan),
        max_batches_per_tick=1,
    )
    seen: list[RowChange] = []
    with pytest.raises(AmbiguousCommitError) as info:
        trigger.tick(seen.extend)
    message = str(info.value)
    assert "conflicting" not in message
    assert "may or may not have landed" in message
    assert len(seen) == 3

    # It had landed: the next tick (store back) carries on from there, no redelivery.
    plan.clear()
    stored = inner.read("orders")
    assert stored is not None
    assert docmod.loads(stored.data).position.pk == {"id": 3}
    assert trigger.tick(seen.extend) == 0
    assert len(seen) == 3


# --- item: a failure record that cannot be stored ------------------------------------------


@pytest.mark.azurite
def test_a_big_partially_failed_batch_keeps_counting_attempts_on_the_table_store(
    sqlite_db: TestDatabase, azurite: Azurite
) -> None:
    """20,000 rows, only the first fails: before, the record listed 19,999 done ids,
    too large for a Table entity, so attempts were never counted."""
    rows = 20_000
    store = TableCheckpointStore(
        connection_string=azurite.connection_string, table=f"t{uuid.uuid4().hex[:12]}"
    )
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, rows),
        checkpoint_store=store,
        batch_size=rows,
        max_attempts=3,
    )

    def handler(events: list[RowChange]) -> None:
        raise PartialBatchError([dict(events[0].pk)])

    try:
        for attempt in (1, 2):
            with pytest.raises(HandlerError):
                trigger.tick(handler)
            stored = store.read("orders")
            assert stored is not None
            failure = docmod.loads(stored.data).failure
            assert failure is not None
            assert failure.attempts == attempt
            assert failure.done_total == rows - 1
            assert len(failure.done) == MAX_DONE_IDS
            assert failure.batch_rows == rows
    finally:
        store.table_client.delete_table()
        store.close()


def test_a_failure_record_the_store_refuses_is_an_operator_error(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = FaultPlan()
    plan.add("write", Fault.AUTH, skip=1)  # the lease is taken; the failure record is refused
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 3),
        checkpoint_store=FaultyStore(FileCheckpointStore(tmp_path), plan),
    )

    def handler(events: list[RowChange]) -> None:
        raise ValueError("poison")

    with pytest.raises(FailureRecordError, match="not counted") as info:
        trigger.tick(handler)
    assert isinstance(info.value, OperatorError)
    assert "ValueError: poison" in str(info.value)


def test_a_failure_record_lost_to_an_outage_is_logged_as_an_error(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = FaultPlan()
    plan.add("write", Fault.UNAVAILABLE, skip=1, times=None)
    trigger = PollTrigger(
        name="orders",
        source=make_events(sqlite_db, 3),
        checkpoint_store=FaultyStore(FileCheckpointStore(tmp_path), plan),
        retry=RetryPolicy.none(),
    )

    def handler(events: list[RowChange]) -> None:
        raise ValueError("poison")

    with pytest.raises(HandlerError):
        trigger.tick(handler)
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "failure_uncounted"]
    assert record.levelno == logging.ERROR
    assert "not counted" in record.getMessage()


def test_a_corrupt_state_document_names_the_poller_the_store_and_the_way_out(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Inside an invocation the error said only "state document is not valid JSON":
    not which of the app's pollers, not which store, not what to do."""
    source = make_events(sqlite_db, 3)
    store = FileCheckpointStore(tmp_path / "state")
    db = DbBindings()

    @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="orders")
    def orders_poll(timer: object, events: list[RowChange]) -> None:
        return None

    orders_poll(timer=None)
    stored = store.read("orders")
    assert stored is not None
    store.write("orders", stored.data[: len(stored.data) // 2], if_match=stored.etag)
    with pytest.raises(CorruptStateError) as err:
        orders_poll(timer=None)
    message = str(err.value)
    assert "not valid JSON" in message  # what is wrong...
    assert "poller 'orders'" in message  # ...with which poller's state...
    assert store.describe() in message  # ...in which store...
    assert "Nothing was changed" in message  # ...and the ways out
    assert "dbtrigger reset orders --from-file BACKUP --force" in message
    spec = "tests.test_runtime_state_errors:orders_poll"  # the function, filled in
    assert f"dbtrigger reset orders --to-beginning --source {spec} --force" in message
    assert f"dbtrigger history orders --source {spec}`" in message  # the last position
    assert err.value.poller == "orders"

    # Another poller's document copied under this name: the same, named.
    current = store.read("orders")
    assert current is not None
    other = docmod.dumps(docmod.StateDocument(poller_name="invoices", source_fingerprint="x"))
    store.write("orders", other, if_match=current.etag)
    with pytest.raises(CorruptStateError, match="belongs to poller 'invoices'") as err:
        orders_poll(timer=None)
    assert "dbtrigger reset orders --from-file BACKUP --force" in str(err.value)
