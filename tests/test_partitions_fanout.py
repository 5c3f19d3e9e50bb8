"""Fan-out on a partitioned poller: every partition delivers to every subscriber and
settles its own window."""

from __future__ import annotations

import datetime as dt
import sys
import threading
import types
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError, HandlerError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.state.window import Window
from tests.databases import TestDatabase


class WallClock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now


def make_table(db: TestDatabase, rows: int) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (:id, :id)"),
            [{"id": i} for i in range(1, rows + 1)],
        )


def source(db: TestDatabase) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url, table="orders", schema=db.schema, cursor_column="seq", pk_columns=["id"]
    )


def window(poller: PartitionedPoller, pid: str) -> Window:
    state = poller.trigger(pid).read_state()
    assert state is not None
    return state.window or Window()


def test_each_partition_fans_out_and_settles_its_own_window(sqlite_db: TestDatabase) -> None:
    make_table(sqlite_db, 200)
    seen: dict[str, Counter[int]] = {"audit": Counter(), "mail": Counter()}
    retried: list[int] = []

    def audit(events: list[RowChange]) -> None:
        seen["audit"].update(e.pk["id"] for e in events)

    def mail(events: list[RowChange], ctx: Any) -> None:
        seen["mail"].update(e.pk["id"] for e in events)
        if not retried:  # the first event mail sees waits for a retry, for mail only
            retried.append(events[0].pk["id"])
            ctx.retry(events[0], "smtp busy")  # on the poller's backoff: 60 s here

    clock = WallClock()
    store = InMemoryCheckpointStore()
    poller = PartitionedPoller(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=store,
        partitions=4,
        join_window_seconds=0,
        background=False,
        clock=clock,
        batch_size=25,
        retry_delay_seconds=60,
        retry_delay_max_seconds=60,
        subscribers={"audit": audit, "mail": mail},
    )
    # The retry is due a minute on: the drain does not call that done (it raised
    # after delivering every row once; it waits for a retry due within its budget).
    with pytest.raises(HandlerError, match="1 event\\(s\\) wait for a retry") as raised:
        poller.drain(retry_wait_seconds=0)
    assert raised.value.fields["rows"] == 200
    assert seen["audit"] == Counter(range(1, 201))
    assert seen["mail"] == Counter(range(1, 201))
    (key,) = retried
    windows = {pid: window(poller, pid) for pid in poller.owned}
    waiting = {pid: len(w.pending) for pid, w in windows.items()}
    assert sorted(waiting.values()) == [0, 0, 0, 1]  # only the retried event's partition
    clock.now += dt.timedelta(seconds=120)  # past the backoff and its jitter
    poller.drain()
    assert seen["mail"][key] == 2  # delivered again to mail
    assert seen["audit"][key] == 1  # and not to audit, which had accepted it
    assert all(not window(poller, pid).pending for pid in poller.owned)


def test_a_fan_out_member_takes_no_handler(sqlite_db: TestDatabase) -> None:
    poller = PartitionedPoller(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=InMemoryCheckpointStore(),
        subscribers={"a": lambda events: None},
    )
    with pytest.raises(ConfigurationError, match="its handlers are the subscribers"):
        poller.handler(lambda events: None)
    with pytest.raises(ConfigurationError, match="ack_timeout_seconds applies to subscribers"):
        PartitionedPoller(
            name="orders",
            source=source(sqlite_db),
            checkpoint_store=InMemoryCheckpointStore(),
            ack_timeout_seconds=5,
        )


def test_poll_trigger_with_partitions_and_subscribers_runs_under_the_cli(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before (``subscribers= cannot be combined with partitions=``)."""
    make_table(sqlite_db, 60)
    got: Counter[str] = Counter()
    trigger = PartitionedPoller(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=InMemoryCheckpointStore(),
        partitions=2,
        batch_size=10,
        max_batches_per_tick=10,
        subscribers={
            "a": lambda events: got.update(["a"] * len(events)),
            "b": lambda events: got.update(["b"] * len(events)),
        },
    )
    module = f"fanout_parts_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    assert main(["run", f"{module}:trigger", "--max-ticks", "2", "--interval", "0"]) == 0
    assert got == {"a": 60, "b": 60}


def test_a_subscriber_hung_in_one_partition_is_busy_in_every_partition(
    sqlite_db: TestDatabase,
) -> None:
    """A hung synchronous subscriber was called again, and waited for its whole
    ack timeout, in each partition the member ticks: one more hung thread and one
    more ack timeout (300 s by default) per partition before the round ended.
    It is now busy for the whole member once one call outlived its timeout:
    called once, the other partitions' events wait for it, and it gets them all
    once that call returns."""
    make_table(sqlite_db, 40)
    release = threading.Event()
    calls: list[int] = []
    hung_got: list[int] = []
    audit_got: list[int] = []

    def hung(events: list[RowChange]) -> None:
        calls.append(len(events))
        if len(calls) == 1:
            release.wait(30)  # (bounded; released below)
        else:
            hung_got.extend(int(e.pk["id"]) for e in events)

    def audit(events: list[RowChange]) -> None:
        audit_got.extend(int(e.pk["id"]) for e in events)

    poller = PartitionedPoller(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=InMemoryCheckpointStore(),
        partitions=4,
        join_window_seconds=0,
        background=False,
        retry_delay_seconds=0,
        subscribers={"audit": audit, "hung": hung},
        ack_timeout_seconds=0.3,
    )
    try:
        poller.tick_result()
        assert sorted(audit_got) == list(range(1, 41))
        assert len(calls) == 1  # not once a partition
    finally:
        release.set()
    for _ in range(200):  # until the released call has ended and every partition handed over
        poller.tick_result()
        if sorted(set(hung_got)) == list(range(1, 41)):
            break
    assert sorted(set(hung_got)) == list(range(1, 41))
    assert sorted(audit_got) == list(range(1, 41))  # never twice to audit
    poller.leave()
    poller.close()


def test_under_a_timer_every_partitions_default_ack_timeout_is_cut(
    sqlite_db: TestDatabase,
) -> None:
    """``run(timer=...)`` on a partitioned poller cuts a default ack timeout in
    every partition, as a poller's run does (a Functions invocation is ended at
    functionTimeout); one given is kept."""
    from dbtrigger.runtime.subscriber_options import TIMER_ACK_TIMEOUT  # noqa: PLC0415

    make_table(sqlite_db, 8)

    def timeouts(poller: PartitionedPoller) -> set[float]:
        return {
            poller.trigger(pid)._driver.reader.delivery.ack_timeout  # type: ignore[attr-defined]
            for pid in poller.owned
        }

    def make(**options: Any) -> PartitionedPoller:
        return PartitionedPoller(
            name="orders",
            source=source(sqlite_db),
            checkpoint_store=InMemoryCheckpointStore(),
            partitions=4,
            join_window_seconds=0,
            background=False,
            subscribers={"audit": lambda events: None},
            **options,
        )

    poller = make()
    assert poller.run(timer=object()) == 8
    assert timeouts(poller) == {TIMER_ACK_TIMEOUT}
    given = make(ack_timeout_seconds=300)
    given.run(timer=object())
    assert timeouts(given) == {300}
    for each in (poller, given):
        each.leave()
        each.close()
