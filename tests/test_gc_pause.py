"""The collector is paused only while a batch is built, and always resumed."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import dbtrigger._gc
from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger._gc import gc_paused, older_objects_frozen
from dbtrigger.cursor import Position
from dbtrigger.event_identity import make_event_id


class RecordingSource:
    """A tiny source that notes whether the collector ran while it worked."""

    name = "memory:rows"

    def __init__(self, n: int) -> None:
        self.rows = [{"id": i, "c": i} for i in range(n)]
        self.enabled_during: list[tuple[str, bool]] = []

    def fingerprint(self) -> str:
        return "sha256:test"

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        self.enabled_during.append(("fetch", gc.isenabled()))
        start = 0 if after.is_beginning else after.cursor + 1
        return self.rows[start : start + limit]

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        self.enabled_during.append(("to_events", gc.isenabled()))
        return [
            RowChange(
                event_id=make_event_id(poller, {"id": r["id"]}, r["c"]),
                op="upsert",
                source=self.name,
                cursor=r["c"],
                pk={"id": r["id"]},
                before=None,
                after=dict(r),
            )
            for r in rows
        ]

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


@pytest.fixture
def collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.usefixtures("collector_enabled")
def test_paused_while_building_and_running_for_the_handler() -> None:
    source = RecordingSource(25)
    trigger = PollTrigger(
        name="p", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=10
    )
    during_handler: list[bool] = []
    assert trigger.drain(lambda events: during_handler.append(gc.isenabled())) == 25
    assert source.enabled_during
    assert all(not enabled for _, enabled in source.enabled_during)
    assert during_handler == [True, True, True]
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_enabled")
def test_resumed_after_an_error() -> None:
    def fail_while_paused() -> None:
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_while_paused()
    assert gc.isenabled()


def test_leaves_a_disabled_collector_disabled() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


@pytest.mark.usefixtures("collector_enabled")
def test_older_objects_are_frozen_for_the_tick_only() -> None:
    assert gc.get_freeze_count() == 0
    older = [object() for _ in range(10)]  # tracked objects that exist before the tick
    source = RecordingSource(25)
    trigger = PollTrigger(
        name="p", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=10
    )
    frozen_during: list[int] = []
    assert trigger.drain(lambda events: frozen_during.append(gc.get_freeze_count())) == 25
    assert len(frozen_during) == 3
    assert all(count > len(older) for count in frozen_during)
    assert gc.get_freeze_count() == 0  # everything is back in the collector's view
    del older


@pytest.mark.usefixtures("collector_enabled")
def test_nested_freezes_share_one_and_an_application_freeze_is_left_alone() -> None:
    # Frozen objects can be freed meanwhile (a daemon thread of an earlier test dropping
    # its last reference), so the count may fall a little between two reads; what a
    # second freeze or an unfreeze would do is far larger than that.
    with older_objects_frozen():
        first = gc.get_freeze_count()
        assert first > 0
        fresh = [[] for _ in range(20_000)]  # containers a second freeze would take in
        with older_objects_frozen():
            assert 0 < gc.get_freeze_count() < first + len(fresh) // 2  # no second freeze
        assert gc.get_freeze_count() > first // 2  # the inner exit did not unfreeze
        del fresh
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the application's own (e.g. before forking workers)
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            pass
        assert gc.get_freeze_count() > frozen // 2  # not unfrozen by us
    finally:
        gc.unfreeze()


def test_a_disabled_collector_is_not_frozen() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        if was:
            gc.enable()


class _Cycle:
    """An object in a reference cycle with itself: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self
        self.payload = [[] for _ in range(20)]  # tracked containers, as a batch's events are


@pytest.mark.usefixtures("collector_enabled")
def test_garbage_left_at_the_end_of_each_tick_is_collected_while_ticks_follow_each_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each stretch drops a cycle as its last act; the next stretch's freeze took it
    # out of the collector's view with everything else, so with stretches back to
    # back (a drain) no full collection ever saw it: memory grew for as long as the
    # drain ran. A full collection now runs before a freeze when the oldest
    # generation has grown as much as the collector's own rule allows. (The rule
    # is relative to the process's size; a test process's varies, so it is made
    # absolute here: a collection per 20,000 blocks of growth.)
    monkeypatch.setattr(dbtrigger._gc, "GROWTH", 0.0)
    monkeypatch.setattr(dbtrigger._gc, "FLOOR", 20_000)
    monkeypatch.setattr(dbtrigger._gc, "_collected_at", 0)
    gc.collect()
    refs: list[weakref.ref[_Cycle]] = []
    stretches = 3_000
    for _ in range(stretches):
        with older_objects_frozen():
            cycle = _Cycle()
            refs.append(weakref.ref(cycle))
            del cycle
    alive = sum(1 for ref in refs if ref() is not None)
    assert alive < stretches // 3, f"{alive} of {stretches} cycles never collected"
    assert gc.get_freeze_count() == 0


def test_a_drain_of_many_ticks_does_not_keep_each_ticks_garbage() -> None:
    # In a fresh process of a worker's size, with the rule as it ships: in the test
    # runner every full collection would walk the whole suite's objects.
    script = Path(__file__).parent / "chaos" / "drain_garbage.py"
    done = subprocess.run(
        [sys.executable, str(script), "2000"],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    alive, total, delivered = map(int, done.stdout.split())
    assert (total, delivered) == (2_000, 4_000)
    assert alive < total // 3, f"{alive} of {total} handlers' cycles never collected"
