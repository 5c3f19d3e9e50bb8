"""A poison row in a claimed batch does not burn its batch-mates' attempts.

The rule (queue/outcome.py, queue/pick.py): an attempt counts against a row
only when the outcome was the row's own - it was the only row the failure fell
on, or the handler named it (``ctx.retry``, ``PartialBatchError``). A handler
exception on a claim of several rows, or the expiry of such a claim, says
nothing about which row failed: the rows are handed back in halves, waiting as
groups, and the attempt is given back. So a poison row goes ``dead`` after
``max_attempts`` failures of its own, and every innocent row sharing its claims
is done with one attempt, not ``dead`` with it (before: the whole batch went
dead together, each row having "failed" ``max_attempts`` times).
"""

from __future__ import annotations

import random

from dbtrigger import ClaimSource, QueueTrigger, RowChange
from dbtrigger.queue.outcome import decide
from dbtrigger.queue.statements import RetryItem
from dbtrigger.state.backoff import Backoff
from tests.databases import TestDatabase
from tests.test_queue_bisect import wait_until_expired
from tests.test_queue_columns import make_jobs, rows

POISON = 5


def poisoned(events: list[RowChange]) -> None:
    if any(e.pk["id"] == POISON for e in events):
        raise RuntimeError("downstream rejects job 5")


def settle_all(queue: QueueTrigger, handler: object) -> int:
    """Tick until nothing is claimable or waiting; the ticks it took (bounded)."""
    for ticks in range(1, 200):
        result = queue.tick_result(handler)  # type: ignore[arg-type]
        counts = queue.status()
        if result.outcome == "idle" and counts.claimable_now == counts.delayed == 0:
            return ticks
    raise AssertionError(f"the queue did not settle: {queue.status()}")


def test_a_poison_row_goes_dead_alone_and_its_batch_mates_keep_their_attempts(
    db: TestDatabase,
) -> None:
    make_jobs(db, 8)
    calls: list[list[int]] = []

    def handler(events: list[RowChange]) -> None:
        calls.append(sorted(int(e.pk["id"]) for e in events))
        if len(calls) == 5:  # the poison row has failed alone once: new work arrives
            db.execute(
                f"INSERT INTO {db.qualified('jobs')} (id, payload) VALUES (9, 'new'), (10, 'new')"
            )
        poisoned(events)

    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    queue = QueueTrigger(
        name="jobs",
        source=source,
        batch_size=8,
        max_attempts=3,
        retry_delay_seconds=0,
        retry_delay_max_seconds=0,
        seed=1,
    )
    try:
        settle_all(queue, handler)
    finally:
        queue.close()
        source.close()
    table = rows(db)
    assert table[POISON]["dbt_status"] == "dead"
    assert table[POISON]["dbt_attempts"] == 3
    assert table[POISON]["dbt_last_error"].startswith("failed 3 times; last: RuntimeError")
    innocent = {i: r for i, r in table.items() if i != POISON}
    assert {r["dbt_status"] for r in innocent.values()} == {"done"}
    assert {r["dbt_attempts"] for r in innocent.values()} == {1}
    # Halved 8 -> 4 -> 2 -> 1; once alone, it comes back alone (rows 9 and 10,
    # which arrived meanwhile, never share a call with it).
    with_poison = [c for c in calls if POISON in c]
    assert [len(c) for c in with_poison] == [8, 4, 2, 1, 1, 1]


def test_shared_failure_is_split_in_two_groups_with_one_backoff() -> None:
    """The pure rule: rows the exception fell on together are split, a marked row
    and a row the failure fell on alone are counted."""
    rows_ = [((i,), attempt) for i, attempt in [(1, 1), (2, 5), (3, 2), (4, 1), (5, 1)]]
    plan = decide(
        rows_,
        pks={(i,): {"id": i} for i in range(1, 6)},
        marks={},
        failure=RuntimeError("boom"),
        max_attempts=5,
        backoff=Backoff(1, 300),
        rng=random.Random(1),
    )
    assert (plan.done, plan.dead) == ([], [])  # row 2 is at max_attempts: not dead for it
    groups: dict[str | None, list[RetryItem]] = {}
    for item in plan.retry:
        groups.setdefault(item.group, []).append(item)
    assert None not in groups
    assert sorted(sorted(i.key[0] for i in g) for g in groups.values()) == [[1, 2, 3], [4, 5]]
    assert len({i.delay_seconds for i in plan.retry}) == 1
    assert plan.retry[0].error == "failed with 4 other row(s): RuntimeError: boom"
    alone = decide(
        [((1,), 5)],
        pks={(1,): {"id": 1}},
        marks={},
        failure=RuntimeError("boom"),
        max_attempts=5,
        backoff=Backoff(1, 300),
        rng=random.Random(1),
    )
    assert [d.key for d in alone.dead] == [(1,)]
    again = decide(
        [((1,), 2)],
        pks={(1,): {"id": 1}},
        marks={},
        failure=RuntimeError("boom"),
        max_attempts=5,
        backoff=Backoff(1, 300),
        rng=random.Random(1),
    )
    # Counted, and back alone (a group of its own): it fails no claim of fresh rows.
    ((item,),) = [again.retry]
    assert (item.key, item.counted, item.group is not None) == ((1,), True, True)


def test_an_expired_claims_halves_keep_their_attempts(db: TestDatabase) -> None:
    """A claim of several rows that expires gives its attempt back: the halves
    claimed after it are on the attempt they had; a row alone counts."""
    make_jobs(db, 4)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        assert len(source.claim(limit=10, token="a" * 32, worker="A", visibility=0.2)) == 4
        wait_until_expired(source, 4)
        half = source.claim_batch(limit=10, token="b" * 32, worker="B", visibility=0.2)
        assert [r.attempt for r in half.rows] == [1, 1]
        group = source.claim_batch(limit=10, token="c" * 32, worker="C", visibility=30)
        assert [r.attempt for r in group.rows] == [1, 1]
        source.settle(token="c" * 32, done=[r.key for r in group.rows])
        wait_until_expired(source, 2)
        source.claim_batch(limit=10, token="d" * 32, worker="D", visibility=0.2)
        other = source.claim_batch(limit=10, token="e" * 32, worker="E", visibility=30)
        assert [(r.attempt, r.isolated) for r in other.rows] == [(1, False)]
        wait_until_expired(source, 1)
        alone = source.claim_batch(limit=10, token="f" * 32, worker="F", visibility=30)
        assert [(r.attempt, r.isolated) for r in alone.rows] == [(2, True)]
    finally:
        source.close()
