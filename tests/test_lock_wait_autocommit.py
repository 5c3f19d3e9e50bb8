"""Writes on an engine in autocommit mode are one bounded transaction, on every database.

An engine made with ``isolation_level="AUTOCOMMIT"`` (a user's shared one, or
``engine_kwargs=``) begins no transaction: each statement commits on its own. The
lock bound is ``SET LOCAL lock_timeout`` on PostgreSQL, which outside a
transaction block lasts one statement, so a write behind another session's lock
waited for ever there; and on every database a ``with writer.transaction():``
block, or a batch's rows, were no longer one transaction (a failure half-way left
the first writes committed). The writers now take their connection out of
autocommit for the write (set back when it returns to the pool). A thread runs
the write; the test waits for its outcome with a bound and ends the holder's
transaction in any case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import SqlCheckpointStore
from dbtrigger.dbio import DbWriter
from dbtrigger.errors import OutputConstraintError, OutputLockTimeoutError, StoreUnavailableError
from dbtrigger.output import OutputTarget
from tests.databases import TestDatabase
from tests.test_output_locks import GIVE_UP_WITHIN, outcome_of


@pytest.fixture
def autocommit(db: TestDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db.url, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def gives_up(release: Callable[[], None], call: Callable[[], Any]) -> BaseException:
    thread, outcome, _ = outcome_of(call)
    thread.join(GIVE_UP_WITHIN)
    alive = thread.is_alive()
    release()
    thread.join(60)
    assert not alive, f"the write still waited for the lock after {GIVE_UP_WITHIN} s"
    [error] = outcome
    assert isinstance(error, BaseException), error
    return error


def test_an_output_write_on_an_autocommit_engine_gives_up(
    db: TestDatabase, autocommit: sa.Engine
) -> None:
    db.execute(f"CREATE TABLE {db.qualified('ac_sink')} (id INTEGER PRIMARY KEY, v INTEGER)")
    db.execute(f"INSERT INTO {db.qualified('ac_sink')} VALUES (1, 0)")
    holder = db.engine.connect()
    holder.begin()
    holder.exec_driver_sql(f"UPDATE {db.qualified('ac_sink')} SET v = 9 WHERE id = 1")

    def release() -> None:
        if not holder.closed:
            holder.rollback()
            holder.close()

    target = OutputTarget(
        engine=autocommit,
        table="ac_sink",
        schema=db.schema,
        action="upsert",
        conflict_columns=["id"],
        lock_timeout_seconds=1,
    )
    error = gives_up(release, lambda: target.write([{"id": 2, "v": 2}, {"id": 1, "v": 1}]))
    assert isinstance(error, OutputLockTimeoutError), repr(error)
    with db.engine.connect() as conn:  # nothing of the write landed
        got = conn.exec_driver_sql(f"SELECT id, v FROM {db.qualified('ac_sink')}").fetchall()
    assert [tuple(r) for r in got] == [(1, 0)]
    with autocommit.connect() as conn:  # the shared engine is in autocommit still
        conn.exec_driver_sql(f"INSERT INTO {db.qualified('ac_sink')} VALUES (3, 3)")
    with db.engine.connect() as conn:
        got = conn.exec_driver_sql(f"SELECT id, v FROM {db.qualified('ac_sink')} WHERE id = 3")
        assert [tuple(r) for r in got] == [(3, 3)]


def test_a_writer_transaction_on_an_autocommit_engine_is_one_transaction(
    db: TestDatabase, autocommit: sa.Engine
) -> None:
    db.execute(f"CREATE TABLE {db.qualified('ac_tx')} (id INTEGER PRIMARY KEY, v INTEGER)")
    writer = DbWriter(engine=autocommit, table="ac_tx", schema=db.schema)

    def block() -> None:
        with writer.transaction() as tx:
            tx.insert(data={"id": 5, "v": 1})
            tx.insert(data={"id": 5, "v": 2})

    with pytest.raises(OutputConstraintError):
        block()
    with db.engine.connect() as conn:
        got = conn.exec_driver_sql(f"SELECT id FROM {db.qualified('ac_tx')}").fetchall()
    assert got == [], "the block's first insert stayed although the block failed"


def test_a_state_write_on_an_autocommit_engine_gives_up(
    db: TestDatabase, autocommit: sa.Engine
) -> None:
    store = SqlCheckpointStore(
        engine=autocommit, table="ac_state", schema=db.schema, lock_timeout_seconds=1
    )
    etag = store.write("p", b'{"v": 1}', if_match=None)
    holder = db.engine.connect()
    holder.begin()
    holder.exec_driver_sql(f"UPDATE {db.qualified('ac_state')} SET etag = etag")

    def release() -> None:
        if not holder.closed:
            holder.rollback()
            holder.close()

    error = gives_up(release, lambda: store.write("p", b'{"v": 2}', if_match=etag))
    assert isinstance(error, StoreUnavailableError), repr(error)
    assert "gave up" in str(error), error
    got = store.read("p")
    assert got is not None
    assert got.data == b'{"v": 1}'
