"""Fan-out: a subscriber stuck on one key does not starve the others before
the window's 75% mark, and says so once it does.

With ``retry_delay_seconds=0`` and no dead-letter sink, the events a
subscriber fails for ever are due again at every read: the first change of
the key it fails, and the later changes of that key, held with it (per-key
order) and owed to it too. Those due retries took the whole batch on every
tick, so the healthy subscriber got no new row at all, the window never
reached its 75% mark and ``window_blocked`` was never said. Due retries now
take at most half a batch while new rows wait (:func:`dbtrigger.state.window.plan`).
"""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cursor import Position
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import window as windowmod
from dbtrigger.state.window import Bound, Pending, Window
from dbtrigger.testing.memory_log import MemoryLogSource

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def test_due_retries_leave_half_the_batch_to_new_rows() -> None:
    waiting = [Position(i, {"id": 1}) for i in range(1, 7)]
    window = Window(
        pending=tuple(Pending(p, attempts=1, not_before=NOW, reason="down") for p in waiting),
    )
    fresh = [Position(i, {"id": i}) for i in range(7, 13)]
    keys = [windowmod.key_of(p) for p in waiting + fresh]
    sizes = [windowmod.entry_size(p) for p in waiting + fresh]
    plan = windowmod.plan(keys, sizes, window, now=NOW, batch_size=4, bound=Bound())
    assert plan.deliver == (0, 1, 6, 7)  # two due retries, two new rows
    assert plan.new == 2
    # With fewer new rows than half the batch, the retries take the rest.
    plan = windowmod.plan(keys[:7], sizes[:7], window, now=NOW, batch_size=4, bound=Bound())
    assert plan.deliver == (0, 1, 2, 6)


def test_a_subscriber_stuck_on_one_key_leaves_the_others_new_rows_until_the_mark(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dbtrigger")
    source = MemoryLogSource()
    for version in range(150):  # one key, changed often: the stuck subscriber fails each
        source.commit([{"op": "update", "pk": {"id": 1}, "after": {"id": 1, "v": version}}])
    for i in range(2, 3000):
        source.commit([{"op": "insert", "pk": {"id": i}, "after": {"id": i}}])
    good: list[int] = []

    def healthy(events: list[RowChange]) -> None:
        good.extend(int(e.pk["id"]) for e in events if e.pk["id"] != 1)

    def stuck(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            if e.pk["id"] == 1:
                ctx.retry(e, "downstream refuses key 1")

    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        subscribers={"good": healthy, "stuck": stuck},
        retry_delay_seconds=0,
    )

    def blocked() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "event", None) == "window_blocked"]

    for _ in range(100):  # a bound, not a count: each tick hands out a batch
        trigger.tick()
        if blocked():
            break
    assert blocked(), f"the window never said it blocks; good got {len(good)} new row(s)"
    state = trigger.read_state()
    assert state.window is not None
    assert Bound().under_pressure(state.window)  # the others ran on up to the 75% mark
    assert len(good) >= 100
    assert good == sorted(set(good))  # each new row once, in order
    message = blocked()[0].getMessage()
    assert "stuck" in message
    assert "good" not in message
