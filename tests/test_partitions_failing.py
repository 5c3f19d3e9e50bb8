"""A partition that keeps failing (a poison row, no dead-letter sink) holds back its
own rows only: it backs off on its own while the member's other partitions go on.

Before, the member's round raised and the worker backed the whole member off
(doubling up to five minutes), so every healthy partition it owned waited as
long, and the rows those partitions committed in the failing round were not
counted in the worker's totals.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import types
import uuid
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, RowChange
from dbtrigger.cli import main
from dbtrigger.cli.common import read_state
from dbtrigger.errors import HandlerError, LostLeaseError
from dbtrigger.partitions import PartitionedPoller, bucket_of
from dbtrigger.runtime.runner import Runner
from dbtrigger.runtime.trigger import TickResult
from dbtrigger.state.document import StateDocument
from tests.databases import TestDatabase
from tests.test_partitions_poller import Clock, insert, make_table, member

POISON = 7


def store_state(store: FileCheckpointStore, key: str) -> StateDocument:
    return read_state(store, key)[0]


def partition_of(poller: PartitionedPoller, key: int) -> str:
    bucket = bucket_of([key])
    assert poller.membership is not None
    (pid,) = [p.id for p in poller.membership.partitions if p.lo <= bucket < p.hi]
    return pid


def test_a_failing_partition_backs_off_alone(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    make_table(sqlite_db, 40)
    clock = Clock()
    poller = member(sqlite_db, FileCheckpointStore(tmp_path / "state"), "a", clock)
    seen: list[int] = []
    poison_calls: list[int] = []

    def handle(events: list[RowChange]) -> None:
        if any(e.pk["id"] == POISON for e in events):
            poison_calls.append(1)
            raise ValueError("poison row")
        seen.extend(e.pk["id"] for e in events)

    runner = Runner(poller, handle, interval_seconds=5, progress=None)
    poller.balance()
    bad = partition_of(poller, POISON)
    for _ in range(3):  # three rounds, the poison partition failing in each
        runner._tick_once()
        clock.now += 60  # past any partition backoff: the poison partition is tried again
    assert len(poison_calls) == 3
    assert poller.last_result is not None
    assert poller.last_result.failing_partitions == (bad,)
    healthy = {i for i in range(1, 41) if partition_of(poller, i) != bad}
    assert set(seen) == healthy
    # The worker counted the rows the healthy partitions committed in the failing
    # rounds, and its next round is due at its interval, not after a doubled backoff.
    assert runner.stats.rows == len(healthy)
    assert runner._tick_once() == 5
    # New rows in the healthy partitions are delivered by the very next round, while
    # the poison partition, still backing off, is not tried (the clock stood still).
    insert(sqlite_db, range(100, 120))
    calls = len(poison_calls)
    runner._tick_once()
    fresh = {i for i in range(100, 120) if partition_of(poller, i) != bad}
    assert fresh <= set(seen)
    assert len(poison_calls) == calls
    clock.now += 600
    with pytest.raises(HandlerError):
        poller.tick(handle)
    assert len(poison_calls) == calls + 1  # due again: tried again


def test_a_partition_lost_to_another_member_is_not_backed_off(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another member's lease on a partition is the protocol working, not a failure:
    the partition is not benched (nor reported as failing) for it."""
    make_table(sqlite_db, 10)
    clock = Clock()
    poller = member(sqlite_db, FileCheckpointStore(tmp_path / "state"), "a", clock)
    poller.balance()
    taken = poller.owned[0]

    def lost(*args: object, **kwargs: object) -> None:
        raise LostLeaseError("another member took the partition over")

    monkeypatch.setattr(poller._triggers[taken], "tick_result", lost)
    with pytest.raises(LostLeaseError):
        poller.tick(lambda events: None)
    assert poller.last_result is not None
    assert poller.last_result.failing_partitions == ()
    assert not poller._backoff.waiting(taken)


def test_an_idle_line_with_rows_waiting_never_says_nothing_after_or_lag_0() -> None:
    """A worker's idle line said "nothing after the checkpoint ...; lag 0 rows" while an
    event waited for a retry (or a partition was failing), and `dbtrigger status`
    counted those rows behind the checkpoint at the same moment."""
    due = dt.datetime(2026, 11, 27, 17, 39, 6, tzinfo=dt.timezone.utc)
    waiting = TickResult(0, 0, "idle", waiting_retries=1, next_retry_at=due)
    failing = TickResult(0, 0, "idle", partitions=4, failing_partitions=("p064-128",))
    for result in (waiting, failing):
        text, _ = result.summary(5)
        assert "nothing after" not in text, text
        assert "lag 0 rows" not in text, text
    assert "1 event(s) waiting for a retry, the next due at 17:39:06Z" in waiting.summary(5)[0]
    assert "partition(s) p064-128 failing" in failing.summary(5)[0]
    assert "nothing after the checkpoint" in TickResult(0, 0, "idle").summary(5)[0]


def test_skip_batch_of_a_partition_checks_it_against_the_partitions_own_rows(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The poison_batch ERROR of a partition prints `dbtrigger skip-batch orders.pXXX
    --source MODULE:ATTR ...`; with the PartitionedPoller as MODULE:ATTR it was refused
    ("the --source definition differs from this poller's (fingerprint)"): the check
    read the whole table, while the partition's document was written from its range."""
    make_table(sqlite_db, 40)
    store = FileCheckpointStore(tmp_path / "state")
    poller = member(sqlite_db, store, "a", Clock())
    poller.balance()
    bad = partition_of(poller, POISON)

    def handle(events: list[RowChange]) -> None:
        if any(e.pk["id"] == POISON for e in events):
            raise ValueError("poison row")

    with pytest.raises(HandlerError):
        poller.tick(handle)
    module = f"failing_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.orders = member(sqlite_db, store, "cli", Clock())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    # `status` of that partition with the same --source said its fingerprint DIFFERS
    # and its lag was unknown, for the same reason.
    assert main(["status", f"orders.{bad}", "--source", f"{module}:orders", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["fingerprint_matches_source"] is True, shown
    assert shown["lag"]["rows"] == sum(1 for i in range(1, 41) if partition_of(poller, i) == bad)
    # `reset --accept-source` with the PartitionedPoller stamped the whole table's
    # fingerprint on the partition's document (whose next tick then refused it).
    before = store_state(store, f"orders.{bad}").source_fingerprint
    accept = ["reset", f"orders.{bad}", "--accept-source", f"{module}:orders", "--reason", "r"]
    main([*accept, "--yes"])
    assert store_state(store, f"orders.{bad}").source_fingerprint == before
    capsys.readouterr()
    argv = ["skip-batch", f"orders.{bad}", "--source", f"{module}:orders", "--reason", "poison"]
    assert main([*argv, "--yes"]) == 0, capsys.readouterr().err
    doc = store_state(store, f"orders.{bad}")
    skipped = doc.journal[-1]["skipped_keys"]
    assert {"id": POISON} in skipped
    assert all(partition_of(poller, k["id"]) == bad for k in skipped)
