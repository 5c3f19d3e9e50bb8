"""A claim queue's drain does not return while retried rows wait.

A row its handler retried (``ctx.retry``, a raise) goes back to ``ready`` with
``dbt_visible_at`` in the future; the claim after it comes back empty, and
``QueueTrigger.drain`` returned there, the row not done. Now it waits for a
retry due within ``retry_wait_seconds`` and claims it, and raises a
``HandlerError`` saying how many rows wait and when, nothing skipped, when the
first is further off. On SQLite, PostgreSQL and MariaDB: the due time is read
with each database's own clock arithmetic.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from typing import Any

import pytest

from dbtrigger import ClaimSource, QueueTrigger
from dbtrigger.errors import HandlerError
from dbtrigger.runtime.progress import DrainProgress
from dbtrigger.runtime.runner import Runner
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs


def _queue(db: TestDatabase) -> tuple[ClaimSource, QueueTrigger]:
    make_jobs(db, 3)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    return source, QueueTrigger(name="jobs", source=source, batch_size=10)


def test_a_queue_drain_claims_a_retry_that_comes_due(db: TestDatabase) -> None:
    """Before: the drain returned after the first claim (2 done), row 2 still
    ``ready`` for its retry."""
    source, queue = _queue(db)
    delivered: list[tuple[int, int]] = []

    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            delivered.append((int(e.pk["id"]), ctx.attempts(e)))
            if e.pk["id"] == 2 and ctx.attempts(e) == 1:
                ctx.retry(e, "429 from the mailer", delay_seconds=0.5)

    try:
        assert queue.drain(handle) == 3
        assert queue.status().by_status["done"] == 3
    finally:
        queue.close()
        source.close()
    assert sorted(delivered) == [(1, 1), (2, 1), (2, 2), (3, 1)]


def test_a_queue_drain_raises_for_a_retry_past_its_wait(db: TestDatabase) -> None:
    source, queue = _queue(db)

    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            if e.pk["id"] == 2:
                ctx.retry(e, "429 from the mailer", delay_seconds=600)

    try:
        with pytest.raises(HandlerError) as raised:
            queue.drain(handle)
        counts = queue.status()
    finally:
        queue.close()
        source.close()
    text = str(raised.value)
    assert "stopped after 2 row(s): 1 event(s) wait for a retry" in text
    assert "they stay ready in the table" in text
    assert "Nothing was skipped" in text
    assert 590 < float(text.split("(in ")[1].split("s)", maxsplit=1)[0]) <= 600
    assert raised.value.fields["waiting_retries"] == 1
    assert (counts.by_status["done"], counts.delayed) == (2, 1)


def test_a_queue_worker_is_not_caught_up_while_a_retried_row_waits(db: TestDatabase) -> None:
    """``dbtrigger run`` on a queue said "caught up" at the end of a drain while a
    row its handler retried still waited: the runner read ``caught_up`` with a
    default of True, and a queue's tick result had none. Now the idle tick
    counts the rows waiting for a retry and says so; the drain is not over."""
    source, queue = _queue(db)
    # A full first claim (2 of 3 rows): the runner's drain starts.
    queue._driver.settings = dataclasses.replace(queue._driver.settings, batch_size=2)
    reports: list[DrainProgress] = []
    results: list[Any] = []

    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            if e.pk["id"] == 2:
                ctx.retry(e, "429 from the mailer", delay_seconds=600)

    runner = Runner(
        queue, handle, interval_seconds=0, progress=reports.append, on_tick=results.append
    )
    try:
        runner.run(max_ticks=4, install_signals=False)
    finally:
        source.close()
    assert [r.claimed for r in results] == [2, 1, 0, 0]
    assert not any(r.caught_up for r in reports)
    idle = results[-1]
    assert (idle.outcome, idle.waiting_retries, idle.caught_up) == ("idle", 1, False)
    assert idle.next_retry_at is not None
    assert 590 < (idle.next_retry_at - dt.datetime.now(dt.timezone.utc)).total_seconds() <= 600
    assert "1 row(s) waiting for a retry" in idle.summary(0)[0]


def test_a_queue_worker_is_caught_up_when_nothing_waits(db: TestDatabase) -> None:
    source, queue = _queue(db)
    queue._driver.settings = dataclasses.replace(queue._driver.settings, batch_size=2)
    reports: list[DrainProgress] = []
    runner = Runner(queue, lambda events: None, interval_seconds=0, progress=reports.append)
    try:
        runner.run(max_ticks=4, install_signals=False)
    finally:
        source.close()
    assert [r.caught_up for r in reports][-1:] == [True]
    assert reports[-1].delivered == 3


def test_a_queue_worker_says_which_rows_another_claim_holds(db: TestDatabase) -> None:
    """Three workers on a queue, one killed mid-claim: the others said "caught up" and
    "idle: nothing claimable" for the minute until its claim expired, nothing about
    the rows it held. The tick that counts retries counts the rows under a live claim
    too, and its line says when the first such claim expires."""
    source, busy = _queue(db)
    busy._driver.settings = dataclasses.replace(busy._driver.settings, batch_size=2)
    other = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    worker = QueueTrigger(name="jobs", source=other, batch_size=10)
    inside, let_go = threading.Event(), threading.Event()

    def holds(events: Any) -> None:
        inside.set()
        let_go.wait(30)

    thread = threading.Thread(target=busy.tick_result, args=(holds,), daemon=True)
    thread.start()
    try:
        assert inside.wait(30)
        result = worker.tick_result(lambda events: None)
        assert (result.claimed, result.claimed_elsewhere) == (1, 2)
        assert result.claim_expires_at is not None
        left = (result.claim_expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
        assert 50 < left <= 60  # the busy worker's visibility timeout
        assert (
            "2 row(s) under another claim (a worker at work, or one that stopped"
            in (result.summary(0)[0])
        )
    finally:
        let_go.set()
        thread.join(30)
        worker.close()
        other.close()
        busy.close()
        source.close()
