"""Shared helpers for the reliability and failure-scenario tests.

A small ``items`` table with an integer version cursor (portable across
SQLite, PostgreSQL and MariaDB), a trigger factory, a recording handler, and
a way to play "another instance" against the same state document.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from dbtrigger import PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from tests.databases import TestDatabase

#: Retries without waiting, so failure tests stay fast and deterministic.
NO_WAIT = RetryPolicy(attempts=3, sleep=lambda _: None)


def items_table(db: TestDatabase, name: str = "items") -> sa.Table:
    table = sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.String(200), nullable=False),
        sa.Column("amount", sa.Numeric(12, 2), nullable=True),
        sa.Column("seen_at", sa.DateTime, nullable=True),
        sa.Index(f"ix_{name}_version_id", "version", "id"),
        schema=db.schema,
    )
    table.create(db.engine)
    return table


def add_items(db: TestDatabase, table: sa.Table, ids: Sequence[int], *, payload: str = "p") -> None:
    """Insert rows ``id`` with version ``id * 10`` (gaps leave room for updates)."""
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [
                {
                    "id": i,
                    "version": i * 10,
                    "payload": f"{payload}{i}",
                    "amount": f"{i}.25",
                    "seen_at": dt.datetime(2026, 1, 1, 12, 0, i % 60),
                }
                for i in ids
            ],
        )


def bump(db: TestDatabase, table: sa.Table, item_id: int, version: int) -> None:
    """Update a row so its cursor moves to ``version``."""
    with db.engine.begin() as conn:
        conn.execute(table.update().where(table.c.id == item_id).values(version=version))


def items_source(db: TestDatabase, table: str = "items") -> SqlAlchemySource:
    """The ``items`` source. These tests write before they poll, so rows are
    visible in cursor order and no visibility guard is needed; switching it off
    also keeps unrelated sessions on a shared PostgreSQL server from holding
    ticks back (the guard is tested where it belongs)."""
    return SqlAlchemySource(
        url=db.url,
        table=table,
        schema=db.schema,
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",
    )


def make_trigger(
    source: Any, store: CheckpointStore, *, name: str = "items", **kwargs: Any
) -> PollTrigger:
    kwargs.setdefault("retry", NO_WAIT)
    kwargs.setdefault("batch_size", 10)
    return PollTrigger(name=name, source=source, checkpoint_store=store, **kwargs)


@dataclass
class Recorder:
    """A handler that records every delivery: (batch_id, token, [ids])."""

    deliveries: list[tuple[str, int, list[int]]] = field(default_factory=list)
    event_ids: list[list[str]] = field(default_factory=list)
    fail_on: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        ids = [int(e.pk["id"]) for e in events]
        with self.lock:
            self.deliveries.append((ctx.batch_id, ctx.fencing_token, ids))
            self.event_ids.append([e.event_id for e in events])
        bad = self.fail_on.intersection(ids)
        if bad:
            raise ValueError(f"cannot process item(s) {sorted(bad)}")

    @property
    def ids(self) -> list[int]:
        return [i for _, _, ids in self.deliveries for i in ids]

    @property
    def calls(self) -> int:
        return len(self.deliveries)


def read_doc(store: CheckpointStore, name: str = "items") -> StateDocument:
    stored = store.read(name)
    assert stored is not None, "no state document"
    return docmod.loads(stored.data)


def checkpoint_id(store: CheckpointStore, name: str = "items") -> int | None:
    doc = read_doc(store, name)
    return None if doc.checkpoint is None else int(doc.position.pk["id"])


def steal_lease(
    store: CheckpointStore,
    name: str = "items",
    *,
    owner: str = "thief",
    ttl: float = 600,
    after: dt.timedelta = dt.timedelta(hours=1),
) -> int:
    """Act as another instance that took the lease over (as if the holder's had
    expired): returns the new fencing token."""
    stored = store.read(name)
    assert stored is not None
    doc = docmod.loads(stored.data)
    decision = leasemod.decide_acquire(
        doc,
        poller=name,
        fingerprint=doc.source_fingerprint,
        owner=owner,
        now=dt.datetime.now(dt.timezone.utc) + after,
        ttl=dt.timedelta(seconds=ttl),
    )
    assert isinstance(decision, leasemod.Acquired), decision
    store.write(name, docmod.dumps(decision.document), if_match=stored.etag)
    return decision.fencing_token


def release_all(store: CheckpointStore, name: str = "items") -> None:
    """Release whatever lease the document holds (an operator's release-lease)."""
    stored = store.read(name)
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.lease is not None
    released = leasemod.decide_release(
        doc,
        owner=doc.lease.owner_id,
        token=doc.lease.fencing_token,
        now=dt.datetime.now(dt.timezone.utc),
    )
    if released is not None:
        store.write(name, docmod.dumps(released), if_match=stored.etag)


class Clock:
    """A settable clock for ``PollTrigger(clock=...)``: lease expiry without waiting."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self.now = start or dt.datetime.now(dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def commit_writes(store: CheckpointStore) -> Callable[[Any], bool]:
    """FaultPlan ``match`` for writes that move the checkpoint stored in ``store``
    (the wrapped store: the predicate looks at what is there before the write)."""

    def match(call: Any) -> bool:
        new = call.document
        if new is None or new.checkpoint is None:
            return False
        stored = store.read(call.key)
        old = docmod.loads(stored.data) if stored is not None else None
        return old is None or old.checkpoint is None or old.position != new.position

    return match


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while not predicate():
            if deadline.wait(0.01):
                raise AssertionError("condition not reached in time")
    finally:
        timer.cancel()
