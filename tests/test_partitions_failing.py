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
import logging
import sys
import types
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, RowChange
from dbtrigger.cli import main
from dbtrigger.cli.common import read_state
from dbtrigger.errors import HandlerError, LostLeaseError
from dbtrigger.partitions import PartitionedPoller, bucket_of
from dbtrigger.runtime.runner import Runner
from dbtrigger.runtime.trigger import TickResult
from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore
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
    the partition is not benched (nor reported as failing) for it, and the round
    does not raise (the round says more: the batch comes again, from its owner)."""
    make_table(sqlite_db, 10)
    clock = Clock()
    poller = member(sqlite_db, FileCheckpointStore(tmp_path / "state"), "a", clock)
    poller.balance()
    taken = poller.owned[0]

    def lost(*args: object, **kwargs: object) -> None:
        raise LostLeaseError("another member took the partition over")

    monkeypatch.setattr(poller._triggers[taken], "tick_result", lost)
    poller.tick(lambda events: None)
    assert poller.last_result is not None
    assert poller.last_result.more
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


class WritesAfter:
    """A store that records, once ``watching`` is set, who each partition state
    write that landed was made under (the lease owner it names) and the
    checkpoint it leaves."""

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self.watching = False
        self.writes: list[tuple[str, str | None, object]] = []

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        etag = self.inner.write(key, data, if_match=if_match)  # a refused write raises
        if self.watching and not key.endswith(".members"):
            doc = docmod.loads(data)
            owner = doc.lease.owner_id if doc.lease is not None else None
            self.writes.append((key, owner, doc.position if doc.checkpoint else None))
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_partition_taken_over_mid_drain_ends_no_drain(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """Under load a member's batch outlasted the member TTL: another member declared
    it dead, took its partitions and fenced the lease of the batch in flight, whose
    commit was then refused. ``drain()`` raised that LostLeaseError, though what the
    member still owned was drained and the batch comes again from the new owner
    (at-least-once). Now the member's round goes on with what it still owns, says
    the loss at WARNING, and writes nothing more to a partition taken from it."""
    make_table(sqlite_db, 200)
    store = WritesAfter(InMemoryCheckpointStore())
    a_clock, b_clock = Clock(), Clock()  # each member's own liveness clock
    a = member(sqlite_db, store, "a", a_clock, batch_size=10)  # type: ignore[arg-type]
    b = member(sqlite_db, store, "b", b_clock, batch_size=10)  # type: ignore[arg-type]
    a.balance()
    assert len(a.owned) == 4
    delivered: Counter[int] = Counter()
    in_flight: list[int] = []
    taken: list[str] = []

    def a_handles(events: list[RowChange], ctx: Any) -> None:
        delivered.update(e.pk["id"] for e in events)
        if taken:
            return
        # a stalls in this batch: b sees a's heartbeat stand still past the member TTL
        # on its own clock, takes every partition and fences a's lease on this one.
        in_flight.extend(e.pk["id"] for e in events)
        taken.append(ctx.poller_name.removeprefix("orders."))
        for _ in range(3):
            b.balance()
            b_clock.now += 2
        assert set(b.owned) == set(a.owned)
        store.watching = True

    with caplog.at_level(logging.WARNING, logger="dbtrigger.partitions"):
        a.drain(a_handles)  # raised LostLeaseError
    assert taken, "no takeover"
    lost = [r for r in caplog.records if getattr(r, "event", "") == "partition_taken_over"]
    assert [getattr(r, "partition", None) for r in lost] == taken
    assert not any(owner == "a" for _, owner, _ in store.writes), store.writes
    assert a.owned == ()
    b.drain(lambda events: delivered.update(e.pk["id"] for e in events))
    assert set(delivered) == set(range(1, 201)), "a row was lost"
    again = {i for i, n in delivered.items() if n > 1}
    assert again == set(in_flight), "only the batch in flight is delivered twice"
