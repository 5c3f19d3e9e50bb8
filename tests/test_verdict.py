"""The pure batch decisions of dbtrigger.state.verdict, table by table, with no fakes."""

from __future__ import annotations

import pytest

from dbtrigger.state.verdict import Advance, Verdict, advance, judge, should_isolate

# (description, rows, settled, failed, aborted, attempt, max_attempts, sink, limit, verdict)
JUDGE_TABLE = [
    ("every row passed", 5, 5, 0, False, 1, 5, True, 10, Verdict.SETTLED),
    ("bisection found nothing failing alone", 5, 5, 0, False, 5, 5, True, 10, Verdict.SETTLED),
    ("first failure, attempts remain", 5, 0, 5, False, 1, 5, True, 10, Verdict.RETRY),
    ("one before the last attempt", 5, 4, 1, False, 4, 5, True, 10, Verdict.RETRY),
    ("attempts used up, no sink", 5, 4, 1, False, 5, 5, False, 10, Verdict.POISON),
    ("attempts used up, no sink, nothing passes", 5, 0, 5, False, 5, 5, False, 10, Verdict.POISON),
    ("one row fails alone, neighbours pass", 5, 4, 1, False, 5, 5, True, 10, Verdict.QUARANTINE),
    ("past max attempts still quarantines", 5, 4, 1, False, 9, 5, True, 10, Verdict.QUARANTINE),
    ("exactly the limit fail alone", 12, 2, 10, False, 5, 5, True, 10, Verdict.QUARANTINE),
    ("one more than the limit: outage", 12, 1, 11, False, 5, 5, True, 10, Verdict.OUTAGE),
    ("bisection aborted: outage", 50, 3, 11, True, 5, 5, True, 10, Verdict.OUTAGE),
    ("no row of a multi-row batch passes: outage", 3, 0, 3, False, 5, 5, True, 10, Verdict.OUTAGE),
    (
        "a single-row batch cannot tell: quarantine",
        1,
        0,
        1,
        False,
        5,
        5,
        True,
        10,
        Verdict.QUARANTINE,
    ),
    (
        "rows settled on an earlier delivery count",
        3,
        1,
        2,
        False,
        5,
        5,
        True,
        10,
        Verdict.QUARANTINE,
    ),
]


@pytest.mark.parametrize(
    ("rows", "settled", "failed", "aborted", "attempt", "max_attempts", "sink", "limit", "want"),
    [case[1:] for case in JUDGE_TABLE],
    ids=[case[0] for case in JUDGE_TABLE],
)
def test_judge_table(
    rows: int,
    settled: int,
    failed: int,
    aborted: bool,
    attempt: int,
    max_attempts: int,
    sink: bool,
    limit: int,
    want: Verdict,
) -> None:
    got = judge(
        rows=rows,
        settled=settled,
        failed=failed,
        aborted=aborted,
        attempt=attempt,
        max_attempts=max_attempts,
        has_sink=sink,
        quarantine_limit=limit,
    )
    assert got is want


# (description, attempt, max_attempts, sink, named, pending, bisect?)
ISOLATE_TABLE = [
    ("poison candidate with a sink", 5, 5, True, False, 4, True),
    ("attempts remain", 4, 5, True, False, 4, False),
    ("no sink: nowhere to put rows", 5, 5, False, False, 4, False),
    ("the failure named its rows", 5, 5, True, True, 4, False),
    ("one row left: nothing to split", 5, 5, True, False, 1, False),
    ("max_attempts=1 bisects on the first failure", 1, 1, True, False, 2, True),
]


@pytest.mark.parametrize(
    ("attempt", "max_attempts", "sink", "named", "pending", "want"),
    [case[1:] for case in ISOLATE_TABLE],
    ids=[case[0] for case in ISOLATE_TABLE],
)
def test_should_isolate_table(
    attempt: int, max_attempts: int, sink: bool, named: bool, pending: int, want: bool
) -> None:
    got = should_isolate(
        attempt=attempt, max_attempts=max_attempts, has_sink=sink, named=named, pending=pending
    )
    assert got is want


# (description, batch ids in order, settled ids, head, done)
ADVANCE_TABLE = [
    ("nothing settled", "abcde", "", 0, ""),
    ("everything settled", "abcde", "abcde", 5, ""),
    ("leading run", "abcde", "ab", 2, ""),
    ("gap after the head", "abcde", "abde", 2, "de"),
    ("first row failed, later ones done", "abcde", "bce", 0, "bce"),
    ("only the last row", "abcde", "e", 0, "e"),
    ("settled ids outside the batch are ignored", "abc", "axyz", 1, ""),
    ("empty batch", "", "ab", 0, ""),
]


@pytest.mark.parametrize(
    ("ids", "settled", "head", "done"),
    [case[1:] for case in ADVANCE_TABLE],
    ids=[case[0] for case in ADVANCE_TABLE],
)
def test_advance_table(ids: str, settled: str, head: int, done: str) -> None:
    assert advance(list(ids), set(settled)) == Advance(head, tuple(done))


def test_advance_keeps_batch_order_not_settled_order() -> None:
    assert advance(["r1", "r2", "r3", "r4"], {"r4", "r3", "r1"}).done == ("r3", "r4")
