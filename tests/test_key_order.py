"""Per-key order with ``ctx.retry`` (issue 20, item 5).

Key 1 is inserted, updated and deleted in three transactions; the handler asks
to retry the update once. Before the fix it then saw insert, delete, update,
and a replica built with the documented handler resurrected the deleted row:
the window let the delete through while the update waited. Now a pending event
holds back the later events of its key - in later reads until it settles, and
in its own batch by delivering them again after it - on the change log, with
lanes, with fan-out subscribers, on partitions, and on table and memory sources
(where an update supersedes a waiting event instead).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, HandlerError, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install, log_table_name
from dbtrigger.errors import PartialBatchError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.memory import MemorySource
from tests.databases import TestDatabase

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self) -> None:
        self.now += dt.timedelta(minutes=10)  # past any backoff of these tests


@dataclass
class Replica:
    """The replica handler of docs/changes.md, which retries each update of
    the keys in ``busy`` once; ``applied`` is what it applied, in order."""

    busy: set[int] = field(default_factory=set)
    rows: dict[int, str] = field(default_factory=dict)
    applied: list[tuple[str, int, int]] = field(default_factory=list)
    handed: list[tuple[str, int, int]] = field(default_factory=list)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            op, key, seq = op_of(e), int(e.pk["id"]), int(e.cursor)
            self.handed.append((op, key, seq))
            if op == "update" and key in self.busy and ctx.attempts(e) == 1:
                ctx.retry(e, "replica busy")
                continue
            self.applied.append((op, key, seq))
            if op == "delete":
                self.rows.pop(key, None)
            else:
                assert e.after is not None
                self.rows[key] = str(e.after["status"])


def op_of(event: RowChange) -> str:
    """The change's operation: the event's own, or the log row's (a plain
    keyset source over the log table hands out its rows as upserts)."""
    if event.op == "upsert" and event.after is not None and "dbt_op" in event.after:
        return str(event.after["dbt_op"])
    return event.op


def last_deliveries_in_order(applied: list[tuple[str, int, int]]) -> None:
    """Per key, the last time each change was applied comes in source order: a
    replica that applies deliveries as they come ends in the table's state."""
    for key in {k for _, k, _ in applied}:
        last: dict[int, int] = {}
        for n, (_, k, seq) in enumerate(applied):
            if k == key:
                last[seq] = n
        order = [seq for seq, _ in sorted(last.items(), key=lambda item: item[1])]
        assert order == sorted(order), f"key {key}: changes last applied in order {order}"


def make_orders(db: TestDatabase) -> str:
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} "
        "(id INTEGER PRIMARY KEY, status VARCHAR(20) NOT NULL)"
    )
    install(db.engine, "orders", schema=db.schema)
    return db.qualified("orders")


def table_rows(db: TestDatabase, orders: str) -> dict[int, str]:
    with db.engine.connect() as conn:
        return {int(r.id): str(r.status) for r in conn.execute(sa.text(f"SELECT * FROM {orders}"))}


def log_poller(db: TestDatabase, tmp_path: Path, clock: Clock, **kwargs: Any) -> PollTrigger:
    return PollTrigger(
        name="orders-log",
        # MariaDB's horizon is server-wide; other sessions must not hold these tests.
        source=ChangeLogSource(
            url=db.url,
            table="orders",
            schema=db.schema,
            visibility="none" if db.kind == "mariadb" else "auto",
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        retry_delay_seconds=5,
        **kwargs,
    )


def test_a_retried_change_holds_back_the_later_changes_of_its_key_in_later_reads(
    db: TestDatabase, tmp_path: Path
) -> None:
    """Each change in its own tick: the delete is not handed out while the
    update waits; key 2 flows meanwhile."""
    orders = make_orders(db)
    clock = Clock()
    trigger = log_poller(db, tmp_path, clock)
    replica = Replica(busy={1})
    db.execute(f"INSERT INTO {orders} VALUES (1, 'new')")
    trigger.tick(replica)
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 1")
    trigger.tick(replica)  # the update is retried
    db.execute(f"DELETE FROM {orders} WHERE id = 1")
    db.execute(f"INSERT INTO {orders} VALUES (2, 'other')")
    trigger.tick(replica)
    assert [(op, k) for op, k, _ in replica.handed] == [
        ("insert", 1),
        ("update", 1),
        ("insert", 2),  # key 2 flows; the delete of key 1 waits behind the update
    ]
    clock.advance()
    trigger.drain(replica)
    assert [(op, k) for op, k, _ in replica.applied] == [
        ("insert", 1),
        ("insert", 2),
        ("update", 1),
        ("delete", 1),
    ]
    assert replica.rows == table_rows(db, orders) == {2: "other"}
    assert trigger.read_state().window is None  # type: ignore[union-attr]


@pytest.mark.parametrize("lanes", [1, 4])
def test_changes_after_a_retried_one_in_the_same_batch_come_again_after_it(
    db: TestDatabase, tmp_path: Path, lanes: int
) -> None:
    """All three changes in one batch: the handler has seen the delete when it
    retries the update, so the delete is delivered again after the update."""
    orders = make_orders(db)
    for key in (1, 2, 3):
        db.execute(f"INSERT INTO {orders} VALUES ({key}, 'new')")
        db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = {key}")
    db.execute(f"DELETE FROM {orders} WHERE id = 1")
    clock = Clock()
    trigger = log_poller(db, tmp_path, clock, batch_size=20, max_concurrency=lanes)
    replica = Replica(busy={1})
    trigger.tick(replica)
    assert replica.rows.get(1) is None  # it applied the delete after retrying the update
    clock.advance()
    trigger.drain(replica)
    key1 = [(op, seq) for op, k, seq in replica.handed if k == 1]
    ops = [op for op, _ in key1]
    assert ops == ["insert", "update", "delete", "update", "delete"]
    last_deliveries_in_order(replica.applied)
    assert replica.rows == table_rows(db, orders) == {2: "paid", 3: "paid"}


def test_a_failed_batch_does_not_skip_the_later_changes_of_a_retried_key(
    db: TestDatabase, tmp_path: Path
) -> None:
    """The rule holds when the batch fails too: a handler retries the update of
    key 1 and names key 2 as failed. The rows it processed after a row that is
    not settled are remembered as done and skipped on redelivery - except the
    later changes of key 1, which must come again after its update."""
    orders = make_orders(db)
    db.execute(f"INSERT INTO {orders} VALUES (1, 'new')")
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 1")
    db.execute(f"INSERT INTO {orders} VALUES (2, 'other')")
    db.execute(f"DELETE FROM {orders} WHERE id = 1")
    db.execute(f"INSERT INTO {orders} VALUES (3, 'third')")
    replica: dict[int, str] = {}
    calls: list[list[tuple[str, int]]] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        calls.append([(e.op, int(e.pk["id"])) for e in events])
        first = len(calls) == 1
        for e in events:
            key = int(e.pk["id"])
            if first and e.op == "update":
                ctx.retry(e, "replica busy")
            elif first and key == 2:
                pass  # fails: named below
            elif e.op == "delete":
                replica.pop(key, None)
            else:
                assert e.after is not None
                replica[key] = str(e.after["status"])
        if first:
            raise PartialBatchError([{"id": 2}])

    trigger = log_poller(db, tmp_path, Clock(), batch_size=20)
    with pytest.raises(HandlerError):
        trigger.tick(handler)
    trigger.drain(handler)
    assert calls == [
        [("insert", 1), ("update", 1), ("insert", 2), ("delete", 1), ("insert", 3)],
        # insert 3 was done and is skipped; delete 1 comes again after update 1
        [("update", 1), ("insert", 2), ("delete", 1)],
    ]
    assert replica == table_rows(db, orders) == {2: "other", 3: "third"}


def test_fan_out_holds_a_key_back_for_the_subscriber_that_retried_only(
    db: TestDatabase, tmp_path: Path
) -> None:
    orders = make_orders(db)
    db.execute(f"INSERT INTO {orders} VALUES (1, 'new')")
    db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 1")
    db.execute(f"DELETE FROM {orders} WHERE id = 1")
    db.execute(f"INSERT INTO {orders} VALUES (2, 'other')")
    clock = Clock()
    replica, audit = Replica(busy={1}), Replica()
    trigger = log_poller(
        db,
        tmp_path,
        clock,
        batch_size=20,
        subscribers={"replica": replica, "audit": audit},
    )
    trigger.tick()
    # Later changes of key 1 wait in the source while the update waits.
    db.execute(f"INSERT INTO {orders} VALUES (1, 'back')")
    trigger.tick()
    assert [(op, k) for op, k, _ in replica.handed] == [
        ("insert", 1),
        ("update", 1),
        ("delete", 1),
        ("insert", 2),
    ]
    clock.advance()
    trigger.drain()
    assert [(op, k) for op, k, _ in replica.handed][4:] == [
        ("update", 1),
        ("delete", 1),
        ("insert", 1),
    ]
    # The subscriber that accepted everything saw each change once, in order.
    assert [(op, k) for op, k, _ in audit.handed] == [
        ("insert", 1),
        ("update", 1),
        ("delete", 1),
        ("insert", 2),
        ("insert", 1),
    ]
    last_deliveries_in_order(replica.applied)
    assert replica.rows == audit.rows == table_rows(db, orders) == {1: "back", 2: "other"}
    assert trigger.read_state().window is None  # type: ignore[union-attr]


def test_a_held_change_is_not_handed_again_to_a_subscriber_that_accepted_it(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """PostgreSQL change log, two subscribers, default settings. "a" retries the
    update of key 1 twice; "b" retries the delete once. The delete waits behind
    the update (for "a"), owed to "b" too. In the second batch "b" accepts the
    delete while "a" retries the update again: the delete is still held for
    "a" - but not for "b", which has it (before, the held entry kept "b" as
    owing it and "b" was handed the delete a third time: a duplicate)."""
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'new')")
    pg.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = 1")
    pg.execute(f"DELETE FROM {orders} WHERE id = 1")
    handed: dict[str, list[tuple[str, int]]] = {"a": [], "b": []}

    def subscriber(name: str, op: str, tries: int) -> Callable[..., None]:
        def handle(events: list[RowChange], ctx: BatchContext) -> None:
            for e in events:
                handed[name].append((op_of(e), int(e.pk["id"])))
                if op_of(e) == op and ctx.attempts(e) <= tries:
                    ctx.retry(e, f"{name} busy")

        return handle

    clock = Clock()
    trigger = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=pg.url, table="orders", schema=pg.schema),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        subscribers={"a": subscriber("a", "update", 2), "b": subscriber("b", "delete", 1)},
    )
    trigger.tick()
    clock.advance()
    trigger.tick()
    assert handed["b"] == [("insert", 1), ("update", 1), ("delete", 1), ("delete", 1)]
    clock.advance()
    trigger.drain()
    assert handed["a"] == [
        ("insert", 1),
        ("update", 1),
        ("delete", 1),
        ("update", 1),
        ("delete", 1),
        ("update", 1),
        ("delete", 1),
    ]
    # "b" failed the delete once and accepted it once: it is not handed it again.
    assert handed["b"] == [("insert", 1), ("update", 1), ("delete", 1), ("delete", 1)]
    assert trigger.read_state().window is None  # type: ignore[union-attr]


def test_partitions_keep_the_order_of_a_key(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """A partitioned keyset poller over the log table itself (several rows per key)."""
    orders = make_orders(sqlite_db)
    for key in range(1, 9):
        sqlite_db.execute(f"INSERT INTO {orders} VALUES ({key}, 'new')")
        sqlite_db.execute(f"UPDATE {orders} SET status = 'paid' WHERE id = {key}")
        sqlite_db.execute(f"DELETE FROM {orders} WHERE id = {key}")
    clock = Clock()
    trigger = PartitionedPoller(
        name="orders-log",
        source=SqlAlchemySource(
            url=sqlite_db.url,
            table=log_table_name("orders"),
            cursor_column="dbt_seq",
            pk_columns=["id"],
            visibility="none",
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        partitions=4,
        batch_size=5,
        retry_delay_seconds=5,
    )
    replica = LogReplica(busy=set(range(1, 9)))
    with pytest.raises(HandlerError, match="wait for a retry"):  # not done: retries wait
        trigger.drain(replica, retry_wait_seconds=0)
    clock.advance()
    trigger.drain(replica)
    last_deliveries_in_order(replica.applied)
    assert replica.rows == {}


@dataclass
class LogReplica(Replica):
    """The replica over raw log rows: the image is the JSON in ``dbt_after``."""

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            op, key, seq = op_of(e), int(e.pk["id"]), int(e.cursor)
            self.handed.append((op, key, seq))
            if op == "update" and key in self.busy and ctx.attempts(e) == 1:
                ctx.retry(e, "replica busy")
                continue
            self.applied.append((op, key, seq))
            if op == "delete":
                self.rows.pop(key, None)
            else:
                self.rows[key] = "present"


# --- table and memory sources: an update supersedes a waiting event ---------------------


def versions_table(db: TestDatabase) -> sa.Table:
    table = sa.Table(
        "items",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        schema=db.schema,
    )
    table.create(db.engine)
    return table


def superseded(
    trigger: PollTrigger, clock: Clock, put: Callable[[int, int, str], None]
) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            seen.append((int(e.pk["id"]), int(e.cursor)))
            if int(e.pk["id"]) == 1 and int(e.cursor) == 10:
                ctx.retry(e, "busy")

    for key in range(1, 6):
        put(key, 10 * key, "new")
    trigger.tick(handler)  # key 1 at version 10 waits for a retry
    put(1, 60, "paid")  # ... and is updated meanwhile: version 10 is gone
    trigger.tick(handler)
    clock.advance()
    trigger.drain(handler)
    return seen


def test_on_a_table_an_update_supersedes_the_waiting_event(
    db: TestDatabase, tmp_path: Path
) -> None:
    """A table holds one row per key: the waiting state no longer exists, and
    the row's new state is delivered; the old one never comes after it."""
    table = versions_table(db)
    clock = Clock()
    trigger = PollTrigger(
        name="items",
        source=SqlAlchemySource(
            url=db.url,
            table="items",
            schema=db.schema,
            cursor_column="version",
            pk_columns=["id"],
            visibility="none",
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        retry_delay_seconds=5,
    )

    def put(key: int, version: int, status: str) -> None:
        with db.engine.begin() as conn:
            if conn.execute(sa.select(table.c.id).where(table.c.id == key)).first():
                conn.execute(
                    table.update().where(table.c.id == key).values(version=version, status=status)
                )
            else:
                conn.execute(table.insert().values(id=key, version=version, status=status))

    seen = superseded(trigger, clock, put)
    assert [v for k, v in seen if k == 1] == [10, 60]
    assert trigger.read_state().window is None  # type: ignore[union-attr]


def test_on_a_memory_source_an_update_supersedes_the_waiting_event(tmp_path: Path) -> None:
    rows = MemorySource(cursor_column="version", pk_columns=["id"])
    clock = Clock()
    trigger = PollTrigger(
        name="items",
        source=rows,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        retry_delay_seconds=5,
    )
    seen = superseded(
        trigger, clock, lambda k, v, s: rows.put({"id": k, "version": v, "status": s})
    )
    assert [v for k, v in seen if k == 1] == [10, 60]
    assert trigger.read_state().window is None  # type: ignore[union-attr]


def test_the_per_key_order_example_in_the_docs_runs_as_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()
    section = text.split("## Per-key order", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "reliability.md", "exec"), {})  # noqa: S102 - our own docs
    out = capsys.readouterr().out.splitlines()
    assert out == ["['insert', 'update', 'delete', 'update', 'delete']", "{}"]


def test_fan_out_on_a_table_an_update_supersedes_the_waiting_event_per_subscriber(
    db: TestDatabase, tmp_path: Path
) -> None:
    """Default settings, two subscribers: search retries key 1 at version 10,
    billing accepted it; the row is updated meanwhile, and search retries the
    new state once more. Each subscriber sees each key's states in order, the
    old state never after the new one, billing never twice, and nothing is left
    waiting."""
    table = versions_table(db)
    clock = Clock()
    seen: dict[str, list[tuple[int, int]]] = {"billing": [], "search": []}

    def billing(events: list[RowChange]) -> None:
        seen["billing"].extend((int(e.pk["id"]), int(e.cursor)) for e in events)

    def search(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            seen["search"].append((int(e.pk["id"]), int(e.cursor)))
            if int(e.pk["id"]) == 1 and seen["search"].count((1, int(e.cursor))) == 1:
                ctx.retry(e, "index busy")  # each state of key 1, the first time

    trigger = PollTrigger(
        name="items",
        source=SqlAlchemySource(
            url=db.url, table="items", schema=db.schema, cursor_column="version", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        subscribers={"billing": billing, "search": search},
        clock=clock,
    )
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(), [{"id": k, "version": 10 * k, "status": "new"} for k in range(1, 6)]
        )
    assert trigger.tick() == 5
    with db.engine.begin() as conn:  # key 1's waiting state is gone
        conn.execute(table.update().where(table.c.id == 1).values(version=60, status="paid"))
    for _ in range(4):
        clock.advance()
        trigger.tick()
    assert [v for k, v in seen["billing"] if k == 1] == [10, 60]
    assert [v for k, v in seen["search"] if k == 1] == [10, 60, 60]
    for name, changes in seen.items():
        assert sorted({k for k, _ in changes}) == [1, 2, 3, 4, 5], name
    state = trigger.read_state()
    assert state is not None
    assert state.window is None
    assert state.position.cursor == 60
