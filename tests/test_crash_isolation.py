"""Rows that kill their process, set aside one by one: several in a batch, on
parallel lanes, and with fan-out subscribers (only the subscriber that died).

With a dead-letter sink, a batch that killed its process on the last of
``max_attempts`` attempts is handed over one row at a time, each row's id
written to the state document before its call (tests/test_crash_loop.py
holds the single-row case and the refusals without a sink). The workers are
real processes (tests/chaos/crash_loop_worker.py), restarted by the test a
bounded number of times.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
from pathlib import Path

from dbtrigger import FileCheckpointStore
from dbtrigger.state import crashes as C
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as L
from dbtrigger.state.document import FailureRecord, Lease, StateDocument, evolve
from tests.databases import TestDatabase
from tests.reliability_support import add_items, checkpoint_id, items_table, read_doc
from tests.test_crash_loop import (
    MAX_ATTEMPTS,
    ROWS,
    T0,
    TTL,
    _doc,
    _handled,
    _record,
    _restart_until_settled,
)


def _letters(sink: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in sink.read_text().splitlines()]


def _passed_the_batch(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path / "state")
    assert checkpoint_id(store) == ROWS[-1]
    assert read_doc(store).failure is None


def test_two_rows_that_kill_the_process_in_one_batch_are_both_dead_lettered(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Before, the second row's death made the next owner forget the first (only
    the row handed last was named), so each run handed the other one again and
    died on it: the worker alternated between rows 7 and 9 for ever."""
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    sink = tmp_path / "dead-letters.jsonl"
    runs = _restart_until_settled(
        sqlite_db, tmp_path, restarts=MAX_ATTEMPTS + 6, sink=sink, poison="7,9"
    )
    codes = [run.returncode for run in runs]
    # max_attempts deaths of the whole batch, then one death for each row handed alone.
    assert codes == [1] * (MAX_ATTEMPTS + 2) + [0], codes
    letters = _letters(sink)
    assert sorted(letter["pk"]["id"] for letter in letters) == [7, 9]  # type: ignore[index]
    assert all(str(letter["error"]).startswith("ProcessDied: ") for letter in letters)
    assert _handled(tmp_path) == set(ROWS) - {7, 9}
    _passed_the_batch(tmp_path)


def test_on_parallel_lanes_the_row_that_kills_the_process_is_dead_lettered(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Before, max_concurrency > 1 refused with CrashLoopError even with a sink:
    the rows handed alone are handed one after another, on the tick's thread."""
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    sink = tmp_path / "dead-letters.jsonl"
    runs = _restart_until_settled(
        sqlite_db, tmp_path, restarts=MAX_ATTEMPTS + 5, sink=sink, extra=("--lanes", "3")
    )
    codes = [run.returncode for run in runs]
    assert codes == [1] * (MAX_ATTEMPTS + 1) + [0], (codes, runs[-1].stderr[-2000:])
    assert [letter["pk"] for letter in _letters(sink)] == [{"id": 7}]
    assert _handled(tmp_path) == set(ROWS) - {7}
    _passed_the_batch(tmp_path)


def test_fan_out_dead_letters_the_row_for_the_subscriber_that_died_on_it_only(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Before, fan-out refused with CrashLoopError even with a sink. Now each row
    is handed alone to each subscriber alone, (subscriber, row) written first:
    row 7 is dead-lettered for 'crashy' (which killed the process on it), and
    'billing' gets it as every other row, once in the rows handed alone."""
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    sink = tmp_path / "dead-letters.jsonl"
    runs = _restart_until_settled(
        sqlite_db, tmp_path, restarts=MAX_ATTEMPTS + 5, sink=sink, fanout=True
    )
    codes = [run.returncode for run in runs]
    assert codes == [1] * (MAX_ATTEMPTS + 1) + [0], (codes, runs[-1].stderr[-2000:])
    letters = _letters(sink)
    assert [letter["pk"] for letter in letters] == [{"id": 7}]
    assert str(letters[0]["error"]).startswith("ProcessDied: "), letters[0]["error"]
    assert "crashy" in str(letters[0]["error"]), letters[0]["error"]
    assert "billing" not in str(letters[0]["error"]), letters[0]["error"]
    assert _handled(tmp_path) == set(ROWS) - {7}, "crashy got every other row"
    calls = [line.split() for line in (tmp_path / "handled.log.billing").read_text().splitlines()]
    assert {int(row) for row, _ in calls} == set(ROWS), "billing got every row, 7 too"
    alone = collections.Counter(int(row) for row, size in calls if size == "1")
    assert alone == dict.fromkeys(range(6, 11), 1), "each row of the batch once, handed alone"
    assert "killed the process delivering it alone" in runs[-1].stderr, runs[-1].stderr
    _passed_the_batch(tmp_path)


def test_fan_out_the_others_settle_the_killer_row_by_their_own_outcome(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """billing asks for a retry of row 7 the first two times it is handed it
    alone: in the run that crashy then kills, and in the run after, which finds
    the row killed the process in crashy. The row then waits for billing only
    (crashy gave it up, as if it had used its max_attempts), billing is handed
    it once more and accepts it, and only then is it dead-lettered, in crashy's
    name alone."""
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    sink = tmp_path / "dead-letters.jsonl"
    runs = _restart_until_settled(
        sqlite_db,
        tmp_path,
        restarts=MAX_ATTEMPTS + 5,
        sink=sink,
        fanout=True,
        extra=("--billing-retries", "7"),
    )
    codes = [run.returncode for run in runs]
    assert codes == [1] * (MAX_ATTEMPTS + 1) + [0], (codes, runs[-1].stderr[-2000:])
    calls = (tmp_path / "handled.log.billing").read_text().splitlines()
    sevens = [line for line in calls if line.split()[0] == "7"]
    alone = sevens[sevens.index("7 1 retry") :]
    assert alone[:2] == ["7 1 retry", "7 1 retry"], sevens
    assert len(alone) == 3, sevens  # then once more, accepted
    assert "retry" not in alone[2], sevens
    letters = _letters(sink)
    assert [letter["pk"] for letter in letters] == [{"id": 7}]
    # Dead-lettered on the tick billing accepted it: crashy had given it up.
    assert str(letters[0]["error"]).startswith("RetriesExhausted: crashy: "), letters[0]
    assert "billing" not in str(letters[0]["error"]), letters[0]["error"]
    assert _handled(tmp_path) == set(ROWS) - {7}
    _passed_the_batch(tmp_path)


def test_deaths_outside_the_handler_calls_end_in_a_refusal_not_a_loop(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """Row 7 kills the process when handed alone, and so does the dead-letter
    sink's write of it (a row too big for memory: handling it and serialising it
    both run out). Each run found row 7 named, wrote it to the sink and died
    there, with no row handed alone at the time: before, that went on for ever;
    now, once max_attempts deaths in a row named no row, the tick refuses with
    CrashLoopError saying the deaths came outside the handler calls."""
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    sink = tmp_path / "dead-letters.jsonl"
    runs = _restart_until_settled(
        sqlite_db, tmp_path, restarts=3 * MAX_ATTEMPTS + 3, sink=sink, extra=("--die-in-sink",)
    )
    codes = [run.returncode for run in runs]
    # max_attempts deaths of the whole batch, one of row 7 alone, then max_attempts
    # in the sink's write, each run handing 8-10 over no more (written as done).
    assert codes == [1] * (2 * MAX_ATTEMPTS + 1) + [3], codes
    refusal = runs[-1].stderr
    assert "CrashLoopError" in refusal, refusal
    assert "outside every handler call" in refusal, refusal
    assert "of which 1 named the row handed alone" in refusal, refusal
    assert checkpoint_id(FileCheckpointStore(tmp_path / "state")) == 5
    assert _handled(tmp_path) == set(range(1, 11)) - {7}


def test_each_row_that_killed_the_process_stays_named_across_later_steps() -> None:
    """The pure rule behind the first test: the takeover that counts a death adds
    the row then handed alone to ``killed``; a later step naming another row
    does not take it off, and the document keeps the list."""
    doc = _doc(Lease("b", 5, T0, T0, T0 + TTL), _record(3, 3))

    def step_and_die(doc: StateDocument, owner: str, token: int, row: str) -> StateDocument:
        at = doc.lease.acquired_at if doc.lease is not None else T0
        stepped = L.decide_probe(
            doc, owner=owner, token=token, now=at, ttl=TTL, event_id=row, done=("ev-6",)
        )
        taken = L.decide_acquire(
            stepped,
            poller="p",
            fingerprint="fp",
            owner=f"{owner}+",
            now=at + TTL + dt.timedelta(seconds=6),
            ttl=TTL,
            count_deaths=True,
        )
        assert isinstance(taken, L.Acquired)
        return taken.document

    once = step_and_die(doc, "b", 5, "ev-7")
    assert once.failure is not None
    assert once.failure.killed == ("ev-7",)
    assert once.lease is not None
    twice = step_and_die(once, once.lease.owner_id, once.lease.fencing_token, "ev-9")
    assert twice.failure is not None
    assert (twice.failure.killed, twice.failure.attempts) == (("ev-7", "ev-9"), 5)
    read = docmod.loads(docmod.dumps(twice))
    assert read.failure is not None
    assert read.failure.killed == ("ev-7", "ev-9")


def test_isolating_stops_once_max_attempts_deaths_name_no_row() -> None:
    """The pure rule: while rows are handed alone each death should name one
    (``killed``); max_attempts deaths beyond the first max_attempts that did not
    end the isolation with a refusal instead of another round."""
    ids = ("ev-7",)
    outside = C.AfterDeaths.OUTSIDE
    assert (
        C.after_deaths(_killed(5, ids), max_attempts=3, can_isolate=True) is C.AfterDeaths.ISOLATE
    )
    assert C.after_deaths(_killed(6, ()), max_attempts=3, can_isolate=True) is outside
    assert C.after_deaths(_killed(7, ids), max_attempts=3, can_isolate=True) is outside
    # Several rows that each killed it alone: one death each, never "outside".
    many = tuple(f"ev-{i}" for i in range(5))
    assert (
        C.after_deaths(_killed(8, many), max_attempts=3, can_isolate=True) is C.AfterDeaths.ISOLATE
    )
    # Without a sink nothing is isolated: refused as before.
    assert C.after_deaths(_killed(7, ids), max_attempts=3) is C.AfterDeaths.REFUSE


def _killed(crashes: int, killed: tuple[str, ...]) -> FailureRecord:
    return evolve(_record(crashes, crashes), killed=killed)
