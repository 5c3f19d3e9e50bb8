"""Fencing at the instant a claim expires: what a settlement reports is what it wrote.

The chaos test once saw, on MariaDB, a batch of ten rows recorded as done by
two workers. The cause: MariaDB has no ``UPDATE ... RETURNING``, so a
settlement locks the rows its claim still holds (``SELECT ... FOR UPDATE``,
judged against ``UTC_TIMESTAMP(6)`` at that moment) and then updates them in a
second statement - which re-checked the expiry against a *later* clock
reading. A claim that expired between the two statements made the update
match nothing, yet the settlement reported every locked row as done; the rows
stayed claimed, expired, and another worker claimed and completed them again.

These tests open that window on purpose (a pause between the lock and the
write) and check the settlement's report against the table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource
from dbtrigger.errors import FetchError
from dbtrigger.queue.statements import ClaimTable, DeadItem, RetryItem
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, rows, trigger

VISIBILITY = 0.4


@pytest.fixture
def maria_source(mariadb: TestDatabase) -> Iterator[ClaimSource]:
    make_jobs(mariadb, 6)
    src = ClaimSource(url=mariadb.url, table="jobs", schema=mariadb.schema, pk_columns=["id"])
    yield src
    src.close()


@pytest.fixture
def expire_after_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sleep past the claim's expiry right after the settlement locked its rows."""
    locked = ClaimTable._owned_keys

    def slow_lock(self: ClaimTable, *args: Any, **kwargs: Any) -> Any:
        keys = locked(self, *args, **kwargs)
        time.sleep(VISIBILITY * 2.5)
        return keys

    monkeypatch.setattr(ClaimTable, "_owned_keys", slow_lock)


def table_outcomes(db: TestDatabase) -> dict[int, tuple[str, str | None]]:
    return {i: (r["dbt_status"], r["dbt_claim_token"]) for i, r in rows(db).items()}


@pytest.mark.usefixtures("expire_after_lock")
def test_mariadb_claim_expiring_between_lock_and_write_is_reported_as_written(
    mariadb: TestDatabase, maria_source: ClaimSource
) -> None:
    token = "a" * 32
    claimed = maria_source.claim(limit=6, token=token, worker="A", visibility=VISIBILITY)
    keys = [r.key for r in claimed]
    settled = maria_source.settle(
        token=token,
        done=keys[:4],
        retry=[RetryItem(keys[4], 30.0, "later")],
        dead=[DeadItem(keys[5], "bad row")],
    )
    table = table_outcomes(mariadb)
    # The rows were locked while the claim still held them: nobody could take
    # them over since, so the settlement stands - and is reported as it stands.
    assert settled.done == frozenset(keys[:4])
    assert settled.retried == {keys[4]}
    assert settled.dead == {keys[5]}
    assert {k[0] for k in settled.done} == {i for i, (s, _) in table.items() if s == "done"}
    assert table[keys[4][0]] == ("ready", None)
    assert table[keys[5][0]][0] == "dead"
    # ... and no second worker finds them to complete again.
    again = trigger(maria_source, batch_size=10, owner_id="B")
    assert again.tick_result(lambda events: None).claimed == 0


def test_mariadb_no_row_is_completed_by_two_workers_when_a_claim_expires_mid_settlement(
    mariadb: TestDatabase, maria_source: ClaimSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos test's failure, replayed deterministically at the trigger level."""
    a = trigger(maria_source, batch_size=3, visibility_timeout_seconds=VISIBILITY, owner_id="A")
    b = trigger(maria_source, batch_size=10, owner_id="B")
    locked = ClaimTable._owned_keys

    def slow_lock(self: ClaimTable, *args: Any, **kwargs: Any) -> Any:
        keys = locked(self, *args, **kwargs)
        time.sleep(VISIBILITY * 2.5)  # A's claim expires; B is polling meanwhile
        return keys

    with monkeypatch.context() as m:
        m.setattr(ClaimTable, "_owned_keys", slow_lock)
        first = a.tick_result(lambda events: None)
    second = b.tick_result(lambda events: None)
    done_by_a = {k for k, outcome in first.settled if outcome == "done"}
    done_by_b = {k for k, outcome in second.settled if outcome == "done"}
    assert done_by_a, first
    assert done_by_a.isdisjoint(done_by_b), "a row was completed by two workers"
    table = table_outcomes(mariadb)
    for key in done_by_a:
        assert table[key[0]] == ("done", first.token)


def test_an_expired_claim_nobody_took_over_cannot_settle(
    db: TestDatabase,
) -> None:
    """On every database: expired is void, even before another worker claims the row.

    The settlement reports the rows lost and leaves them as they were, to be
    claimed again (in halves: the expiry, shared by three rows, counts no attempt).
    """
    make_jobs(db, 3)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        token = "c" * 32
        claimed = source.claim(limit=3, token=token, worker="A", visibility=0.2)
        time.sleep(0.6)
        settled = source.settle(
            token=token,
            done=[claimed[0].key],
            retry=[RetryItem(claimed[1].key, 0.0, "x")],
            dead=[DeadItem(claimed[2].key, "y")],
        )
        assert (settled.done, settled.retried, settled.dead) == (frozenset(),) * 3
        assert set(table_outcomes(db).values()) == {("claimed", token)}
        # Claimed again in halves (the claim expired without an outcome), on the
        # attempt they had: the expiry was shared, so it is nobody's.
        again = source.claim(limit=3, token="d" * 32, worker="B", visibility=30)
        rest = source.claim(limit=3, token="f" * 32, worker="B", visibility=30)
        assert sorted(r.attempt for r in again) == [1, 1]
        assert [r.attempt for r in rest] == [1]
        assert {r.key for r in [*again, *rest]} == {r.key for r in claimed}
    finally:
        source.close()


def test_extension_of_an_expired_claim_holds_nothing(db: TestDatabase) -> None:
    """A heartbeat that arrives after expiry must not revive the claim."""
    make_jobs(db, 2)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        source.claim(limit=2, token="e" * 32, worker="A", visibility=0.2)
        time.sleep(0.6)
        assert source.extend(token="e" * 32, visibility=30) == 0
        with db.engine.connect() as conn:
            visible = conn.execute(
                sa.text(f"SELECT count(*) FROM {db.qualified('jobs')} WHERE dbt_status = 'claimed'")
            ).scalar_one()
        assert visible == 2
        first = source.claim(limit=2, token="f" * 32, worker="B", visibility=30)
        second = source.claim(limit=2, token="g" * 32, worker="B", visibility=30)
        assert (len(first), len(second)) == (1, 1)  # the expired claim, halved
    finally:
        source.close()


def test_a_claim_whose_extensions_fail_past_the_visibility_timeout_is_cancelled(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat cannot reach the database (this worker's connection is cut, its
    database user locked out) while the handler runs. Once no extension has landed
    for the visibility timeout, the claim has expired whatever the database says, and
    another worker may be running its rows: ``ctx.cancelled`` turns true, as when an
    extension finds the claim holding no row, and nothing the call returns is
    recorded (here the extensions landed and only their answers were lost: a
    settlement would have passed the fence and marked the rows done although the
    handler stopped when told). Before, ``ctx.cancelled`` stayed false for as long
    as the extensions failed: the handler ran on beside the other worker, not told."""
    make_jobs(sqlite_db, 2)
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    queue = trigger(
        source, batch_size=2, visibility_timeout_seconds=1.0, heartbeat_interval_seconds=0.2
    )

    extend = source.extend

    def cut_off(**claim: Any) -> int:
        extend(**claim)  # it lands, but its answer is lost: the claim is still held
        raise FetchError("claim extension on jobs failed: connection lost")

    monkeypatch.setattr(source, "extend", cut_off)
    told: list[bool] = []

    def handle(events: list[Any], ctx: Any) -> None:
        deadline = time.monotonic() + 10  # bounded: told within a visibility timeout or two
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        told.append(bool(ctx.cancelled))

    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            result = queue.tick_result(handle)
    finally:
        queue.close()
        source.close()
    assert told == [True]  # before: False, after the 10 s bound
    # Nothing recorded: the handler stopped when told, so done would lose its rows.
    assert (result.rows, result.claims_lost) == (0, 2)
    [lost] = [r for r in caplog.records if getattr(r, "event", "") == "queue_claim_lost"]
    assert "no extension" in lost.getMessage()
    assert {r["dbt_status"] for r in rows(sqlite_db).values()} == {"claimed"}  # claimable again


def test_a_heartbeat_after_the_claims_own_settlement_reports_nothing_lost(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A heartbeat that falls between the settlement of the claim's last rows and the
    end of the tick finds the claim holding no row: its own settlement finished
    them. It logged ``queue_claim_lost`` at WARNING ("the handler's results will not
    be recorded") about a claim whose results had just been recorded. Here the
    settlement waits for such a beat (bounded)."""
    make_jobs(sqlite_db, 2)
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    queue = trigger(
        source, batch_size=2, visibility_timeout_seconds=1.0, heartbeat_interval_seconds=0.1
    )
    settle, extend = source.settle, source.extend
    beat_after = threading.Event()
    settled = threading.Event()

    def late_beat(**claim: Any) -> int:
        held = extend(**claim)
        if settled.is_set():
            beat_after.set()
        return held

    def settle_then_wait(**outcome: Any) -> Any:
        result = settle(**outcome)
        settled.set()
        assert beat_after.wait(30)  # a beat lands after the settlement (bounded)
        return result

    monkeypatch.setattr(source, "extend", late_beat)
    monkeypatch.setattr(source, "settle", settle_then_wait)
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            result = queue.tick_result(lambda events: None)
    finally:
        queue.close()
        source.close()
    assert (result.rows, result.claims_lost) == (2, 0)
    assert not [r for r in caplog.records if getattr(r, "event", "") == "queue_claim_lost"]
