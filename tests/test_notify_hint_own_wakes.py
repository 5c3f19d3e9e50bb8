"""A notify wake-up hint ends the trigger's own wait; it does not replace it.

``Runner(..., wake=NotifyHint())`` used to sleep in the hint's ``wait`` in
place of the trigger's ``wait_for_work``: whatever else ends that wait early
was skipped, so a queue listening on its own ``notify_channel`` or a
partition member gaining partitions waited the whole interval. Each test
here makes the trigger's own early wake happen while a hint listens on a
channel nobody notifies; the interval is far longer (300 s) than the bound
the outcome is waited for, so only the trigger's own wake explains it.
PostgreSQL only: the hint is ``LISTEN/NOTIFY``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest

from dbtrigger import ClaimSource, InMemoryCheckpointStore, PollTrigger, QueueTrigger
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.runtime.runner import Runner
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.wakeup import NotifyHint
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs
from tests.test_queue_notify import CHANNEL, done, insert
from tests.test_wakeup import add_item, make_items, wait_until

#: The runner's interval: only a wake-up explains an outcome within BOUND.
LONG_INTERVAL = 300.0
BOUND = 30.0
#: The hint's channel: nobody notifies it.
QUIET_CHANNEL = "dbt_nobody_notifies"


class Worker:
    """A runner in a thread, with a notify hint on the quiet channel; stopped on exit."""

    def __init__(self, trigger: Any) -> None:
        self.seen: list[Any] = []
        self.hint = NotifyHint(QUIET_CHANNEL)
        self.runner = Runner(
            trigger,
            lambda events: self.seen.extend(e.pk["id"] for e in events),
            interval_seconds=LONG_INTERVAL,
            progress=None,
            wake=self.hint,
        )
        self.thread = threading.Thread(target=self.runner.run, kwargs={"install_signals": False})

    def __enter__(self) -> Worker:
        self.thread.start()
        return self

    def settled(self) -> bool:
        """The hint listens, and its first wake (sent once on LISTEN) is spent:
        the runner sleeps its long interval now."""
        listener = self.hint.listener
        assert listener is not None
        return listener.listening.wait(BOUND) and wait_until(
            lambda: self.runner.stats.ticks >= 2, BOUND
        )

    def __exit__(self, *exc: Any) -> None:
        self.runner.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_the_queues_own_notify_still_wakes_it(pg: TestDatabase) -> None:
    make_jobs(pg, 0)
    source = ClaimSource(url=pg.url, table="jobs", schema=pg.schema, pk_columns=["id"])
    queue = QueueTrigger(name="jobs", source=source, notify_channel=CHANNEL)
    try:
        with Worker(queue) as worker:
            assert worker.settled()
            assert queue._listener is not None
            assert queue._listener.listening.wait(BOUND), "the queue's listener never started"
            assert wait_until(lambda: not queue._listener.wake.is_set(), BOUND)  # its first, spent
            insert(pg, 1, notify=True)  # on the queue's channel, not the hint's
            assert wait_until(lambda: done(pg) == {1}, BOUND), "the queue's NOTIFY was skipped"
        assert worker.seen == [1]
    finally:
        source.close()


def _partitioned(
    db: TestDatabase, store: InMemoryCheckpointStore, member_id: str, *, deprecated: bool
) -> Any:
    options: dict[str, Any] = {
        "name": "items",
        "source": SqlAlchemySource(
            url=db.url,
            table="items",
            schema=db.schema,
            cursor_column="updated_at",
            pk_columns=["id"],
        ),
        "checkpoint_store": store,
        "partitions": 1,
    }
    if not deprecated:
        return PartitionedPoller(member_id=member_id, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return PollTrigger(owner_id=member_id, **options)


@pytest.mark.parametrize("deprecated", [False, True], ids=["PartitionedPoller", "partitions="])
def test_a_member_gaining_partitions_still_wakes(pg: TestDatabase, deprecated: bool) -> None:
    make_items(pg)
    store = InMemoryCheckpointStore()
    holder = _partitioned(pg, store, "a", deprecated=False)
    holder.tick(lambda events: None)  # another member owns the one partition, heartbeating
    member = _partitioned(pg, store, "b", deprecated=deprecated)
    with Worker(member) as worker:
        assert worker.settled()
        add_item(pg, 1)
        holder.leave()  # the member gains the partition: its own wait ends
        assert wait_until(lambda: worker.seen == [1], BOUND), "gaining partitions was skipped"
