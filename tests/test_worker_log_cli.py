"""The worker's log as an operator reads it: ``dbtrigger run`` in a process of its own,
its stderr taken line by line (tests/test_worker_log_lines.py holds each rule in-process).

One INFO line per tick at 10 batches (no per-batch record at INFO), the first
progress line with no made-up rate, a quiet state said once, never ``caught up``
nor ``nothing after the checkpoint`` while a retry pins the window and rows wait
behind it, and a partitioned poller's tick line naming its partitions' checkpoints
and its visibility choice said once.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

DBTRIGGER = str(Path(sys.executable).parent / "dbtrigger")
_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>[\w.]+): ")


def shop(tmp_path: Path, rows: int) -> None:
    with sqlite3.connect(tmp_path / "shop.db") as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
        conn.execute("CREATE INDEX ix_orders_seq ON orders (seq, id)")
        conn.executemany("INSERT INTO orders VALUES (?, ?)", [(i, i) for i in range(1, rows + 1)])


def run(tmp_path: Path, module: str, body: str, *args: str) -> list[str]:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body), encoding="utf-8")
    done = subprocess.run(
        [DBTRIGGER, "run", *args, "--interval", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stderr.splitlines() if _LINE.match(line)]


def test_ticks_progress_and_a_window_pinned_by_a_retry(tmp_path: Path) -> None:
    shop(tmp_path, 2500)
    lines = run(
        tmp_path,
        "app",
        """
        from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

        trigger = PollTrigger(
            name="orders",
            source=SqlAlchemySource(url="sqlite:///shop.db", table="orders",
                                    cursor_column="seq", pk_columns=["id"]),
            checkpoint_store=FileCheckpointStore("state"),
            batch_size=100, max_batches_per_tick=10,
            retry_delay_seconds=3600, retry_delay_max_seconds=3600,
        )

        @trigger.handler
        def handle(events, ctx):
            for e in events:
                if e.pk["id"] == 1500:
                    ctx.retry(e, "downstream 503")
        """,
        "app:trigger",
        "--max-ticks",
        "6",
        "--progress-interval",
        "0",
    )
    ticks = [line for line in lines if "dbtrigger.runner: orders: " in line]
    first = next(line for line in ticks if "committed" in line)
    assert re.search(
        r"INFO dbtrigger\.runner: orders: committed 1,000 rows in 10 batches, checkpoint 1000 "
        r"id=1000 \(committed \d\d:\d\d:\d\d\.\d{3}Z\); more pending",
        first,
    ), first
    # The per-batch records are DEBUG: nothing of the runtime's at INFO.
    assert [line for line in lines if " INFO dbtrigger.runtime" in line] == []
    # The first progress line: a rate only once the drain has run a second, and then true.
    progress = [line for line in ticks if "catching up" in line]
    assert progress
    counts = [re.search(r"catching up: ([\d,]+) rows", line)[1] for line in progress]  # type: ignore[index]
    assert len(counts) == len(set(counts)), progress  # held back: no line repeated per tick
    for line in progress:
        m = re.search(r"catching up: ([\d,]+) rows in ([\d.]+)s(?: \(([\d,]+) rows/s\))?", line)
        assert m is not None, line
        delivered, elapsed = int(m[1].replace(",", "")), float(m[2])
        if m[3] is not None:
            assert elapsed >= 1.0, line
            assert int(m[3].replace(",", "")) <= delivered / (elapsed - 0.05), line
    # A retry pins the window: rows wait behind it, so never "caught up" nor "nothing after".
    assert not any("caught up" in line for line in lines)
    idle = [line for line in ticks if ": idle: " in line]
    assert len(idle) == 1, idle  # said once, then DEBUG while it lasts
    assert "held back by the settled window" in idle[0]
    assert "nothing after the checkpoint" not in idle[0]
    assert "1 event(s) waiting for a retry, the next due at " in idle[0]
    assert any("WARNING dbtrigger.runtime: the settled window blocks progress" in x for x in lines)


def test_a_partitioned_poller_names_its_partitions_and_its_guard_once(tmp_path: Path) -> None:
    shop(tmp_path, 300)
    lines = run(
        tmp_path,
        "parts",
        """
        from dbtrigger import FileCheckpointStore, SqlAlchemySource
        from dbtrigger.partitions import PartitionedPoller

        orders = PartitionedPoller(
            name="orders",
            source=SqlAlchemySource(url="sqlite:///shop.db", table="orders",
                                    cursor_column="seq", pk_columns=["id"]),
            checkpoint_store=FileCheckpointStore("state"),
            partitions=4, batch_size=50,
        )

        @orders.handler
        def handle(events):
            pass
        """,
        "parts:orders",
        "--max-ticks",
        "6",
    )
    guard = [line for line in lines if "dbtrigger.sources:" in line and "visibility" in line]
    assert len(guard) == 1, guard
    ticks = [line for line in lines if "dbtrigger.runner: orders: committed" in line]
    assert ticks
    assert all("checkpoints of its 4 partition(s)" in line for line in ticks), ticks
    assert not any("checkpoint (beginning)" in line for line in lines)
    idle = [line for line in lines if "dbtrigger.runner: orders: idle" in line]
    assert len(idle) == 1, idle
    assert "nothing after the checkpoints of its 4 partition(s)" in idle[0]
    assert any("dbtrigger.runner: orders: caught up: 300 rows" in line for line in lines)
