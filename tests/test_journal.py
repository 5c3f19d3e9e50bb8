"""Journal entries: typed values in, the stored JSON object out (no fakes)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from dbtrigger.cursor import Position
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as L
from dbtrigger.state.document import Lease, StateDocument
from dbtrigger.state.journal import JournalEntry, encode

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
A = Position(cursor=10, pk={"id": 1})
B = Position(cursor=20, pk={"id": 7})
BASE = {
    "batch_id": "batch_1",
    "from": {
        "kind": "int+pk",
        "value": 10,
        "tiebreaker": {"id": 1},
        "tiebreaker_kinds": {"id": "int"},
    },
    "to": {
        "kind": "int+pk",
        "value": 20,
        "tiebreaker": {"id": 7},
        "tiebreaker_kinds": {"id": "int"},
    },
    "rows": 3,
    "owner_id": "host/1/ab",
    "fencing_token": 4,
    "committed_at": "2026-01-01T12:00:02.000000Z",
}


def commit(**kw: object) -> JournalEntry:
    args: dict[str, object] = {
        "batch_id": "batch_1",
        "before": A,
        "after": B,
        "rows": 3,
        "owner_id": "host/1/ab",
        "fencing_token": 4,
        "now": T0 + dt.timedelta(seconds=2),
        "started_at": T0,
    }
    args.update(kw)
    return JournalEntry.commit(**args)  # type: ignore[arg-type]


CASES = [
    ("whole commit", commit(), {"type": "commit", **BASE, "duration_ms": 2000.0}),
    (
        "commit that quarantined rows",
        commit(quarantined=2),
        {"type": "commit", **BASE, "duration_ms": 2000.0, "quarantined": 2},
    ),
    (
        "sub-millisecond duration is rounded to microseconds",
        commit(now=T0 + dt.timedelta(microseconds=1234567)),
        {
            "type": "commit",
            **BASE,
            "committed_at": "2026-01-01T12:00:01.234567Z",
            "duration_ms": 1234.567,
        },
    ),
    (
        "partial commit has no duration",
        JournalEntry(
            type="partial_commit",
            batch_id="batch_1",
            before=A,
            after=B,
            rows=3,
            owner_id="host/1/ab",
            fencing_token=4,
            committed_at=T0 + dt.timedelta(seconds=2),
        ),
        {"type": "partial_commit", **BASE},
    ),
]


@pytest.mark.parametrize(("entry", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_encode_table(entry: JournalEntry, want: dict[str, object]) -> None:
    got = encode(entry)
    assert got == want
    # Key order is part of the stored bytes: it must stay what older versions wrote.
    assert list(got) == list(want)
    json.dumps(got)  # plain JSON


def test_decide_commit_encodes_a_typed_entry_and_keeps_the_limit() -> None:
    lease = Lease("host/1/ab", 4, T0, T0, T0 + dt.timedelta(seconds=60))
    doc = StateDocument(poller_name="p", source_fingerprint="fp", lease=lease)
    for i in range(3):
        doc = L.decide_commit(
            doc,
            owner="host/1/ab",
            token=4,
            position=B,
            batch_id=f"batch_{i}",
            row_count=3,
            now=T0,
            ttl=dt.timedelta(seconds=60),
            release=False,
            journal_entry=commit(batch_id=f"batch_{i}"),
            journal_limit=2,
        )
    assert [e["batch_id"] for e in doc.journal] == ["batch_1", "batch_2"]
    assert docmod.loads(docmod.dumps(doc)).journal == doc.journal


def test_one_journal_limit_for_every_writer() -> None:
    """A poller's commits and an operator's changes keep the same number of
    entries (the pure rules defaulted to 50 while PollTrigger kept 20)."""
    import inspect  # noqa: PLC0415

    from dbtrigger import PollTrigger  # noqa: PLC0415
    from dbtrigger.state import operations as ops  # noqa: PLC0415

    def default(fn: object) -> object:
        return inspect.signature(fn).parameters["journal_limit"].default  # type: ignore[arg-type]

    assert docmod.DEFAULT_JOURNAL_LIMIT == 20
    for fn in (PollTrigger.__init__, L.decide_commit, L.decide_failure, ops.reset, ops.skip_batch):
        assert default(fn) == docmod.DEFAULT_JOURNAL_LIMIT, fn
    doc = StateDocument("p", "f")
    for i in range(30):
        doc = doc.with_journal_entry({"type": "manual", "n": i})
    assert len(doc.journal) == docmod.DEFAULT_JOURNAL_LIMIT


def test_manual_entries_share_the_journals_vocabulary() -> None:
    from dbtrigger.state import journal  # noqa: PLC0415

    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    entry = journal.manual(
        "reset", actor="ana", reason=" why ", now=now, before=None, after=Position(5, {"id": 1})
    )
    assert list(entry) == ["type", "operation", "actor", "reason", "at", "before", "after"]
    assert (entry["type"], entry["reason"], entry["before"]) == (journal.MANUAL, "why", None)
    assert encode(commit())["type"] == journal.COMMIT
