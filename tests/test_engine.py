"""LazyEngine: created once on first use, shared engines are never disposed by an adapter."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger._engine import LazyEngine, TableOnce
from dbtrigger.output import OutputTarget
from dbtrigger.quarantine import SqlQuarantineSink
from dbtrigger.state.stores.sql import SqlCheckpointStore
from tests.databases import TestDatabase


def _sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'lazy.db'}"


def test_engine_is_created_on_first_use_and_only_once(tmp_path: Path) -> None:
    lazy = LazyEngine(_sqlite_url(tmp_path))
    barrier = threading.Barrier(8)
    seen: list[sa.Engine] = []

    def ask() -> None:
        barrier.wait()
        seen.append(lazy.engine)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(seen) == 8
        assert all(engine is seen[0] for engine in seen)
        assert lazy.engine is seen[0]
        assert not seen[0].pool._pre_ping  # pinged only after idling (see below)
        with lazy.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        lazy.dispose()


def test_engine_kwargs_override_the_defaults(tmp_path: Path) -> None:
    lazy = LazyEngine(_sqlite_url(tmp_path), {"pool_pre_ping": False, "hide_parameters": True})
    try:
        assert not lazy.engine.pool._pre_ping
        assert lazy.engine.hide_parameters
    finally:
        lazy.dispose()


def test_dispose_closes_an_engine_it_created(tmp_path: Path) -> None:
    lazy = LazyEngine(_sqlite_url(tmp_path))
    lazy.dispose()  # nothing created yet: nothing to do, and nothing created by it
    pool = lazy.engine.pool
    lazy.dispose()
    assert lazy.engine.pool is not pool  # SQLAlchemy replaces a disposed pool
    lazy.dispose()


def test_dispose_leaves_a_shared_engine_alone(tmp_path: Path) -> None:
    shared = sa.create_engine(_sqlite_url(tmp_path))
    try:
        pool = shared.pool
        lazy = LazyEngine(shared.url, engine=shared)
        assert lazy.engine is shared
        lazy.dispose()
        assert shared.pool is pool
    finally:
        shared.dispose()


def test_adapters_do_not_dispose_a_shared_engine(tmp_path: Path) -> None:
    shared = sa.create_engine(_sqlite_url(tmp_path))
    try:
        with shared.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id INTEGER PRIMARY KEY, ts TEXT)"))
        pool = shared.pool
        source = SqlAlchemySource(engine=shared, table="t", cursor_column="ts", pk_columns=["id"])
        target = OutputTarget(engine=shared, table="t")
        store = SqlCheckpointStore(engine=shared)
        sink = SqlQuarantineSink(engine=shared)
        assert source.engine is shared
        assert target.engine is shared
        assert store.engine is shared
        for adapter in (source, target, store, sink):
            adapter.close()
            assert shared.pool is pool
    finally:
        shared.dispose()


def test_adapters_dispose_the_engine_they_created(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path)
    source = SqlAlchemySource(url=url, table="t", cursor_column="ts", pk_columns=["id"])
    target = OutputTarget(url=url, table="t")
    store = SqlCheckpointStore(url=url)
    for adapter in (source, target, store):
        pool = adapter.engine.pool
        adapter.close()
        assert adapter.engine.pool is not pool
        adapter.close()


def test_a_connection_is_pinged_only_after_idling(pg: TestDatabase) -> None:
    lazy = LazyEngine(pg.url)
    engine = lazy.engine
    pings: list[int] = []
    ping = engine.dialect.do_ping

    def counting(dbapi_connection: Any) -> bool:
        pings.append(1)
        return ping(dbapi_connection)

    engine.dialect.do_ping = counting  # type: ignore[method-assign]
    try:
        pid = _backend_pid(engine)
        for _ in range(3):  # back-to-back use (a catch-up): no ping, same connection
            assert _backend_pid(engine) == pid
        assert pings == []
        _idle(engine, 60)
        assert _backend_pid(engine) == pid
        assert pings == [1]  # idle for a minute: pinged once, still alive
        with pg.engine.connect() as admin:  # the server drops it while it idles
            admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        _idle(engine, 60)
        fresh = _backend_pid(engine)  # the failed ping made the pool reconnect
        assert fresh != pid
        assert len(pings) == 2
    finally:
        lazy.dispose()


def test_setting_pool_pre_ping_keeps_sqlalchemys_own(tmp_path: Path) -> None:
    lazy = LazyEngine(_sqlite_url(tmp_path), {"pool_pre_ping": True})
    try:
        assert lazy.engine.pool._pre_ping
    finally:
        lazy.dispose()


def _backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def _idle(engine: sa.Engine, seconds: float) -> None:
    """Pretend every pooled connection was checked in ``seconds`` ago."""
    for record in list(engine.pool._pool.queue):  # type: ignore[attr-defined]
        since = record.info.get("dbtrigger_idle_since")
        if since is not None:
            record.info["dbtrigger_idle_since"] = (since[0], since[1] - seconds)


def _table() -> sa.Table:
    return sa.Table("once", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))


def test_a_table_created_by_another_process_meanwhile_is_no_error(tmp_path: Path) -> None:
    """The quarantine sink's and the dead-letter marks' table: a CREATE that fails
    because another process created the table after our check is taken as done."""
    engine = sa.create_engine(_sqlite_url(tmp_path))
    try:
        table = _table()
        once = TableOnce(table, lambda: engine)
        calls: list[int] = []

        def racing_create(bind: Any, checkfirst: bool = True) -> None:
            calls.append(1)
            _table().create(bind)  # the other process wins the race
            raise sa.exc.OperationalError("CREATE TABLE once", {}, Exception("already exists"))

        table.create = racing_create  # type: ignore[method-assign]
        once.ensure()
        once.ensure()  # once per process: no second attempt
        assert calls == [1]
        assert sa.inspect(engine).has_table("once")
    finally:
        engine.dispose()


def test_a_create_that_fails_otherwise_is_raised(tmp_path: Path) -> None:
    engine = sa.create_engine(_sqlite_url(tmp_path))
    try:
        table = _table()

        def failing_create(bind: Any, checkfirst: bool = True) -> None:
            raise sa.exc.OperationalError("CREATE TABLE once", {}, Exception("no privilege"))

        table.create = failing_create  # type: ignore[method-assign]
        once = TableOnce(table, lambda: engine)
        with pytest.raises(sa.exc.OperationalError, match="no privilege"):
            once.ensure()
    finally:
        engine.dispose()
