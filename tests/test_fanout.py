"""Fan-out: one read, several subscribers (``PollTrigger(..., subscribers=...)``).

The pure settle logic (dbtrigger.state.fanout) table by table, then the real
thing on SQLite, PostgreSQL and MariaDB with the file and Blob stores: every
subscriber gets every event from one fetch, a retry goes back to the
subscribers that asked for it only (across restarts), a reject dead-letters
the event once, a raising or hung subscriber fails its own events only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.errors import ConfigurationError, PartialBatchError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state.fanout import (
    ACCEPT,
    Fate,
    Tally,
    decide,
    fail,
    fan_out_set,
    reject,
)
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.window import Window
from dbtrigger.testing import MemorySource
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    items_source,
    items_table,
    make_trigger,
    read_doc,
    wait_for,
)
from tests.test_blob_store import make_store, new_container
from tests.test_event_outcomes import Clock

# --- the pure decisions, table by table -----------------------------------------------

# (description, handed, results, max_attempts, has_sink, fate, owed, exhausted)
DECIDE = [
    ("all accept", {"a": 0, "b": 0}, {"a": ACCEPT, "b": ACCEPT}, 5, True, Fate.SETTLED, {}, False),
    ("one accepts alone", {"a": 0}, {"a": ACCEPT}, 5, False, Fate.SETTLED, {}, False),
    (
        "one retries: owed to it only",
        {"a": 0, "b": 0},
        {"a": ACCEPT, "b": fail("busy")},
        5,
        True,
        Fate.PENDING,
        {"b": 1},
        False,
    ),
    (
        "both retry: owed to both, counts carried",
        {"a": 2, "b": 0},
        {"a": fail("x"), "b": fail("y")},
        5,
        True,
        Fate.PENDING,
        {"a": 3, "b": 1},
        False,
    ),
    (
        "a reject dead-letters, whatever the others did",
        {"a": 0, "b": 0},
        {"a": reject("bad"), "b": fail("busy")},
        5,
        True,
        Fate.DEAD_LETTER,
        {},
        False,
    ),
    (
        "a reject with the others accepting",
        {"a": 0, "b": 0},
        {"a": ACCEPT, "b": reject("bad")},
        5,
        True,
        Fate.DEAD_LETTER,
        {},
        False,
    ),
    (
        "last attempt of one subscriber, with a sink: dead-lettered as exhausted",
        {"a": 0, "b": 4},
        {"a": ACCEPT, "b": fail("busy")},
        5,
        True,
        Fate.DEAD_LETTER,
        {},
        True,
    ),
    (
        "last attempt without a sink: held, still owed",
        {"a": 0, "b": 4},
        {"a": ACCEPT, "b": fail("busy")},
        5,
        False,
        Fate.PENDING,
        {"b": 5},
        False,
    ),
    (
        "no result from a subscriber is a failure (timed out)",
        {"a": 0, "b": 0},
        {"a": ACCEPT},
        5,
        True,
        Fate.PENDING,
        {"b": 1},
        False,
    ),
]


@pytest.mark.parametrize(
    ("handed", "results", "max_attempts", "sink", "fate", "owed", "exhausted"),
    [row[1:] for row in DECIDE],
    ids=[row[0] for row in DECIDE],
)
def test_decide(
    handed: dict[str, int],
    results: dict[str, Any],
    max_attempts: int,
    sink: bool,
    fate: Fate,
    owed: dict[str, int],
    exhausted: bool,
) -> None:
    d = decide(handed, results, max_attempts=max_attempts, has_sink=sink)
    assert (d.fate, dict(d.owed), d.exhausted) == (fate, owed, exhausted)


def test_decide_names_every_subscriber_in_the_reason() -> None:
    d = decide(
        {"a": 0, "b": 0}, {"a": reject("bad"), "b": fail("429")}, max_attempts=5, has_sink=True
    )
    assert d.reason == "a: bad; b: 429"
    assert d.tally == Tally(accepted=0, rejected=1, failed=1)


def test_a_zero_subscriber_hand_out_is_not_clean() -> None:
    assert not Tally().is_clean
    assert Tally(accepted=2).is_clean
    assert not Tally(accepted=2, failed=1).is_clean
    assert not Tally(accepted=2, rejected=1).is_clean
    with_sink = decide({}, {}, max_attempts=5, has_sink=True, gone=("search",))
    assert (with_sink.fate, with_sink.reason) == (
        Fate.DEAD_LETTER,
        "search: unsubscribed before resolving it",
    )
    held = decide({}, {}, max_attempts=5, has_sink=False, gone=("search",))
    assert held.fate is Fate.PENDING  # never settled as delivered


# (description, owed, configured, handed, gone)
FAN = [
    ("a new event goes to everyone", None, ["a", "b"], {"a": 0, "b": 0}, ()),
    ("a waiting event goes to its owed set only", {"b": 2}, ["a", "b"], {"b": 2}, ()),
    ("a subscriber added later is not owed it", {"b": 1}, ["a", "b", "c"], {"b": 1}, ()),
    ("a removed subscriber counts as gone", {"b": 1, "c": 1}, ["a", "b"], {"b": 1}, ("c",)),
    ("all owed subscribers gone: nobody", {"c": 1}, ["a"], {}, ("c",)),
]


@pytest.mark.parametrize(
    ("owed", "configured", "handed", "gone"),
    [row[1:] for row in FAN],
    ids=[row[0] for row in FAN],
)
def test_fan_out_set_is_frozen_at_hand_out(
    owed: dict[str, int] | None,
    configured: list[str],
    handed: dict[str, int],
    gone: tuple[str, ...],
) -> None:
    assert fan_out_set(owed, configured) == (handed, gone)


# --- on real databases and stores --------------------------------------------------------


@dataclass
class Sub:
    """A scripted subscriber: pk -> outcomes per delivery ("accept", "reject",
    "retry", "raise"); past the end of a list, accept."""

    name: str
    script: dict[int, list[str]] = field(default_factory=dict)
    seen: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    attempts: dict[int, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        assert ctx.subscriber == self.name
        failing = []
        for e in events:
            pk = int(e.pk["id"])
            with self.lock:
                self.seen.append(pk)
                n = self.seen.count(pk) - 1
            self.attempts.setdefault(pk, []).append(ctx.attempts(e))
            plan = self.script.get(pk, [])
            what = plan[n] if n < len(plan) else "accept"
            if what == "reject":
                ctx.reject(e, f"{self.name} rejects {pk}")
            elif what == "retry":
                ctx.retry(e, f"{self.name} busy {pk}")
            elif what == "raise":
                failing.append(dict(e.pk))
            else:
                self.accepted.append(pk)
        if failing:
            raise PartialBatchError(failing, f"{self.name} failed")


@pytest.fixture(params=["file", "blob"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    if request.param == "file":
        yield FileCheckpointStore(tmp_path / "state")
        return
    azurite = request.getfixturevalue("azurite")
    for container in new_container(azurite):
        blob = make_store(azurite, container)
        yield blob
        blob.close()


def checkpoint_id(store: CheckpointStore) -> int | None:
    """The checkpoint's id; None at the beginning (nothing settled yet)."""
    doc = read_doc(store)
    return None if doc.checkpoint is None or not doc.position.pk else int(doc.position.pk["id"])


def fetches(metrics: InMemoryMetrics) -> int:
    return sum(
        len(v) for (n, _), v in metrics.observations.items() if n == "fetch_duration_seconds"
    )


def fan_trigger(
    db: TestDatabase,
    store: CheckpointStore,
    clock: Clock,
    tmp_path: Path,
    subs: list[Sub],
    **kwargs: Any,
) -> tuple[Any, JsonLinesQuarantineSink]:
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    kwargs.setdefault("quarantine", sink)
    kwargs.setdefault("retry_delay_seconds", 10)
    trigger = make_trigger(
        items_source(db), store, clock=clock, subscribers={s.name: s for s in subs}, **kwargs
    )
    return trigger, sink


def test_one_read_every_subscriber_and_a_retry_goes_back_to_its_subscriber_only(
    db: TestDatabase, store: CheckpointStore, tmp_path: Path
) -> None:
    table = items_table(db)
    add_items(db, table, range(1, 7))
    clock = Clock()
    metrics = InMemoryMetrics()
    billing = Sub("billing")
    search = Sub("search", {2: ["retry"]})
    trigger, sink = fan_trigger(
        db, store, clock, tmp_path, [billing, search], batch_size=6, metrics=metrics
    )

    assert trigger.tick() == 6
    assert billing.seen == search.seen == [1, 2, 3, 4, 5, 6]
    assert fetches(metrics) == 1  # one read for both subscribers
    assert checkpoint_id(store) == 1  # 2 waits for search
    [pending] = (read_doc(store).window or Window()).pending
    assert (int(pending.position.pk["id"]), pending.owed) == (2, {"search": 1})
    outcomes = read_doc(store).journal[-1]["outcomes"]
    assert outcomes["subscribers"] == {
        "billing": {"accepted": 6, "rejected": 0, "failed": 0},
        "search": {"accepted": 5, "rejected": 0, "failed": 1},
    }
    assert metrics.total("subscriber_outcomes_total", subscriber="search", outcome="failed") == 1
    assert metrics.total("subscriber_outcomes_total", subscriber="billing", outcome="accepted") == 6

    # A restart (a new trigger object) still knows who owes event 2.
    billing2, search2 = Sub("billing"), Sub("search")
    trigger, _ = fan_trigger(db, store, clock, tmp_path, [billing2, search2], batch_size=6)
    assert trigger.tick_result().outcome == "idle"  # not due yet
    clock.advance(11)
    assert trigger.tick() == 1
    assert billing2.seen == []  # billing accepted it already: never again
    assert search2.seen == [2]
    assert search2.attempts[2] == [2]
    assert checkpoint_id(store) == 6
    assert read_doc(store).window is None
    assert list(sink.records()) == []


def test_a_reject_dead_letters_the_event_once_naming_each_subscriber(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 5))
    store = FileCheckpointStore(tmp_path / "state")
    billing = Sub("billing", {3: ["retry"]})
    search = Sub("search", {3: ["reject"]})
    trigger, sink = fan_trigger(sqlite_db, store, Clock(), tmp_path, [billing, search])

    assert trigger.drain() == 4
    records = list(sink.records())
    assert [(int(r.pk["id"]), r.error) for r in records] == [
        (3, "EventRejected: billing: billing busy 3; search: search rejects 3")
    ]
    assert checkpoint_id(store) == 4  # settled: terminal for the event
    assert read_doc(store).window is None
    assert trigger.drain() == 0
    assert billing.seen == search.seen == [1, 2, 3, 4]


def test_a_raising_subscriber_fails_its_own_events_only(db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(db)
    add_items(db, table, range(1, 5))
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    billing = Sub("billing")
    search = Sub("search", {2: ["raise", "raise"], 4: ["raise"]})
    trigger, _ = fan_trigger(db, store, clock, tmp_path, [billing, search])

    assert trigger.tick() == 4
    assert billing.accepted == [1, 2, 3, 4]
    assert search.accepted == [1, 3]
    owed = {int(p.position.pk["id"]): p.owed for p in (read_doc(store).window or Window()).pending}
    assert owed == {2: {"search": 1}, 4: {"search": 1}}
    clock.advance(11)
    assert trigger.tick() == 2
    assert billing.seen == [1, 2, 3, 4]
    assert search.seen == [1, 2, 3, 4, 2, 4]
    assert checkpoint_id(store) == 1  # 2 raised again: pinned, 4 is settled above it
    clock.advance(25)
    assert trigger.tick() == 1
    assert checkpoint_id(store) == 4
    assert sorted(search.accepted) == [1, 2, 3, 4]


def test_a_whole_raise_fails_every_event_of_that_subscriber_and_exhaustion_dead_letters(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A raise fails the subscriber's whole share; at its last attempt the share is
    bisected (subscriber_poison.py), so only the event that fails alone is
    dead-lettered - before, event 1, which search had never failed on its own,
    was dead-lettered with event 2."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    billing = Sub("billing")
    calls: list[list[int]] = []

    def search(events: list[RowChange]) -> None:
        calls.append([int(e.pk["id"]) for e in events])
        if 2 in calls[-1]:
            raise RuntimeError("search index down")

    trigger = make_trigger(
        items_source(sqlite_db),
        store,
        clock=clock,
        subscribers={"billing": billing, "search": search},
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
        retry_delay_seconds=1,
        max_attempts=2,
    )
    assert trigger.tick() == 3
    assert checkpoint_id(store) is None  # 1, 2 and 3 all wait for search
    clock.advance(5)
    assert trigger.tick() == 3  # second and last attempt: bisected, 2 dead-lettered
    assert calls == [[1, 2, 3], [1, 2, 3], [1], [2, 3], [2], [3]]
    assert billing.seen == [1, 2, 3]
    assert checkpoint_id(store) == 3
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    assert [(int(r.pk["id"]), r.error.split(":")[0], r.attempts) for r in sink.records()] == [
        (2, "RetriesExhausted", 2)
    ]
    shares = [e["outcomes"]["subscribers"]["search"] for e in trigger.read_state().journal[-1:]]
    assert shares == [{"accepted": 2, "rejected": 0, "failed": 1}]


def test_a_hung_subscriber_times_out_alone_and_gets_nothing_new_until_it_returns(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Threads of other tests in this process (a hung subscriber of theirs may
    # still be finishing) are not this trigger's.
    others = {t for t in threading.enumerate() if t.name.endswith("-slow")}
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    metrics = InMemoryMetrics()
    release = threading.Event()
    entered = threading.Event()
    saw_cancelled: list[bool] = []
    slow_calls: list[list[int]] = []
    billing = Sub("billing")

    def slow(events: list[RowChange], ctx: BatchContext) -> None:
        slow_calls.append([int(e.pk["id"]) for e in events])
        if len(slow_calls) == 1:
            entered.set()
            release.wait(60)  # bounded: the test releases it
            saw_cancelled.append(ctx.cancelled)

    trigger = make_trigger(
        items_source(sqlite_db),
        store,
        clock=clock,
        metrics=metrics,
        subscribers={"billing": billing, "slow": slow},
        ack_timeout_seconds=0.3,
        retry_delay_seconds=1,
    )
    try:
        assert trigger.tick() == 2
        assert entered.is_set()
        assert billing.accepted == [1, 2]  # the others go on
        owed = [p.owed for p in (read_doc(store).window or Window()).pending]
        assert owed == [{"slow": 1}, {"slow": 1}]
        assert metrics.total("ack_timeouts_total", subscriber="slow") == 1
        (said,) = [r for r in caplog.records if getattr(r, "event", "") == "subscriber_timed_out"]
        assert (said.levelno, getattr(said, "subscriber", None)) == (logging.WARNING, "slow")
        for what_to_do in ("ctx.cancelled", "ack_timeout_seconds", "batch_size"):
            assert what_to_do in said.getMessage()

        add_items(sqlite_db, table, [3])
        clock.advance(5)
        # 1, 2 are due again, but only slow owes them and it is still busy:
        # held back, not handed out (nor counted). 3 is new: billing takes it.
        assert trigger.tick() == 1
        assert slow_calls == [[1, 2]]
        assert billing.seen == [1, 2, 3]
        owed = [p.owed for p in (read_doc(store).window or Window()).pending]
        assert owed == [{"slow": 1}, {"slow": 1}, {"slow": 0}]  # 3 waits, never received
        assert checkpoint_id(store) is None
        assert trigger.tick_result().outcome == "idle"  # nothing anyone can take
    finally:
        release.set()
    wait_for(lambda: bool(saw_cancelled))
    assert saw_cancelled == [True]  # it was told its results are discarded
    wait_for(
        lambda: not any(t.name.endswith("-slow") and t not in others for t in threading.enumerate())
    )
    clock.advance(30)
    assert trigger.tick() == 3
    assert slow_calls[-1] == [1, 2, 3]
    assert billing.seen == [1, 2, 3]
    assert checkpoint_id(store) == 3


def test_async_subscribers_run_under_tick_async(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    got: dict[str, list[int]] = {"a": [], "b": []}

    async def a(events: list[RowChange]) -> None:
        await asyncio.sleep(0)
        got["a"].extend(int(e.pk["id"]) for e in events)

    async def b(events: list[RowChange], ctx: BatchContext) -> None:
        await asyncio.sleep(0)
        got["b"].extend(int(e.pk["id"]) for e in events)
        ctx.retry(events[0], "later")

    trigger = make_trigger(
        items_source(sqlite_db), store, subscribers={"a": a, "b": b}, clock=Clock()
    )
    assert asyncio.run(trigger.tick_async()) == 3
    assert got == {"a": [1, 2, 3], "b": [1, 2, 3]}
    assert checkpoint_id(store) is None  # 1 waits for b
    assert trigger.tick() == 0  # and sync ticks drive async subscribers too


def test_an_event_owed_to_a_removed_subscriber_is_not_settled_as_delivered(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    old = Sub("old", {1: ["retry"]})
    keep = Sub("keep")
    trigger, _ = fan_trigger(sqlite_db, store, clock, tmp_path, [keep, old], quarantine=None)
    assert trigger.tick() == 2
    assert checkpoint_id(store) is None

    # "old" is removed, "new" added: event 1 is owed to nobody configured.
    new = Sub("new")
    trigger, _ = fan_trigger(sqlite_db, store, clock, tmp_path, [keep, new], quarantine=None)
    clock.advance(11)
    trigger.tick()
    assert new.seen == []
    assert keep.seen == [1, 2]
    assert checkpoint_id(store) is None  # held without a sink: never passed silently

    sink_path = tmp_path / "dead2.jsonl"
    trigger, _ = fan_trigger(
        sqlite_db,
        store,
        clock,
        tmp_path,
        [keep, new],
        quarantine=JsonLinesQuarantineSink(sink_path),
    )
    clock.advance(60)
    trigger.tick()
    assert checkpoint_id(store) == 2
    [record] = JsonLinesQuarantineSink(sink_path).records()
    assert record.error == "EventRejected: old: unsubscribed before resolving it"


def test_a_subscriber_switch_keeps_a_single_handler_retry_owed_to_everyone(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    single = make_trigger(items_source(sqlite_db), store, clock=clock, retry_delay_seconds=1)

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        ctx.retry(events[0], "later")

    assert single.tick(handler) == 2
    a, b = Sub("a"), Sub("b")
    trigger, _ = fan_trigger(sqlite_db, store, clock, tmp_path, [a, b])
    clock.advance(5)
    assert trigger.tick() == 1
    assert a.seen == b.seen == [1]
    assert a.attempts[1] == b.attempts[1] == [2]
    assert checkpoint_id(store) == 2


# --- bad input --------------------------------------------------------------------------


def _ok(events: list[RowChange]) -> None:
    del events


BAD = [
    ("empty", {}, "subscribers= is empty"),
    ("unsafe name", {"bill ing": _ok}, "not a safe name"),
    ("empty name", {"": _ok}, "not a safe name"),
    ("not callable", {"billing": 42}, "subscriber 'billing' is not callable"),
    ("duplicate pair", [("billing", _ok), ("billing", _ok)], "duplicate subscriber name 'billing'"),
    ("duplicate but for case", {"billing": _ok, "Billing": _ok}, "but for case"),
    ("not a mapping", "billing", "must be a mapping"),
]


@pytest.mark.parametrize(("subs", "message"), [r[1:] for r in BAD], ids=[r[0] for r in BAD])
def test_bad_subscribers_are_refused(
    sqlite_db: TestDatabase, tmp_path: Path, subs: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make_trigger(items_source(sqlite_db), FileCheckpointStore(tmp_path / "s"), subscribers=subs)


def test_handlers_and_subscribers_do_not_mix(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path / "s")
    fan = make_trigger(items_source(sqlite_db), store, subscribers={"a": _ok})
    for call in (
        lambda: fan.tick(_ok),
        lambda: fan.drain(_ok),
        lambda: fan.run(timer=None, handler=_ok),
        lambda: fan.handler(_ok),
    ):
        with pytest.raises(ConfigurationError, match="subscribers="):
            call()
    single = make_trigger(items_source(sqlite_db), store)
    for call in (single.tick, single.drain, lambda: single.run(timer=None)):
        with pytest.raises(ConfigurationError, match="needs a handler"):
            call()
    with pytest.raises(ConfigurationError, match="ack_timeout_seconds applies to subscribers"):
        make_trigger(items_source(sqlite_db), store, ack_timeout_seconds=5)
    with pytest.raises(ConfigurationError, match="ack_timeout_seconds must be a finite number"):
        make_trigger(items_source(sqlite_db), store, subscribers={"a": _ok}, ack_timeout_seconds=0)


def test_db_trigger_refuses_subscribers_at_import() -> None:
    from dbtrigger.azure import DbBindings  # noqa: PLC0415 - optional extra

    with pytest.raises(ConfigurationError, match="takes no subscribers="):
        DbBindings().trigger(
            arg_name="events", source=None, checkpoint_store=None, subscribers={"a": _ok}
        )  # type: ignore[arg-type]


def test_the_worker_loads_a_fan_out_poller_without_a_handler(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    from dbtrigger.cli.loading import load_trigger  # noqa: PLC0415
    from dbtrigger.runtime.runner import Runner  # noqa: PLC0415
    from dbtrigger.runtime.subscriber_options import SubscriberCall  # noqa: PLC0415

    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    a, b = Sub("a"), Sub("b")
    module = types.ModuleType("fanout_app")
    module.trigger = make_trigger(  # type: ignore[attr-defined]
        items_source(sqlite_db), FileCheckpointStore(tmp_path / "s"), subscribers={"a": a, "b": b}
    )
    monkeypatch.setitem(sys.modules, "fanout_app", module)
    loaded = load_trigger("fanout_app:trigger")
    assert loaded.handler is None
    Runner(loaded.trigger, SubscriberCall(), interval_seconds=0, progress=None).run(
        max_ticks=2, install_signals=False
    )
    assert a.seen == b.seen == [1, 2, 3]


def test_the_fan_out_example_in_the_docs_runs_as_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()
    section = text.split("## Fan-out: several subscribers on one read", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "reliability.md", "exec"), {})  # noqa: S102 - our own docs
    out = capsys.readouterr().out.splitlines()
    assert out == ["4", "[1, 3] [1, 2, 3]", "{'accepted': 2, 'rejected': 0, 'failed': 1}"]


def test_a_subscriber_that_empties_its_list_does_not_touch_the_others(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3])
    store = FileCheckpointStore(tmp_path / "state")
    got: list[int] = []

    def greedy(events: list[RowChange]) -> None:
        events.clear()

    def reader(events: list[RowChange]) -> None:
        got.extend(int(e.pk["id"]) for e in events)

    trigger = make_trigger(
        items_source(sqlite_db), store, subscribers={"greedy": greedy, "reader": reader}
    )
    assert trigger.tick() == 3
    assert got == [1, 2, 3]
    assert read_doc(store).journal[-1]["outcomes"]["subscribers"]["greedy"]["accepted"] == 3


def test_a_handler_registered_with_the_decorator_is_what_drain_runs() -> None:
    """The README registers @trigger.handler, then calls trigger.drain() with no handler."""
    source = MemorySource(
        [{"id": 1, "seq": 1}, {"id": 2, "seq": 2}], cursor_column="seq", pk_columns=["id"]
    )
    trigger = PollTrigger(name="t", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen: list[int] = []

    @trigger.handler
    def handle(events: list[RowChange]) -> None:
        seen.extend(e.pk["id"] for e in events)

    assert trigger.drain() == 2
    assert seen == [1, 2]
