"""The optional LISTEN/NOTIFY wake-up hint (PostgreSQL): a NOTIFY ends an idle
worker's sleep; without one, the interval poll still finds the work."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.errors import ConfigurationError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.runtime.runner import Runner
from dbtrigger.wakeup import AdaptivePolling
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs

CHANNEL = "dbt_jobs_wake"
#: The runner's poll interval: far longer than any wait below, so only the
#: hint can explain a row done before it.
LONG_INTERVAL = 300.0


@pytest.fixture
def pg_source(pg: TestDatabase) -> Iterator[ClaimSource]:
    make_jobs(pg, 0)
    src = ClaimSource(url=pg.url, table="jobs", schema=pg.schema, pk_columns=["id"])
    yield src
    src.close()


def wait_until(check: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def insert(db: TestDatabase, job_id: int, *, notify: bool) -> None:
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (:i, 'x')"),
            {"i": job_id},
        )
        if notify:
            conn.execute(sa.text("SELECT pg_notify(:c, '')"), {"c": CHANNEL})


def done(db: TestDatabase) -> set[int]:
    with db.engine.connect() as conn:
        return {
            int(r[0])
            for r in conn.execute(
                sa.text(f"SELECT id FROM {db.qualified('jobs')} WHERE dbt_status = 'done'")
            )
        }


class Worker:
    """A runner in a thread, stopped (and its listener with it) on exit."""

    def __init__(self, queue: QueueTrigger, interval: float, wake: Any = None) -> None:
        self.seen: list[int] = []
        self.runner = Runner(
            queue, self.handle, interval_seconds=interval, progress=None, wake=wake
        )
        self.thread = threading.Thread(target=self.runner.run, kwargs={"install_signals": False})

    def handle(self, events: list[RowChange]) -> None:
        self.seen.extend(e.pk["id"] for e in events)

    def __enter__(self) -> Worker:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_a_notify_wakes_an_idle_worker(pg: TestDatabase, pg_source: ClaimSource) -> None:
    metrics = InMemoryMetrics()
    queue = QueueTrigger(name="jobs", source=pg_source, notify_channel=CHANNEL, metrics=metrics)
    assert queue._listener is not None
    with Worker(queue, LONG_INTERVAL) as worker:
        assert wait_until(lambda: worker.runner.stats.ticks >= 1)
        assert queue._listener.listening.wait(60)
        insert(pg, 1, notify=True)
        assert wait_until(lambda: done(pg) == {1}), "the NOTIFY did not wake the worker"
        insert(pg, 2, notify=True)
        assert wait_until(lambda: done(pg) == {1, 2})
    assert worker.seen == [1, 2]
    assert metrics.total("queue_notifications_total") >= 2
    assert not queue._listener.listening.is_set()  # the runner stopped the listener


def test_adaptive_polling_keeps_the_queues_own_notify(
    pg: TestDatabase, pg_source: ClaimSource
) -> None:
    """``--wake adaptive`` on a queue worker that listens: the hint shortens the
    queue's own wait instead of replacing it (it used to sleep in its place, and
    a NOTIFY waited for the interval, worse than no hint)."""
    queue = QueueTrigger(name="jobs", source=pg_source, notify_channel=CHANNEL)
    assert queue._listener is not None
    with Worker(queue, LONG_INTERVAL, wake=AdaptivePolling()) as worker:
        assert queue._listener.listening.wait(60), "the queue's listener never started"
        insert(pg, 1, notify=True)
        assert wait_until(lambda: done(pg) == {1}), "the NOTIFY did not wake the worker"
    assert worker.seen == [1]


def test_without_a_notify_the_interval_poll_still_finds_work(
    pg: TestDatabase, pg_source: ClaimSource
) -> None:
    """The hint is never the only signal: a producer that does not notify (or a
    retry whose backoff ends) is found by the ordinary poll."""
    queue = QueueTrigger(name="jobs", source=pg_source, notify_channel=CHANNEL)
    with Worker(queue, 0.3):
        assert wait_until(
            lambda: queue._listener is not None and queue._listener.listening.is_set()
        )
        insert(pg, 1, notify=False)
        assert wait_until(lambda: done(pg) == {1})


def test_a_broken_listener_leaves_polling_alone(
    pg: TestDatabase, pg_source: ClaimSource, caplog: pytest.LogCaptureFixture
) -> None:
    queue = QueueTrigger(name="jobs", source=pg_source, notify_channel=CHANNEL)
    listener = queue._listener
    assert listener is not None
    with Worker(queue, 0.3):
        assert listener.listening.wait(60)
        with pg.engine.connect() as conn:  # the DBA kills the LISTEN session
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN%' AND datname = current_database()"
                )
            )
        assert wait_until(
            lambda: any(getattr(r, "event", "") == "queue_listen_failed" for r in caplog.records)
        )
        insert(pg, 1, notify=False)
        assert wait_until(lambda: done(pg) == {1})
        assert listener.listening.wait(60)  # and it reconnected


def test_the_hint_is_postgresql_and_psycopg_only(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 0)
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    with pytest.raises(ConfigurationError, match="PostgreSQL LISTEN/NOTIFY"):
        QueueTrigger(name="jobs", source=source, notify_channel=CHANNEL)
    psycopg2 = ClaimSource(url="postgresql+psycopg2://u@h/db", table="jobs", pk_columns=["id"])
    with pytest.raises(ConfigurationError, match="psycopg"):
        QueueTrigger(name="jobs", source=psycopg2, notify_channel=CHANNEL)
    pg = ClaimSource(url="postgresql+psycopg://u@h/db", table="jobs", pk_columns=["id"])
    with pytest.raises(ConfigurationError):
        QueueTrigger(name="jobs", source=pg, notify_channel="wake; DROP TABLE jobs")
