"""LazyEngine: created once on first use, shared engines are never disposed by an adapter."""

from __future__ import annotations

import threading
from pathlib import Path

import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger._engine import LazyEngine
from dbtrigger.output import OutputTarget
from dbtrigger.quarantine import SqlQuarantineSink
from dbtrigger.state.stores.sql import SqlCheckpointStore


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
        assert seen[0].pool._pre_ping  # the default, so idle drops are replaced
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
