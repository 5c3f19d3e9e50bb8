"""What ``dbtrigger replay`` says when it cannot simply deliver what it planned:
a handler that raises half way (what was delivered, what was not, and the
command that goes on), a range across a gap in the history (refused: the
batches committed in the gap are not recorded), and a batch recorded from the
journal after its append was lost (no per-event record to check: said so,
never called drift or a pruned log).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.cli import main
from dbtrigger.errors import StoreUnavailableError
from dbtrigger.history import FileHistory, history_for
from dbtrigger.history.records import image_text
from dbtrigger.replay.batches import ReplayLease
from dbtrigger.runtime.context import BatchContext
from tests.databases import TestDatabase
from tests.test_history_replay import Calls, orders_table, register


def _records(trigger: PollTrigger) -> list[dict[str, Any]]:
    history = history_for(trigger.store)
    assert history is not None
    return list(history.read(trigger.name))


def _ids(trigger: PollTrigger) -> list[str]:
    return [str(r["batch_id"]) for r in _records(trigger) if r["type"] == "commit"]


def _cli(capsys: pytest.CaptureFixture[str], spec: str, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*argv, "--trigger", spec])
    out, err = capsys.readouterr()
    return code, out + err


def _polled(db: TestDatabase, tmp_path: Path, **options: Any) -> PollTrigger:
    orders_table(db)
    source = SqlAlchemySource(
        url=db.url, table="orders", cursor_column="seq", pk_columns=["id"], visibility="none"
    )
    return PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=5,
        **options,
    )


def _history_down(trigger: PollTrigger, ticks: int, handler: Any) -> None:
    """``ticks`` commits while the history store fails every append."""
    history = trigger.history
    assert history is not None

    def down(*args: Any, **kwargs: Any) -> None:
        raise StoreUnavailableError("no space left on device")

    real = history.append
    history.append = down  # type: ignore[method-assign]
    try:
        for _ in range(ticks):
            trigger.tick(handler)
    finally:
        history.append = real  # type: ignore[method-assign]


def test_a_handler_that_raises_half_way_is_said_with_the_command_that_goes_on(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trigger = _polled(sqlite_db, tmp_path)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    ids = _ids(trigger)
    assert len(ids) == 5
    seen: list[list[int]] = []

    def flaky(events: list[RowChange], ctx: BatchContext) -> None:
        if ctx.batch_id == ids[2]:
            raise RuntimeError("search index down")
        seen.append([int(e.pk["id"]) for e in events])

    trigger.handler(flaky)
    argv = ["replay", "orders", "--from-batch", ids[1], "--to-batch", ids[3]]
    code, out = _cli(capsys, spec, *argv, "--yes", "--reason", "reindex")
    assert code == 2, out
    assert seen == [[6, 7, 8, 9, 10]]  # the batch before the failure, and nothing after
    assert "replayed 1 of 3 batch(es)" in out
    assert f"raised on batch {ids[2]} (RuntimeError: search index down)" in out
    assert f"--from-batch {ids[2]} --to-batch {ids[3]}" in out
    assert "Traceback" not in out
    entry = _records(trigger)[-1]
    assert (entry["operation"], entry["batches"], entry["events"]) == ("replay", [ids[1]], 5)
    assert entry["not_delivered"] == [ids[2], ids[3]]
    assert entry["failed"] == {"batch_id": ids[2], "error": "RuntimeError: search index down"}

    # Going on as told delivers the rest.
    trigger.handler(lambda events, ctx: seen.append([int(e.pk["id"]) for e in events]))
    code, out = _cli(
        capsys, spec, "replay", "orders", "--from-batch", ids[2], "--to-batch", ids[3],
        "--yes", "--reason", "reindex, again",
    )  # fmt: skip
    assert code == 0, out
    assert seen[1:] == [[11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]


def test_a_range_across_a_gap_in_the_history_is_refused(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trigger = _polled(sqlite_db, tmp_path, journal_limit=2)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.tick(calls.handler)
    _history_down(trigger, 3, calls.handler)  # longer than the journal reaches back
    trigger.drain(calls.handler)
    records = _records(trigger)
    assert "gap" in [r["type"] for r in records]
    ids = _ids(trigger)
    assert len(ids) < 5  # the batches committed in the gap are not recorded
    argv = ["replay", "orders", "--from-batch", ids[0], "--to-batch", ids[-1]]
    code, out = _cli(capsys, spec, *argv, "--verify")
    assert code == 2, out
    assert "gap" in out
    calls.batches.clear()
    code, out = _cli(capsys, spec, *argv, "--yes", "--reason", "all of it")
    assert code == 2, out
    assert not calls.batches
    # Each side of the gap replays on its own.
    code, out = _cli(capsys, spec, "replay", "orders", "--batch", ids[-1], "--verify")
    assert code == 0, out


def test_a_batch_recorded_from_the_journal_is_said_unchecked_and_replays_from_the_log(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = orders_table(sqlite_db, rows=0)
    install(sqlite_db.engine, "orders", schema=sqlite_db.schema)
    with sqlite_db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "seq": i, "status": "new", "amount": i} for i in range(1, 16)],
        )
    source = ChangeLogSource(url=sqlite_db.url, table="orders", visibility="none")
    trigger = PollTrigger(
        name="orders-log",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=5,
    )
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.tick(calls.handler)
    _history_down(trigger, 1, calls.handler)  # its record comes from the journal, without detail
    trigger.drain(calls.handler)
    records = [r for r in _records(trigger) if r["type"] == "commit"]
    assert ["detail" in r for r in records] == [True, False, True]
    ids = [str(r["batch_id"]) for r in records]
    live = [list(events) for events, _ in calls.batches]

    code, out = _cli(capsys, spec, "replay", "orders-log", "--batch", ids[1], "--verify")
    assert code == 1, out
    assert "recorded from the journal" in out
    assert "differ" not in out
    assert "pruned" not in out
    assert "keep it longer" not in out
    calls.batches.clear()
    argv = ["replay", "orders-log", "--from-batch", ids[0], "--to-batch", ids[2]]
    code, out = _cli(capsys, spec, *argv, "--yes", "--reason", "replica rebuild")
    assert code == 0, out
    again = [list(events) for events, _ in calls.batches]
    assert [[image_text(e) for e in b] for b in again] == [[image_text(e) for e in b] for b in live]


def test_a_replay_killed_half_way_says_how_to_free_its_lease(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trigger = _polled(sqlite_db, tmp_path)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    first = _ids(trigger)[0]
    # A replay whose process was killed: its lease stays until it expires.
    ReplayLease.take(trigger.store, trigger, "replay:gone/1/dead", dt.datetime.now(dt.timezone.utc))
    argv = ["replay", "orders", "--batch", first, "--yes", "--reason", "reindex"]
    code, out = _cli(capsys, spec, *argv)
    assert code == 2, out
    assert "dbtrigger release-lease orders.replay --force" in out
    store = ["--store", str(tmp_path / "state")]
    capsys.readouterr()
    release = ["release-lease", "orders.replay", "--force", "--reason", "killed", "--yes"]
    assert main([*release, *store]) == 0
    calls.batches.clear()
    code, out = _cli(capsys, spec, *argv)
    assert code == 0, out
    assert len(calls.batches) == 1


def test_a_replay_is_recorded_in_the_trigger_s_own_history_or_in_none(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A trigger given a history elsewhere (history=FileHistory(...)) gets the replay's
    record there, and the state directory no history files; with history=False none
    is started by the replay either."""
    own = FileHistory(tmp_path / "elsewhere")
    trigger = _polled(sqlite_db, tmp_path, history=own)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    first = next(r["batch_id"] for r in own.read("orders") if r["type"] == "commit")
    code, out = _cli(capsys, spec, "replay", "orders", "--batch", first, "--yes", "--reason", "r")
    assert code == 0, out
    assert [r["type"] for r in own.read("orders")][-1] == "manual"
    assert not list((tmp_path / "state").glob("*.history.*"))

    trigger.history = None  # as history=False makes it: nothing kept
    code, out = _cli(capsys, spec, "replay", "orders", "--batch", first, "--yes", "--reason", "r")
    assert code == 0, out
    assert not list((tmp_path / "state").glob("*.history.*"))


def test_a_replay_across_a_source_definition_change_says_so(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The poller's source changed (evens only): the replay (and a rewind) is refused,
    naming the reset --accept-source that adopts it; once adopted, a replay of the batches
    recorded before says they are read under today's definition (the odd rows gone)."""
    trigger = _polled(sqlite_db, tmp_path)
    calls = Calls()
    register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    ids = _ids(trigger)
    evens = _polled_again(sqlite_db, tmp_path, where="MOD(id, 2) = 0")
    spec = register(evens, calls, monkeypatch, tmp_path)
    argv = ["replay", "orders", "--from-batch", ids[0], "--to-batch", ids[1], "--verify"]
    code, out = _cli(capsys, spec, *argv)
    assert code == 2, out
    assert f"dbtrigger reset orders --accept-source {spec} --reason TEXT" in out, out
    code, out = _cli(capsys, spec, "rewind", "orders", "--to-batch", ids[1], "--reason", "r")
    assert code == 2, out
    assert f"dbtrigger reset orders --accept-source {spec} --reason TEXT" in out, out
    code, out = _cli(capsys, spec, "reset", "orders", "--accept-source", spec,
                     "--reason", "evens only", "--yes")  # fmt: skip
    assert code == 0, out
    code, out = _cli(capsys, spec, *argv)
    assert code == 1, out
    assert f"note: the source definition changed after batch {ids[1]} (accept_source" in out
    assert "('evens only')): 2 batch(es) recorded under the old one" in out, out
    assert "drift gone     id=1:" in out, out


def _polled_again(db: TestDatabase, tmp_path: Path, **options: Any) -> PollTrigger:
    source = SqlAlchemySource(
        url=db.url, table="orders", cursor_column="seq", pk_columns=["id"], visibility="none",
        **options,
    )  # fmt: skip
    return PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=5,
    )


def test_a_replay_across_a_skip_batch_says_the_checkpoint_was_moved(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Rows 11-15 were skipped live (skip-batch): the replay of the range hands over the
    recorded batches only, as delivered, and says what moved the checkpoint between."""
    trigger = _polled(sqlite_db, tmp_path)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.tick(calls.handler)
    trigger.tick(calls.handler)
    code, out = _cli(capsys, spec, "skip-batch", "orders", "--to-cursor", "15", "--pk", "id=15",
                     "--reason", "rows 11-15 bad", "--yes")  # fmt: skip
    assert code == 0, out
    trigger.drain(calls.handler)
    ids = _ids(trigger)
    argv = ["replay", "orders", "--from-batch", ids[0], "--to-batch", ids[-1], "--verify"]
    code, out = _cli(capsys, spec, *argv)
    assert code == 0, out
    assert f"note: after batch {ids[1]}, skip_batch at " in out, out
    assert "('rows 11-15 bad') moved the checkpoint 10 id=10 -> 15 id=15" in out, out
