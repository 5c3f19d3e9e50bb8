"""A history file with a damaged line (a disk that filled, a crash of the machine,
an edit by hand): the record on it is lost, and that is said, never skipped.

A line that is not a record used to be skipped like a torn last line: the
history listed records 1, 2, 4, 5 as if whole, a replay of batches 1-5 said
"4 batch(es) ... no drift" without batch 3 and a rewind counted 4 batches where
5 come again. Now the numbers missing are a gap that names the file and line:
``dbtrigger history`` shows it, a replay or rewind across it is refused with
the way out, the records around it are read as before and the poller goes on
appending. A damaged last line whose record the journal still holds is written
again by the next append (without its per-event detail): no hole, so nothing is
refused, and the damaged line is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource, SqlCheckpointStore
from dbtrigger.cli import main
from dbtrigger.history import BlobHistory, FileHistory, SqlHistory, history_for, load
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.test_history_replay import Calls, orders_table, register
from tests.test_history_runtime import memory_source
from tests.test_history_stores import _blob


def _trigger(db: TestDatabase, tmp_path: Path) -> PollTrigger:
    orders_table(db)
    source = SqlAlchemySource(
        url=db.url, table="orders", cursor_column="seq", pk_columns=["id"], visibility="none"
    )
    return PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=5,
    )


def _segment(tmp_path: Path) -> Path:
    (path,) = sorted((tmp_path / "state").glob("orders.history.*.jsonl"))
    return path


def _damage(path: Path, line: int) -> None:
    """Line ``line`` (1-based) of ``path`` overwritten by NUL bytes, its newline kept:
    what a file system leaves of a write it had not flushed when the machine died."""
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = b"\x00" * len(lines[line - 1])
    path.write_bytes(b"\n".join(lines))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def _commits(trigger: PollTrigger) -> list[dict[str, Any]]:
    records = load(history_for(trigger.store), trigger.name, trigger.read_state())
    return [r for r in records if r.get("type") == "commit"]


def test_a_damaged_line_in_the_middle_is_a_gap_naming_the_file_and_line(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trigger = _trigger(sqlite_db, tmp_path)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    ids = [str(c["batch_id"]) for c in _commits(trigger)]
    assert len(ids) == 5
    path = _segment(tmp_path)
    _damage(path, 3)

    code, out = _cli(capsys, "history", "orders", "--store", str(tmp_path / "state"))
    assert code == 0, out
    assert "gap" in out, out
    assert f"{path} line 3" in out, out
    assert ids[2] not in out  # its record is lost, and not shown as if read

    whole = ["replay", "orders", "--from-batch", ids[0], "--to-batch", ids[4], "--trigger", spec]
    code, out = _cli(capsys, *whole, "--verify")
    assert code == 2, out
    assert f"{path} line 3" in out, out
    assert f"between batch {ids[1]} and batch {ids[3]}" in out, out
    calls.batches.clear()
    code, out = _cli(capsys, *whole, "--yes", "--reason", "all of it")
    assert code == 2, out
    assert not calls.batches

    rewind = ["rewind", "orders", "--to-batch", ids[1], "--trigger", spec, "--reason", "redo"]
    code, out = _cli(capsys, *rewind)
    assert code == 2, out
    assert f"{path} line 3" in out, out
    assert "dbtrigger reset orders --to-cursor 5 --pk id=5 " in out, out

    code, out = _cli(capsys, "history", "orders", "--batch", ids[2], "--trigger", spec)
    assert code == 2, out
    assert f"or it was on a record lost since: record 3 of the history lost: {path} line 3" in out

    # Nothing else is lost: each side replays, and the poller goes on appending.
    code, out = _cli(capsys, "replay", "orders", "--from-batch", ids[3], "--to-batch", ids[4],
                     "--trigger", spec, "--verify")  # fmt: skip
    assert code == 0, out
    with sqlite_db.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO orders VALUES (26, 26, 'new', 1)")
    trigger.tick(calls.handler)
    commits = _commits(trigger)
    assert [c["batch_id"] for c in commits[:2]] == ids[:2]
    assert [c["seq"] for c in commits] == [1, 2, 4, 5, 6]


def test_a_damaged_last_line_is_written_again_from_the_journal(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    trigger = _trigger(sqlite_db, tmp_path)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    ids = [str(c["batch_id"]) for c in _commits(trigger)]
    path = _segment(tmp_path)
    _damage(path, 5)
    with sqlite_db.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO orders VALUES (26, 26, 'new', 1)")
    trigger.tick(calls.handler)

    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        commits = _commits(trigger)
    assert [c["batch_id"] for c in commits[:5]] == ids
    assert [c["seq"] for c in commits] == [1, 2, 3, 4, 5, 6]
    said = [r for r in caplog.records if getattr(r, "event", None) == "history_line_damaged"]
    assert said
    assert f"{path} line 5" in said[0].getMessage()
    code, out = _cli(capsys, "replay", "orders", "--from-batch", ids[0], "--to-batch", ids[4],
                     "--trigger", spec, "--verify")  # fmt: skip
    assert code == 1, out  # no hole: only batch 5's detail is gone
    assert "gap" not in out, out
    assert f"{ids[4]}  20 id=20 -> 25 id=25" in out, out
    assert "recorded from the journal" in out, out


def _three(history: Any) -> None:
    history.append("orders", [{"id": f"r{i}", "type": "manual"} for i in (1, 2, 3)], after_seq=0)


@pytest.mark.azurite
def test_a_damaged_blob_line_names_the_blob_and_line(azurite: Azurite) -> None:
    """An append blob written again by hand (a restore gone wrong) with line 2 garbled."""
    for history in _blob(azurite):
        _three(history)
        (segment,) = history.client.list_blobs(name_starts_with="state/shop/orders.history/")
        blob = history.client.get_blob_client(segment.name)
        lines = blob.download_blob().readall().split(b"\n")
        lines[1] = b'{"seq":2,"id":"r2","ty'
        blob.delete_blob()
        blob.create_append_blob()
        blob.append_block(b"\n".join(lines))
        (gap,) = [r for r in load(history, "orders") if r["type"] == "gap"]
        assert gap["missing"] == [2, 2]
        assert gap["damaged"] == [f"blob {history.client.container_name}/{segment.name} line 2"]


def test_a_record_removed_from_a_sql_history_is_a_gap(sqlite_db: TestDatabase) -> None:
    history = SqlHistory(sqlite_db.engine, schema=sqlite_db.schema)
    _three(history)
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.delete(history.table).where(history.table.c.seq == 2))
    records = load(history, "orders")
    assert [(r["seq"], r["type"]) for r in records] == [(1, "manual"), (2, "gap"), (3, "manual")]
    assert "record 2 of the history lost: not in the store" in records[1]["note"]


def test_a_damaged_sql_row_is_said_and_the_poller_goes_on_recording(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """A history row edited by hand into text that is not a record: a read failed
    with a JSONDecodeError, and so did every append of the next process (the recorder
    reads the history's tail first), for good. Now the row reads as a damaged record
    naming the table and row: the newest one is written again from the journal after
    it (said, nothing lost); one in the middle that breaks the chain of commits is a
    gap naming it."""
    store = SqlCheckpointStore(url=sqlite_db.url, schema=sqlite_db.schema)
    source = memory_source(30)
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store, batch_size=10)
    trigger.tick(lambda events: None)
    trigger.tick(lambda events: None)
    trigger.close()
    history = history_for(store)
    assert isinstance(history, SqlHistory)

    def damage(seq: int) -> None:
        with sqlite_db.engine.begin() as conn:
            conn.execute(
                sa.update(history.table).where(history.table.c.seq == seq).values(record="{")
            )

    damage(2)
    # The next process reads the history's tail before its first append.
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store, batch_size=10)
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        trigger.tick(lambda events: None)
        records = load(history, "orders", trigger.read_state())
    assert [r["seq"] for r in records] == [1, 3, 4]
    assert [r["to"]["value"] for r in records] == [10, 20, 30]
    assert not [r for r in caplog.records if getattr(r, "event", None) == "history_append_failed"]
    said = [r for r in caplog.records if getattr(r, "event", None) == "history_line_damaged"]
    assert f"{history.describe()} row 2" in said[0].getMessage()

    damage(3)  # batch 2's only record now: the commits around it no longer chain
    records = load(history, "orders", trigger.read_state())
    assert [(r["seq"], r["type"]) for r in records] == [(1, "commit"), (2, "gap"), (4, "commit")]
    assert f"{history.describe()} row 2, {history.describe()} row 3 are not" in records[1]["note"]


# --- a whole segment damaged -------------------------------------------------------------
#
# An append found the newest segment without a line it could read and removed it, as
# it does a segment holding only a torn line: every record in it was gone, unsaid, and
# the next records took their numbers. It is kept now, the records go on after its
# lines, and readers report each of its lines as damaged.


def _segments_of(history: Any) -> list[tuple[str, Callable[[], bytes], Callable[[bytes], None]]]:
    """(name, read, write) of each segment of ``orders``, oldest first."""
    if isinstance(history, FileHistory):
        return [
            (str(p), p.read_bytes, p.write_bytes)
            for p in sorted(history.directory.glob("orders.history.*.jsonl"))
        ]
    out = []
    for blob in sorted(b.name for b in history.client.list_blobs(name_starts_with="state/")):
        client = history.client.get_blob_client(blob)

        def write(data: bytes, client: Any = client) -> None:
            client.delete_blob()
            client.create_append_blob()
            client.append_block(data)

        name = f"blob {history.client.container_name}/{blob}"
        out.append((name, lambda c=client: bytes(c.download_blob().readall()), write))
    return out


def _nul(data: bytes) -> bytes:
    """Every line NUL bytes, the newlines kept (a machine that died before its writes
    reached the disk)."""
    return b"\n".join(b"\x00" * len(line) for line in data.split(b"\n"))


def _whole_segments_damaged(history: Any, caplog: pytest.LogCaptureFixture) -> None:
    big = "x" * 600  # two records a segment of 1 KiB
    for seq in range(6):
        history.append("orders", [{"id": f"r{seq + 1}", "type": "manual", "p": big}], after_seq=seq)
    segments = _segments_of(history)
    assert len(segments) == 3  # 1-2, 3-4, 5-6
    damaged = []
    for name, read, write in segments[1:]:
        data = _nul(read())
        write(data)
        damaged.append((name, data))
    if isinstance(history, BlobHistory):  # another process's writer: nothing cached
        history = BlobHistory(history.client, app="shop", segment_bytes=1024)
    (stand_in,) = history.tail("orders", 1)  # the numbers the damaged lines had are taken
    assert (stand_in["seq"], stand_in["type"]) == (6, "damaged_line")
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        history.append("orders", [{"id": "r7", "type": "manual"}], after_seq=6)
    said = [r for r in caplog.records if getattr(r, "event", None) == "history_segment_damaged"]
    assert len(said) == 1
    assert damaged[-1][0] in said[0].getMessage()
    now = {name: read() for name, read, _ in _segments_of(history)}
    for name, data in damaged:
        assert now[name].startswith(data), f"{name} was not kept"
    records = list(history.read("orders"))
    assert [r["seq"] for r in records] == [1, 2, None, None, None, None, 7]
    lines = [f"{name} line {n}" for name, _ in damaged for n in (1, 2)]
    assert [r["where"] for r in records[2:6]] == lines
    (gap,) = [r for r in load(history, "orders") if r["type"] == "gap"]
    assert (gap["missing"], gap["damaged"]) == ([3, 6], lines)
    history.append("orders", [{"id": "r8", "type": "manual"}], after_seq=7)  # and goes on
    assert [r["id"] for r in history.tail("orders", 2)] == ["r7", "r8"]


def test_a_file_segment_damaged_in_every_line_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _whole_segments_damaged(FileHistory(tmp_path, segment_bytes=1024), caplog)


@pytest.mark.azurite
def test_a_blob_segment_damaged_in_every_line_is_kept(
    azurite: Azurite, caplog: pytest.LogCaptureFixture
) -> None:
    for history in _blob(azurite, segment_bytes=1024):
        _whole_segments_damaged(history, caplog)


def calls_last(trigger: PollTrigger) -> str:
    state = trigger.read_state()
    assert state is not None
    return str(state.journal[-1]["batch_id"])


def test_a_history_damaged_in_every_line_is_kept_and_its_numbers_are_a_gap(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The poller's whole history (one segment) damaged in every line: kept, the next
    commit recorded after the numbers its lines had, and those a gap that ``dbtrigger
    history`` shows and a replay across refuses, naming the lines (it was removed by
    the next append, and the history started again at 1 as if nothing had been)."""
    trigger = _trigger(sqlite_db, tmp_path)
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    ids = [str(c["batch_id"]) for c in _commits(trigger)]
    path = _segment(tmp_path)
    before = _nul(path.read_bytes())
    path.write_bytes(before)
    with sqlite_db.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO orders VALUES (26, 26, 'new', 1)")
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        trigger.tick(calls.handler)
    assert _segment(tmp_path) == path
    assert path.read_bytes().startswith(before)
    said = [r for r in caplog.records if getattr(r, "event", None) == "history_segment_damaged"]
    assert str(path) in said[0].getMessage()

    code, out = _cli(capsys, "history", "orders", "--store", str(tmp_path / "state"))
    assert code == 0, out
    assert "gap" in out, out
    assert f"{path} line 1" in out, out
    whole = ["replay", "orders", "--from-batch", ids[0], "--to-batch", ids[4], "--trigger", spec]
    code, out = _cli(capsys, *whole, "--verify")
    assert code == 2, out
    assert f"records 1-5 of the history lost: {path} line 1" in out, out
    assert [(c["seq"], c["batch_id"]) for c in _commits(trigger)] == [(6, calls_last(trigger))]


@pytest.mark.azurite
def test_a_blob_segment_ending_in_a_cut_line_keeps_the_next_record_whole(
    azurite: Azurite,
) -> None:
    """A segment written again by hand (a restore cut short) ends inside a line: an
    append blob cannot be cut back as a file is, so the next record starts on a
    line of its own rather than run on from the cut one and be lost with it."""
    for history in _blob(azurite):
        _three(history)
        (segment,) = history.client.list_blobs(name_starts_with="state/shop/orders.history/")
        blob = history.client.get_blob_client(segment.name)
        data = bytes(blob.download_blob().readall())
        blob.delete_blob()
        blob.create_append_blob()
        blob.append_block(data + b'{"seq":4,"id":"r4","ty')
        fresh = BlobHistory(history.client, app="shop")  # another process: nothing cached
        fresh.append("orders", [{"id": "r4", "type": "manual"}], after_seq=3)
        assert [r["id"] for r in fresh.tail("orders", 2)] == ["r3", "r4"]
        records = list(fresh.read("orders"))
        assert [r["seq"] for r in records] == [1, 2, 3, None, 4]
