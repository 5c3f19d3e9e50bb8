"""Subscribers added to, removed from or renamed in a fan-out poller between runs.

The fan-out set is frozen when an event is handed out: a subscriber added
later starts with the events after the checkpoint. What is tested here is
that this never happens silently - the state document records the set each
lease ran with, and the next run with another set says at WARNING who joined,
from which checkpoint, and the ``dbtrigger backfill`` that hands it the
earlier rows (run here as printed), and at INFO who left - and that a removed
subscriber leaves no trace in the recorded set.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import types
import uuid
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, JsonLinesQuarantineSink, PollTrigger, RowChange, renamed
from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError, CorruptStateError
from dbtrigger.partitions import PartitionedPoller, regroup
from dbtrigger.runtime.subscriber_options import validate_subscribers
from dbtrigger.state import fanout_set
from dbtrigger.state.document import StateDocument
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_source, items_table, make_trigger, read_doc
from tests.test_event_outcomes import Clock
from tests.test_fanout import Sub

JOINED, LEFT = "subscriber_joined", "subscriber_left"


def said(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


@pytest.mark.parametrize(
    ("before", "now", "joined", "left"),
    [
        (None, ["a"], (), ()),  # nothing recorded: a new poller, or one from before
        (["a"], ["a"], (), ()),
        (["a"], ["a", "b"], ("b",), ()),
        (["a", "b"], ["a"], (), ("b",)),
        (["a", "b"], ["a", "c"], ("c",), ("b",)),  # a rename is one of each
    ],
)
def test_change(
    before: list[str] | None, now: list[str], joined: tuple[str, ...], left: tuple[str, ...]
) -> None:
    assert fanout_set.change(before, now) == (joined, left)


def test_the_recorded_set_is_replaced_and_checked() -> None:
    doc = StateDocument(poller_name="p", source_fingerprint="f")
    assert fanout_set.recorded(doc) is None
    assert fanout_set.recording(doc, None) is doc  # a single handler records nothing
    two = fanout_set.recording(doc, ["search", "billing"])
    assert fanout_set.recorded(two) == ("billing", "search")
    assert fanout_set.recording(two, ["billing", "search"]) is two
    assert fanout_set.recorded(fanout_set.recording(two, ["billing"])) == ("billing",)
    bad = StateDocument(poller_name="p", source_fingerprint="f", extra={"subscribers": "billing"})
    with pytest.raises(CorruptStateError, match="subscribers must be a list"):
        fanout_set.recorded(bad)


def test_a_subscriber_added_later_is_told_where_it_starts_and_the_backfill_gives_it_the_rest(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2, 3, 4, 5])
    state = FileCheckpointStore(tmp_path / "state")
    billing = Sub("billing")
    caplog.set_level(logging.INFO, logger="dbtrigger")
    assert make_trigger(items_source(sqlite_db), state, subscribers={"billing": billing}).drain()
    assert not said(caplog, JOINED)  # a first run has nothing to compare with
    assert read_doc(state).extra["subscribers"] == ["billing"]

    # The app gains a subscriber; the checkpoint is at 5 already.
    add_items(sqlite_db, table, [6, 7])
    got: list[int] = []

    def search(events: list[RowChange]) -> None:
        got.extend(int(e.pk["id"]) for e in events)

    module = f"fanout_set_{uuid.uuid4().hex[:8]}"
    app = types.ModuleType(module)
    search.__module__, search.__qualname__ = module, "search"
    trigger = make_trigger(
        items_source(sqlite_db), state, subscribers={"billing": billing, "search": search}
    )
    app.search, app.trigger = search, trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, app)
    assert trigger.drain() == 2
    assert got == [6, 7]  # the contract: it starts with the events after the checkpoint
    (joined,) = said(caplog, JOINED)
    assert joined.levelno == logging.WARNING
    message = joined.getMessage()
    assert "subscriber(s) search joined (the poller last ran with billing)" in message
    assert "checkpoint (cursor 50) and the 0 event(s)" in message  # (version = id * 10)
    assert read_doc(state).extra["subscribers"] == ["billing", "search"]

    # Said once: another instance (or a restart) with the same set says nothing.
    add_items(sqlite_db, table, [8])
    again = make_trigger(
        items_source(sqlite_db), state, subscribers={"billing": billing, "search": search}
    )
    assert again.drain() == 1
    assert len(said(caplog, JOINED)) == 1
    assert not said(caplog, LEFT)

    # The command it printed hands search the rows it never had.
    (command,) = joined.commands  # type: ignore[attr-defined]
    assert command in message
    words = shlex.split(command)
    assert words[:2] == ["dbtrigger", "backfill"], command
    assert f"{module}:search" in words, command
    assert f"{module}:trigger" in words, command
    assert main(words[1:]) == 0
    assert sorted(set(got)) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert billing.seen == [1, 2, 3, 4, 5, 6, 7, 8]  # the backfill went to search only


def test_a_removed_or_renamed_subscriber_is_said_and_leaves_nothing_recorded(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    state = FileCheckpointStore(tmp_path / "state")
    billing, search, index = Sub("billing"), Sub("search", {2: ["retry"]}), Sub("index")
    caplog.set_level(logging.INFO, logger="dbtrigger")
    clock = Clock()  # never advanced: search's retry of 2 never falls due

    def run(**subscribers: Sub) -> PollTrigger:
        trigger = make_trigger(items_source(sqlite_db), state, subscribers=subscribers, clock=clock)
        for _ in range(5):  # (not drain: search's retry of 2 is left waiting)
            if trigger.tick_result().outcome == "idle":
                break
        return trigger

    run(billing=billing, search=search)
    add_items(sqlite_db, table, [3])

    # Before the new version runs, `dbtrigger status` with it says what will change.
    module = f"fanout_set_{uuid.uuid4().hex[:8]}"
    app = types.ModuleType(module)
    app.trigger = make_trigger(  # type: ignore[attr-defined]
        items_source(sqlite_db), state, subscribers={"billing": billing, "index": index}
    )
    monkeypatch.setitem(sys.modules, module, app)
    argv = ["status", "items", "--store", str(tmp_path / "state"), "--source", f"{module}:trigger"]
    capsys.readouterr()
    main(argv)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("subscribers"))
    assert "billing, search (the last run's); joining with the trigger: index" in line
    assert line.endswith("leaving: search")
    main([*argv, "--json"])
    assert json.loads(capsys.readouterr().out)["subscribers"] == {
        "last_run": ["billing", "search"],
        "trigger": ["billing", "index"],
        "joining": ["index"],
        "leaving": ["search"],
    }
    run(billing=billing, index=index)  # search renamed to index
    (left,) = said(caplog, LEFT)
    (joined,) = said(caplog, JOINED)
    assert left.levelno == logging.WARNING  # (another joined: perhaps a rename)
    assert "subscriber(s) search left" in left.getMessage()
    for record in (left, joined):
        assert "if this is a rename" in record.getMessage()
    assert "subscriber(s) index joined" in joined.getMessage()
    # 2 was handed out and waits for search's retry: not index's either.
    assert "and the 1 event(s) already handed out and waiting" in joined.getMessage()
    assert index.seen == [3]
    assert read_doc(state).extra["subscribers"] == ["billing", "index"]

    add_items(sqlite_db, table, [4])
    run(billing=billing)  # index removed
    assert "subscriber(s) index left" in said(caplog, LEFT)[-1].getMessage()
    assert len(said(caplog, JOINED)) == 1
    assert read_doc(state).extra["subscribers"] == ["billing"]  # no trace of search, index
    assert billing.seen == [1, 2, 3, 4]


@pytest.mark.parametrize("regrouped", [False, True], ids=["same-layout", "after-a-split"])
def test_a_subscriber_added_to_a_partitioned_poller_is_said_once_for_the_group(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture, regrouped: bool
) -> None:
    """Each partition has a document of its own and records the set, but the
    change is the group's: one WARNING naming the group, and one backfill. A
    split in between wrote the new partitions without the set, so the subscriber
    added after it was handed the rows after the checkpoints with nothing said;
    the new partitions take the set their parents recorded."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, list(range(1, 41)))
    store = FileCheckpointStore(tmp_path / "state")
    caplog.set_level(logging.INFO, logger="dbtrigger")

    def group(**subscribers: Sub) -> PartitionedPoller:
        return PartitionedPoller(
            name="items",
            source=items_source(sqlite_db),
            checkpoint_store=store,
            partitions=4,
            join_window_seconds=0,
            background=False,
            subscribers=subscribers,
        )

    first = group(billing=Sub("billing"))
    assert first.drain() == 40
    if regrouped:
        regroup.apply(first, 8, actor="t", reason="r", wait_seconds=5)
    first.leave()
    first.close()
    add_items(sqlite_db, table, [41, 42])
    search = Sub("search")
    second = group(billing=Sub("billing"), search=search)
    try:
        assert second.drain() == 2
    finally:
        second.leave()
        second.close()
    assert sorted(search.seen) == [41, 42]
    (joined,) = said(caplog, JOINED)
    message = joined.getMessage()
    assert message.startswith("poller items: subscriber(s) search joined")
    assert "the rows up to each partition's checkpoint" in message
    assert joined.commands[0].startswith("dbtrigger backfill items-search-backfill ")  # type: ignore[attr-defined]


def _renaming_run(
    sqlite_db: TestDatabase, state: FileCheckpointStore, sink: object, clock: Clock, **subs: object
) -> PollTrigger:
    trigger = make_trigger(
        items_source(sqlite_db),
        state,
        subscribers=subs,
        clock=clock,
        quarantine=sink,
        retry_delay_seconds=1,
    )
    for _ in range(5):  # (not drain: a retry not due yet is left waiting)
        if trigger.tick_result().outcome == "idle":
            break
    return trigger


def test_a_declared_rename_takes_over_what_the_old_name_owed(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``renamed(handler, formerly="search")``: the event search still owed
    (waiting for its retry) goes to index, with search's attempt count; nothing
    is dead-lettered, nothing said joined or left, billing is not handed it again."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    state = FileCheckpointStore(tmp_path / "state")
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    billing, search, index = Sub("billing"), Sub("search", {2: ["retry"]}), Sub("index")
    caplog.set_level(logging.INFO, logger="dbtrigger")
    clock = Clock()
    _renaming_run(sqlite_db, state, sink, clock, billing=billing, search=search)
    assert search.seen == [1, 2]
    (waiting,) = read_doc(state).window.pending
    assert waiting.owed == {"search": 1}

    # `dbtrigger status` with the renaming version: nothing joins or leaves, and
    # what search owes is index's, not holding the checkpoint.
    module = f"fanout_rename_{uuid.uuid4().hex[:8]}"
    app = types.ModuleType(module)
    app.trigger = make_trigger(  # type: ignore[attr-defined]
        items_source(sqlite_db),
        state,
        subscribers={"billing": billing, "index": renamed(index, formerly="search")},
    )
    monkeypatch.setitem(sys.modules, module, app)
    argv = ["status", "items", "--store", str(tmp_path / "state"), "--source", f"{module}:trigger"]
    capsys.readouterr()
    main([*argv, "--json"])
    status = json.loads(capsys.readouterr().out)
    assert status["subscribers"]["joining"] == []
    assert status["subscribers"]["leaving"] == []
    assert status["owed"] == [
        {
            "subscriber": "search",
            "events": 1,
            "renamed_to": "index",
            "configured": True,
            "holds_checkpoint": False,
        }
    ]

    add_items(sqlite_db, table, [3])
    clock.advance(60)  # search's retry of 2 is due
    trigger = _renaming_run(
        sqlite_db, state, sink, clock, billing=billing, index=renamed(index, formerly="search")
    )
    assert sorted(index.seen) == [2, 3]
    assert search.attempts[2] == [1]
    assert index.attempts[2] == [2]  # search's delivery counts: the rename is one subscriber
    assert billing.seen == [1, 2, 3]
    assert sink.records() == []
    assert not said(caplog, JOINED)
    assert not said(caplog, LEFT)
    (told,) = said(caplog, "subscriber_renamed")
    assert "subscriber search is now index" in told.getMessage()
    doc = read_doc(state)
    assert doc.extra["subscribers"] == ["billing", "index"]
    assert doc.window is None or not doc.window.pending
    assert trigger.drain() == 0  # nothing left for anyone


def test_an_undeclared_rename_is_a_warning_naming_the_way_to_declare_it(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``renamed()``, a subscriber leaving while another joins may be a
    rename: what the old name owed is dead-lettered (a sink) in its name, never
    handed to the new one. That is said at WARNING, with the way to declare the
    rename and the replay for what was dead-lettered."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, [1, 2])
    state = FileCheckpointStore(tmp_path / "state")
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    billing, search, index = Sub("billing"), Sub("search", {2: ["retry"]}), Sub("index")
    caplog.set_level(logging.INFO, logger="dbtrigger")
    clock = Clock()
    _renaming_run(sqlite_db, state, sink, clock, billing=billing, search=search)
    clock.advance(60)
    _renaming_run(sqlite_db, state, sink, clock, billing=billing, index=index)
    (left,) = said(caplog, LEFT)
    assert left.levelno == logging.WARNING
    for record in (left, *said(caplog, JOINED)):
        assert "dbtrigger.renamed(handler, formerly='OLD')" in record.getMessage()
        assert "dead-letter replay --subscriber NEW" in record.getMessage()
    assert index.seen == []
    (record,) = sink.records()
    assert record.pk == {"id": 2}
    assert "search: unsubscribed" in record.error
    assert record.subscribers == {"search": "unsubscribed before resolving it"}

    # Declared afterwards, the rename lets the replay to index take search's letter.
    module = f"fanout_rename_{uuid.uuid4().hex[:8]}"
    app = types.ModuleType(module)
    app.trigger = make_trigger(  # type: ignore[attr-defined]
        items_source(sqlite_db),
        state,
        quarantine=sink,
        subscribers={"billing": billing, "index": renamed(index, formerly="search")},
    )
    monkeypatch.setitem(sys.modules, module, app)
    argv = ["items", "--trigger", f"{module}:trigger", "--subscriber", "index"]
    assert main(["dead-letter", "replay", *argv, "--reason", "renamed", "--yes"]) == 0
    assert index.seen == [2]
    assert billing.seen == [1, 2]
    assert main(["dead-letter", "list", *argv[:3]]) == 0
    assert "no dead letters" in capsys.readouterr().out


def test_renamed_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="is a subscriber too"):
        validate_subscribers({"a": Sub("a"), "b": renamed(Sub("b"), formerly="a")})
    with pytest.raises(ConfigurationError, match="both say they were 'x'"):
        validate_subscribers(
            {"a": renamed(Sub("a"), formerly="x"), "b": renamed(Sub("b"), formerly=["x"])}
        )
    with pytest.raises(ConfigurationError, match="former name"):
        renamed(Sub("a"), formerly=[])
