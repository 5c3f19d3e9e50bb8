"""Two workers started together on a backlog, each SIGKILLed at an exact point -
one half way through a history line, the other between a commit and its
append - then a third finishes: the history holds exactly the committed
batches, numbered without a hole or a repeat, and a replay of the whole range
finds every batch as recorded.

The workers are tests/chaos/history_worker.py (a 1 s lease, so the survivor
takes over at once). ``DBTRIGGER_HISTORY_CHAOS_ROWS`` makes the backlog longer.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.history import history_for
from dbtrigger.history.records import detail_lines
from dbtrigger.replay.batches import plan
from tests.chaos.forked import Forker
from tests.databases import TestDatabase
from tests.test_history_runtime import (
    ROWS,
    _committed,
    _items,
    _wait,
    _worker,
    assert_chain,
    store_position_of,
)


def test_two_workers_killed_mid_write_and_mid_batch_leave_exactly_the_committed_batches(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    where = str(tmp_path / "state")
    store = FileCheckpointStore(where)
    _items(sqlite_db, ROWS)
    history = history_for(store)
    assert history is not None
    # Whichever leads first dies at its point; the other takes over and dies at its own.
    logs = [tmp_path / f"worker{n}.log" for n in range(3)]
    with Forker("tests.chaos.history_worker") as forker:
        dying = [
            _worker(forker, logs[0], sqlite_db, "file", where, None, "torn:2"),
            _worker(forker, logs[1], sqlite_db, "file", where, None, "append:2"),
        ]
        try:
            for proc in dying:
                _wait(lambda p=proc: p.poll() is not None)
        finally:
            for proc in dying:
                proc.kill()
                proc.wait(timeout=30)
        assert [proc.returncode for proc in dying] == [-9, -9]
        assert 0 < _committed(store) < ROWS
        last = _worker(forker, logs[2], sqlite_db, "file", where, None)
        try:
            _wait(lambda: _committed(store) == ROWS, timeout=120)
        finally:
            last.kill()
            last.wait(timeout=30)
    source = SqlAlchemySource(
        url=sqlite_db.url,
        table="items",
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",
    )
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    trigger = PollTrigger(name="items", source=source, checkpoint_store=store, clock=lambda: later)
    trigger.tick(lambda events: None)
    records = list(history.read("items"))
    assert_chain(records, ROWS, store_position_of(store, "items"))
    # Every row was delivered by some recorded batch (the killed ones' included).
    keys = set()
    for record in records:
        for line in detail_lines(record) or ():
            keys.add(line.key["id"][1])
    recovered = [r for r in records if r.get("type") == "commit" and "detail" not in r]
    assert len(keys) + sum(int(r["rows"]) for r in recovered) >= ROWS
    # Nothing changed in the table: the whole range replays as recorded.
    commits = [r for r in records if r.get("type") == "commit"]
    replay = plan(trigger, commits, records)
    assert not replay.drift
    assert all(b.identical or (b.recovered and b.whole) for b in replay.batches)
    assert not replay.refusals()
    source.close()
