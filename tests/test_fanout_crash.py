"""A fan-out subscriber that ends the whole process mid-batch (``os._exit(1)``
in its call), under ``dbtrigger run``: after a restart every subscriber has
every event at least once, and neither gets again more than the batch that
was in flight - the one that had accepted it included. The kill chaos
(tests/test_chaos.py) kills at random moments; this one lands on the batch a
subscriber was inside, every run.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore
from dbtrigger.cli import main
from tests.chaos.forked import ForkedProcess, Forker
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_table, read_doc

ROWS = 30  # three batches of ten
CRASH_AT = 15  # in the second


def seen(work: Path, name: str) -> collections.Counter[int]:
    log = work / f"{name}.log"
    lines = log.read_text().split() if log.exists() else []
    return collections.Counter(int(line) for line in lines)


def finished(proc: ForkedProcess, timeout: float = 120) -> int:
    done = threading.Event()
    timer = threading.Timer(timeout, done.set)
    timer.start()
    try:
        while proc.poll() is None:
            if done.wait(0.05):
                raise AssertionError("the worker did not end in time")
        return proc.returncode or 0
    finally:
        timer.cancel()


@pytest.mark.timeout(240)
def test_a_subscriber_that_ends_the_process_mid_batch_loses_nothing_and_floods_no_one(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # release-lease keeps its backup in ./dbtrigger-backups
    add_items(sqlite_db, items_table(sqlite_db), list(range(1, ROWS + 1)))
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "FANOUT_CRASH_WORK": str(work),
        "FANOUT_CRASH_AT": str(CRASH_AT),
        "FANOUT_CRASH_DB": sqlite_db.url,
    }
    run = ["run", "tests.chaos.fanout_crash_app:trigger", "--interval", "0.1"]
    state = FileCheckpointStore(work / "state")
    with Forker("dbtrigger.cli") as forker:
        first = forker.start(run, tmp_path / "first.log", env)
        assert finished(first) == 1, (tmp_path / "first.log").read_text()
        assert (work / "crashed").exists()
        doc = read_doc(state, "orders")
        assert doc.checkpoint is not None
        assert doc.checkpoint.position.pk == {"id": 10}  # the second batch never committed

        # The operator frees the dead worker's lease (its log says how) and restarts it.
        release = ["release-lease", "orders", "--store", str(work / "state"), "--force"]
        assert main([*release, "--reason", "its worker crashed", "--yes"]) == 0
        second = forker.start([*run, "--max-ticks", "3"], tmp_path / "second.log", env)
        assert finished(second) == 0, (tmp_path / "second.log").read_text()

    doc = read_doc(state, "orders")
    assert doc.checkpoint is not None
    assert doc.checkpoint.position.pk == {"id": ROWS}
    assert doc.window is None
    in_flight = set(range(11, 21))
    for name in ("billing", "crashy"):
        counts = seen(work, name)
        assert sorted(counts) == list(range(1, ROWS + 1)), name  # every event, at least once
        again = {i for i, n in counts.items() if n > 1}
        assert again <= in_flight, (name, sorted(again))  # only the batch in flight
        assert max(counts.values()) <= 2, name
    assert set(seen(work, "crashy")) >= {CRASH_AT}
    assert seen(work, "crashy")[CRASH_AT] == 1  # it never recorded the row it died on
