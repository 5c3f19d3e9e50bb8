"""The embedded demo: a live SQLite ``orders`` table polled into the terminal.

A writer thread keeps inserting and updating orders; a :class:`Runner` polls
them with a local file state store and prints every batch and the checkpoint
it commits. Stop it with Ctrl-C: the batch in flight is finished and
committed, the lease released. Run it again and it resumes from the checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import random
import threading
from pathlib import Path
from typing import TextIO

import sqlalchemy as sa

from dbtrigger.errors import DbTriggerError
from dbtrigger.events import RowChange
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.runner import Runner, RunStats
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.sources.visibility import SafetyWindow
from dbtrigger.state.stores.file import FileCheckpointStore

STATUSES = ("new", "paid", "packed", "shipped", "delivered")


def rows_text(count: int) -> str:
    """``  1 row `` / `` 10 rows``: a batch's size, aligned down the demo's output."""
    return f"{count:3d} row{'s' if count != 1 else ' '}"


def create_orders_table(engine: sa.Engine) -> sa.Table:
    metadata = sa.MetaData()
    orders = sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("customer", sa.String(40), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("total", sa.Numeric(12, 2), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
        sa.Index("ix_orders_updated_at_id", "updated_at", "id"),
    )
    metadata.create_all(engine)
    return orders


class OrderWriter(threading.Thread):
    """Inserts new orders and moves existing ones along, a few per second."""

    def __init__(self, engine: sa.Engine, orders: sa.Table, rate: float, seed: int | None) -> None:
        super().__init__(name="demo-writer", daemon=True)
        self.engine = engine
        self.orders = orders
        self.rate = rate
        self.random = random.Random(seed)  # noqa: S311 - demo data, not security
        self.stop_event = threading.Event()
        self.inserted = 0
        self.updated = 0

    def run(self) -> None:
        while not self.stop_event.wait(1.0 / self.rate):
            now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
            with self.engine.begin() as conn:
                max_id = conn.execute(sa.select(sa.func.max(self.orders.c.id))).scalar() or 0
                if max_id and self.random.random() < 0.35:
                    target = self.random.randint(1, max_id)
                    conn.execute(
                        self.orders.update()
                        .where(self.orders.c.id == target)
                        .values(status=self.random.choice(STATUSES[1:]), updated_at=now)
                    )
                    self.updated += 1
                else:
                    conn.execute(
                        self.orders.insert().values(
                            customer=f"customer-{self.random.randint(1, 50):02d}",
                            status="new",
                            total=round(self.random.uniform(5, 500), 2),
                            created_at=now,
                            updated_at=now,
                        )
                    )
                    self.inserted += 1


def run_demo(
    directory: Path,
    *,
    rate: float = 8.0,
    interval: float = 1.0,
    batch_size: int = 10,
    duration: float | None = None,
    seed: int | None = None,
    out: TextIO,
) -> RunStats:
    directory.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{directory / 'orders.db'}"
    engine = sa.create_engine(url)
    orders = create_orders_table(engine)
    # One writer thread, so no transaction can commit out of order here; a
    # 1-second safety window (instead of the default 5) keeps the demo lively
    # while still showing the guard at work.
    source = SqlAlchemySource(
        url=url,
        table="orders",
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility=SafetyWindow(1.0),
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(directory / "state"),
        batch_size=batch_size,
        max_batches_per_tick=5,
        lease_ttl_seconds=30,
    )

    def handle(events: list[RowChange], ctx: BatchContext) -> None:
        new = sum(1 for e in events if e.after and e.after["status"] == "new")
        ids = ", ".join(str(e.pk["id"]) for e in events[:8]) + (" ..." if len(events) > 8 else "")
        after = ctx.checkpoint_after
        print(
            f"{ctx.batch_id}  {rows_text(len(events))} ({new} new, {len(events) - new} updated)"
            f"  ids [{ids}]\n    checkpoint -> updated_at={after.cursor} id={after.pk['id']}"
            f"  (token {ctx.fencing_token})",
            file=out,
            flush=True,
        )

    writer = OrderWriter(engine, orders, rate, seed)
    runner = Runner(trigger, handle, interval_seconds=interval)
    state = trigger.read_state()
    where = (
        f"resuming after updated_at={state.position.cursor} id={state.position.pk.get('id')}"
        if state and state.checkpoint
        else "starting from the beginning"
    )
    print(
        f"dbtrigger demo: SQLite {directory / 'orders.db'}, state in {directory / 'state'}\n"
        f"  writer: ~{rate:g} changes/s; poller 'orders': batch {batch_size}, every {interval:g}s;"
        f" {where}\n  Ctrl-C stops (the batch in flight is committed first).",
        file=out,
        flush=True,
    )
    writer.start()
    timer = None
    if duration is not None:
        timer = threading.Timer(duration, runner.stop)
        timer.daemon = True
        timer.start()
    behind: int | None = None
    try:
        stats = runner.run()
    finally:
        writer.stop_event.set()
        writer.join(timeout=5)
        if timer is not None:
            timer.cancel()
        with contextlib.suppress(DbTriggerError):
            behind = trigger.rows_behind()
        source.close()
        engine.dispose()
    # Fewer rows delivered than changes made is no loss: the last second's changes wait
    # behind the safety window, and several updates of one row are delivered as one.
    waiting = (
        f"; {behind} row(s) wait after the checkpoint: run it again to resume"
        if behind
        else "; every change delivered"
    )
    print(
        f"stopped: {stats.rows} rows delivered in {stats.ticks} ticks;"
        f" writer made {writer.inserted} inserts and {writer.updated} updates{waiting}",
        file=out,
        flush=True,
    )
    return stats
