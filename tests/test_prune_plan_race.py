"""A prune deletes what its plan counted, however long the plan took and whoever
registered meanwhile: the dry run and the real run agree, and the delete never
passes the slowest registered reader.

The plan and the delete run in separate transactions (``changelog prune`` shows
the plan, then deletes). Between them time passes (the age cutoff must not move
with it: ``dbt_changed_at`` need not follow ``dbt_seq`` when transactions
overlap) and a reader may register (its unread rows must stay).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger.changelog import install, log_table_name, operations, prune
from dbtrigger.changelog.readers import record
from tests.databases import TestDatabase

DEADLINE = 30.0


def _orders(db: TestDatabase, rows: int) -> sa.Table:
    db.execute(f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, note TEXT)")
    install(db.engine, "orders", schema=db.schema)
    for i in range(1, rows + 1):
        db.execute(f"INSERT INTO {db.qualified('orders')} (id, note) VALUES ({i}, 'n')")
    return sa.Table(
        log_table_name("orders"), sa.MetaData(), autoload_with=db.engine, schema=db.schema
    )


def _after_the_plan(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> None:
    """Run ``then`` between prune's plan and its delete (what a slow plan lets happen)."""
    planned = operations.plan_prune

    def plan_then(*args: object, **kwargs: object) -> operations.PrunePlan:
        plan = planned(*args, **kwargs)  # type: ignore[arg-type]
        then()
        return plan

    monkeypatch.setattr(operations, "plan_prune", plan_then)


def test_the_delete_uses_the_plans_age_cutoff(
    db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _orders(db, 4)
    older = dt.timedelta(hours=1)
    now = dt.datetime.now(dt.timezone.utc)
    # Sequence order is not time order: the first row's transaction began last.
    soon = now - older + dt.timedelta(milliseconds=600)
    with db.engine.begin() as conn:
        conn.execute(
            sa.update(log).values(dbt_changed_at=operations._db_time(db.engine, now - 2 * older))
        )
        first = conn.execute(sa.select(sa.func.min(log.c.dbt_seq))).scalar_one()
        conn.execute(
            sa.update(log)
            .where(log.c.dbt_seq == first)
            .values(dbt_changed_at=operations._db_time(db.engine, soon))
        )

    def time_passes() -> None:  # the plan took a while: the first row is now old enough too
        deadline = time.monotonic() + DEADLINE
        while dt.datetime.now(dt.timezone.utc) - older <= soon + dt.timedelta(milliseconds=5):
            assert time.monotonic() < deadline
            time.sleep(0.05)

    plan = operations.plan_prune(db.engine, "orders", schema=db.schema, older_than=older)
    assert plan.rows == 3
    _after_the_plan(monkeypatch, time_passes)
    assert prune(db.engine, "orders", schema=db.schema, older_than=older) == 3
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(log.c.dbt_seq)).scalars().all() == [first]


def test_the_delete_never_passes_a_reader_registered_after_the_plan(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _orders(db, 5)
    with db.engine.connect() as conn:
        seqs = conn.execute(sa.select(log.c.dbt_seq).order_by(log.c.dbt_seq)).scalars().all()
    with db.engine.begin() as conn:
        record(conn, "orders", db.schema, "fast", seqs[-1])

    def a_reader_registers() -> None:  # a second poller starts, having read two rows
        with db.engine.begin() as conn:
            record(conn, "orders", db.schema, "late", seqs[1])

    _after_the_plan(monkeypatch, a_reader_registers)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    deleted = prune(db.engine, "orders", schema=db.schema, older_than=dt.timedelta(0), now=later)
    with db.engine.connect() as conn:
        left = conn.execute(sa.select(log.c.dbt_seq).order_by(log.c.dbt_seq)).scalars().all()
    assert (deleted, left) == (2, seqs[2:])


def test_a_row_committed_below_the_plans_top_after_it_is_not_deleted_on_top(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction that took its sequence number before the plan and committed after
    it (no reader registered to wait for it): the delete takes no more rows than the
    plan counted."""
    log = _orders(db, 5)
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(log).order_by(log.c.dbt_seq)).mappings().all()
    late = dict(rows[1])
    with db.engine.begin() as conn:  # not committed yet when the plan runs
        conn.execute(sa.delete(log).where(log.c.dbt_seq == late["dbt_seq"]))

    def it_commits() -> None:
        with db.engine.begin() as conn:
            conn.execute(sa.insert(log).values(late))

    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    plan = operations.plan_prune(
        db.engine, "orders", schema=db.schema, older_than=dt.timedelta(0), now=later
    )
    assert plan.rows == 4
    _after_the_plan(monkeypatch, it_commits)
    deleted = prune(db.engine, "orders", schema=db.schema, older_than=dt.timedelta(0), now=later)
    with db.engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(log)).scalar_one()
    assert (deleted, left) == (4, 1)
