"""The delivery kernel (issue #21 item 2): one heartbeat thread and one lane pool
per trigger, released by ``close()``; the queue runs on the same kernel.

Before the kernel, a poller's lane pool lived as long as the process
(``Lanes.close()`` was never called: N idle threads per trigger), and a queue
started a pool per tick. Outcomes are waited for with a bound; nothing here
counts on a duration.
"""

from __future__ import annotations

import threading
from pathlib import Path

from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger, RowChange
from dbtrigger.runtime.kernel import KeepAlive
from dbtrigger.runtime.runner import Runner
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_source, items_table, make_trigger, wait_for
from tests.test_queue_columns import make_jobs


def threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_release_waits_for_the_beat_in_flight_and_no_beat_follows() -> None:
    keepalive = KeepAlive("k")
    inside, go_on = threading.Event(), threading.Event()
    beats: list[str] = []

    def beat() -> float | None:
        beats.append("beat")
        inside.set()
        go_on.wait(30)
        return 0.0  # due again at once: only release() stops it

    keepalive.hold("a", beat, first_in=0)
    assert inside.wait(30)
    released = threading.Event()
    releaser = threading.Thread(target=lambda: (keepalive.release("a"), released.set()))
    releaser.start()
    assert not released.wait(0.2)  # still inside the beat: release() waits for it
    go_on.set()
    releaser.join(30)
    assert released.is_set()
    count = len(beats)
    keepalive.close()
    assert len(beats) == count  # nothing beat after release() returned
    assert not threads("dbtrigger-heartbeat-k")


def test_a_beat_that_returns_none_stops_and_the_thread_lingers_then_exits() -> None:
    keepalive = KeepAlive("linger", linger=0.05)
    done = threading.Event()

    def once() -> float | None:
        done.set()
        return None

    keepalive.hold("x", once, first_in=0)
    assert done.wait(30)
    wait_for(lambda: not threads("dbtrigger-heartbeat-linger"), timeout=30)
    # A later hold starts it again.
    again = threading.Event()
    keepalive.hold("y", lambda: (again.set(), None)[1], first_in=0)
    assert again.wait(30)
    keepalive.close()


def test_a_poller_closes_its_lanes_and_heartbeat_and_they_start_again(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 41))
    trigger = make_trigger(
        items_source(sqlite_db),
        FileCheckpointStore(tmp_path),
        name="lanes_close",
        max_concurrency=4,
        batch_size=20,
    )
    seen: list[int] = []
    lock = threading.Lock()

    def handle(events: list[RowChange]) -> None:
        with lock:
            seen.extend(int(e.pk["id"]) for e in events)

    assert trigger.tick(handle) == 20
    assert threads("dbtrigger-lane-lanes_close")
    trigger.close()
    assert not threads("dbtrigger-lane-lanes_close")
    assert not threads("dbtrigger-heartbeat-lanes_close")
    with trigger:
        assert trigger.tick(handle) == 20
    assert not threads("dbtrigger-lane-lanes_close")
    assert sorted(seen) == list(range(1, 41))


def test_the_worker_loop_closes_the_trigger_it_drove(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 11))
    trigger = make_trigger(
        items_source(sqlite_db),
        FileCheckpointStore(tmp_path),
        name="runner_close",
        max_concurrency=3,
    )
    Runner(trigger, lambda events: None, interval_seconds=0, progress=None).run(
        max_ticks=2, install_signals=False
    )
    assert not threads("dbtrigger-lane-runner_close")


def test_a_queue_keeps_one_lane_pool_across_claims_and_closes_it(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 30)
    source = ClaimSource(
        url=sqlite_db.url, table="jobs", schema=sqlite_db.schema, pk_columns=["id"]
    )
    names: set[str] = set()
    lock = threading.Lock()

    def handle(events: list[RowChange]) -> None:
        with lock:
            names.add(threading.current_thread().name)

    try:
        queue = QueueTrigger(name="pooled", source=source, batch_size=6, max_concurrency=3)
        assert queue.drain(handle) == 30
        assert len(names) <= 3  # five claims, one pool of three threads
        assert all(name.startswith("dbtrigger-lane-pooled") for name in names)
        queue.close()
        assert not threads("dbtrigger-lane-pooled")
        assert not threads("dbtrigger-heartbeat-pooled")
    finally:
        source.close()
