"""What an append round reads of the queued commits' journals: only what is new,
with the same entries, ids and details as reading every journal whole."""

from __future__ import annotations

from typing import Any

import pytest

from dbtrigger.history import records as rec
from dbtrigger.history.chains import Pending, chains_of
from dbtrigger.state.document import JournalRecord


def entries(n: int) -> list[JournalRecord]:
    return [JournalRecord({"type": "commit", "batch_id": f"b{i}", "rows": i}) for i in range(n)]


def commits(all_entries: list[JournalRecord], limit: int, upto: range) -> list[Pending]:
    """The commits of entries ``upto``, each with the journal its document held."""
    out = []
    for i in upto:
        journal = tuple(all_entries[max(0, i + 1 - limit) : i + 1])
        out.append(Pending(journal, all_entries[i], lambda i=i: ({"n": i}, f'{{"n":{i}}}')))
    return out


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    entry_id = rec.entry_id

    def counting(entry: Any) -> str:
        seen.append(entry)
        return entry_id(entry)

    monkeypatch.setattr(rec, "entry_id", counting)
    return seen


def test_a_round_reads_each_journal_back_to_where_its_chain_ends(counted: list[Any]) -> None:
    made = entries(30)
    batch = commits(made, 20, range(20, 28))
    chains = chains_of(batch, None, 20)
    read = len(counted)
    assert len(chains) == 1
    chain, ids, details = chains[0]
    assert chain == made[1:28]  # the first journal whole, then one entry a commit
    assert ids == [rec.entry_id(e) for e in chain]
    assert details == {rec.entry_id(made[i]): ({"n": i}, f'{{"n":{i}}}') for i in range(20, 28)}
    # An id for each entry of the first journal, then for each commit's own entry
    # and the one it checks against (by identity: the same object, no id needed).
    assert read == 20 + 7  # (read whole, each journal would be 20 more)


def test_a_round_starts_from_the_newest_record_written(counted: list[Any]) -> None:
    made = entries(30)
    known = (rec.entry_id(made[19]), 19)
    counted.clear()
    chain, ids, _ = chains_of(commits(made, 20, range(20, 23)), known, 20)[0]
    read = len(counted)
    assert chain == made[19:23]  # from the known record (its append finds it there)
    assert ids == [rec.entry_id(e) for e in made[19:23]]
    assert read == 2 + 2  # b20 and b19 (known), then b21 and b22


def test_a_journal_that_does_not_continue_the_chain_starts_another() -> None:
    made = entries(40)
    batch = [*commits(made, 5, range(4, 6)), *commits(made, 5, range(20, 22))]
    chains = chains_of(batch, (rec.entry_id(made[0]), 1), 5)
    assert [c for c, _, _ in chains] == [made[0:6], made[16:22]]  # (the first from known: not held)
