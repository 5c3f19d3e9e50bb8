"""A queue worker's health: a claim its handler holds far past the visibility
timeout (kept alive by the heartbeat) reports **stale**, as a poller's lease held
with no commit does; once the call returns the worker is healthy again.

Judged at a given ``now``, never by waiting: the test holds the handler on an
event and asks with ``now`` set past the limit.
"""

from __future__ import annotations

import datetime as dt
import threading

from dbtrigger import ClaimSource, RowChange
from dbtrigger.health import OK, STALE
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, trigger


def test_a_claim_held_past_the_limit_is_stale_until_its_handler_returns(
    sqlite_db: TestDatabase,
) -> None:
    make_jobs(sqlite_db, 3)
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    q = trigger(source, batch_size=2, visibility_timeout_seconds=30.0)
    assert q.health().status == OK
    assert q.health().reason == "no claim in flight"
    holding, release = threading.Event(), threading.Event()

    def stuck(events: list[RowChange]) -> None:
        holding.set()
        assert release.wait(60)  # a handler call that does not return (bounded)

    thread = threading.Thread(target=q.tick, args=(stuck,))
    thread.start()
    try:
        assert holding.wait(60)
        now = dt.datetime.now(dt.timezone.utc)
        assert q.health(stale_after_seconds=600, now=now).status == OK
        report = q.health(stale_after_seconds=600, now=now + dt.timedelta(seconds=3600))
        assert report.status == STALE
        assert report.http_status == 503
        assert "2 row(s)" in report.reason
        assert "visibility timeout 30s" in report.reason
        assert "handler_timeout_seconds" in report.reason
        assert report.to_dict()["lease"].startswith("1 claim(s) in flight")
    finally:
        release.set()
        thread.join(60)
    assert not thread.is_alive()
    after = q.health(now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3600))
    assert after.status == OK
    q.close()
    source.close()
