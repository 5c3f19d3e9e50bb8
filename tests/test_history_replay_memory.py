"""``dbtrigger replay --batch`` holds one batch's detail, not the whole history's.

It loaded every record with its per-event detail (most of a history's size)
to replay one batch: 1.9 GB of memory at the default retention's 256 MiB (66,000
commits of 400 events), 560 MB at 64 MiB. Now it reads the history without
details and then the details of the batches chosen and of the commits before
them that the comparison looks at: 300 MB at 256 MiB, most of it the records'
ranges. Measured here with tracemalloc (what Python allocated, not how fast):
the peak (6 MiB) stays below the history's size on disk (8 MiB), where it was
seven times that (56 MiB).
"""

from __future__ import annotations

import tracemalloc
import uuid
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.history import FileHistory, history_for
from tests.databases import TestDatabase
from tests.test_history_replay import Calls, orders_table, register

#: The generated history's size on disk (commits of 2,000 events each).
HISTORY_BYTES = 8 * 1024 * 1024


def test_replaying_one_batch_does_not_hold_the_whole_history(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    orders_table(sqlite_db)
    source = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"], visibility="none"
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=5,
    )
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    trigger.drain(calls.handler)
    assert isinstance(history_for(trigger.store), FileHistory)
    # Segments of 1 MiB: a read holds one segment at a time (8 MiB by default).
    history = FileHistory(tmp_path / "state", segment_bytes=1024 * 1024)
    real = list(history.read("orders"))
    last = real[-1]
    # Later commits, each with the detail of 2,000 events (empty ranges at the end).
    detail = {**last["detail"], "rows": 2000, "values": list(range(2000)), "crcs": [7] * 2000}
    like = {k: v for k, v in last.items() if k not in ("seq", "id", "batch_id")}
    like.update({"from": last["to"], "rows": 0, "detail": detail})
    seq, size, n = int(last["seq"]), 0, 0
    while size < HISTORY_BYTES:
        more = []
        for _ in range(50):
            n += 1
            more.append({**like, "id": uuid.uuid4().hex[:24], "batch_id": f"batch_later_{n}"})
        history.append("orders", more, after_seq=seq)
        seq += len(more)
        size = sum(p.stat().st_size for p in (tmp_path / "state").glob("orders.history.*"))

    capsys.readouterr()
    tracemalloc.start()
    try:
        batch = str(real[1]["batch_id"])
        code = main(["replay", "orders", "--batch", batch, "--trigger", spec, "--verify"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "verify: no drift; nothing delivered" in out, out
    assert peak < size, f"peak {peak >> 20} MiB for a history of {size >> 20} MiB"
