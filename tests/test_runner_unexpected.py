"""``dbtrigger run`` never dies on an exception a tick did not map.

A dead-letter sink of one's own that raised anything but ``QuarantineError``
(a ``TypeError`` from a bug in it) escaped the tick raw and ended the worker
with a traceback; so did any other unmapped exception (a source adapter of
one's own). Now the sink's failure is a ``QuarantineError`` (retried, nothing
set aside, the event kept), and the runner takes any exception a tick raises
for a failed tick: logged with its traceback once, retried with backoff.
Through the installed console script, on SQLite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, InMemoryCheckpointStore, QueueTrigger, RowChange
from dbtrigger.errors import QuarantineError
from dbtrigger.quarantine import QuarantineRecord
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
)
from tests.test_queue_columns import make_jobs
from tests.test_source_sqlalchemy import insert, naive, orders_table

DBTRIGGER = str(Path(sys.executable).with_name("dbtrigger"))

SINK_APP = """
from pathlib import Path
from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.quarantine import JsonLinesQuarantineSink

FIXED = Path({fixed!r})


class HomeMadeSink:
    \"\"\"A dead-letter sink of one's own, with a bug until FIXED exists.\"\"\"

    def __init__(self, path):
        self.inner = JsonLinesQuarantineSink(path)

    def describe(self):
        return "home-made sink"

    def put(self, records):
        if not FIXED.exists():
            raise TypeError("put() got an unexpected keyword argument 'rows'")
        self.inner.put(records)


orders = PollTrigger(
    name="orders",
    source=SqlAlchemySource(url={url!r}, table="orders", cursor_column="updated_at",
                            pk_columns=["id"]),
    checkpoint_store=FileCheckpointStore({state!r}),
    quarantine=HomeMadeSink({dead!r}),
)


@orders.handler
def handle(events, ctx):
    for e in events:
        if e.pk["id"] == 1:
            ctx.reject(e, "order 1 is malformed")
"""

SOURCE_APP = """
from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

CALLS = {{"fetch": 0}}


class HomeMadeSource:
    \"\"\"A source adapter of one's own whose first two reads hit a bug.\"\"\"

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fetch(self, after, limit):
        CALLS["fetch"] += 1
        if CALLS["fetch"] <= 2:
            raise RuntimeError("adapter bug: cursor index out of range")
        return self.inner.fetch(after, limit)


orders = PollTrigger(
    name="orders",
    source=HomeMadeSource(SqlAlchemySource(url={url!r}, table="orders",
                                           cursor_column="updated_at", pk_columns=["id"])),
    checkpoint_store=FileCheckpointStore({state!r}),
)


@orders.handler
def handle(events):
    pass
"""


def run(tmp_path: Path, spec: str, ticks: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            DBTRIGGER,
            "run",
            spec,
            "--interval",
            "0",
            "--max-backoff",
            "0",
            "--max-ticks",
            str(ticks),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
        check=False,
    )


def stored_id(state: Path) -> int | None:
    doc = json.loads((state / "orders.json").read_text()) if state.exists() else None
    cp = doc["checkpoint"] if doc else None
    return int(cp["cursor"]["tiebreaker"]["id"]) if cp else None


def test_a_failing_dead_letter_sink_fails_the_tick_and_keeps_the_event(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    insert(
        sqlite_db, orders_table(sqlite_db), [{"id": i, "updated_at": naive(i)} for i in range(3)]
    )
    fixed, dead, state = tmp_path / "fixed", tmp_path / "dead.jsonl", tmp_path / "state"
    (tmp_path / "sink_app.py").write_text(
        SINK_APP.format(url=sqlite_db.url, fixed=str(fixed), dead=str(dead), state=str(state))
    )
    broken = run(tmp_path, "sink_app:orders", 2)
    assert broken.returncode == 0, broken.stderr  # the worker lived through it
    failed = [line for line in broken.stderr.splitlines() if "tick failed (QuarantineError" in line]
    assert len(failed) == 2, broken.stderr
    assert "home-made sink failed to store 1 record(s): TypeError" in failed[0]
    assert broken.stderr.count("Traceback (most recent call last)") == 1  # the sink's, once
    assert "unexpected keyword argument 'rows'" in broken.stderr
    assert not dead.exists()
    assert stored_id(state) in (None, 0)  # never past the event it could not set aside

    fixed.touch()
    healed = run(tmp_path, "sink_app:orders", 2)
    assert healed.returncode == 0, healed.stderr
    assert [json.loads(line)["pk"] for line in dead.read_text().splitlines()] == [{"id": 1}]
    assert stored_id(state) == 2


def test_an_unexpected_exception_is_a_failed_tick_not_a_dead_worker(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    insert(
        sqlite_db, orders_table(sqlite_db), [{"id": i, "updated_at": naive(i)} for i in range(3)]
    )
    state = tmp_path / "state"
    (tmp_path / "adapter_app.py").write_text(SOURCE_APP.format(url=sqlite_db.url, state=str(state)))
    done = run(tmp_path, "adapter_app:orders", 4)
    assert done.returncode == 0, done.stderr
    failed = [line for line in done.stderr.splitlines() if "tick failed (unexpected" in line]
    assert len(failed) == 2, done.stderr
    assert " ERROR dbtrigger.runner: " in failed[0]
    assert "RuntimeError: adapter bug: cursor index out of range" in failed[0]
    assert done.stderr.count("Traceback (most recent call last)") == 1
    assert "orders: committed 3 rows" in done.stderr
    assert "(2 failed ticks)" in done.stdout
    assert stored_id(state) == 2


class BuggySink:
    """A dead-letter sink of one's own that raises something of its own."""

    def __init__(self) -> None:
        self.calls = 0

    def describe(self) -> str:
        return "buggy sink"

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        self.calls += 1
        raise TypeError("put() got an unexpected keyword argument 'rows'")


def reject_item_2(events: list[RowChange], ctx: Any) -> None:
    for e in events:
        if e.pk["id"] == 2:
            ctx.reject(e, "item 2 is malformed")


@pytest.mark.parametrize("shape", ["handler", "fan-out"])
def test_every_poller_shape_maps_a_sink_bug_and_keeps_the_event(
    sqlite_db: TestDatabase, shape: str
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), range(1, 4))
    store = InMemoryCheckpointStore()
    sink = BuggySink()
    options: dict[str, Any] = {"quarantine": sink}
    if shape == "fan-out":
        options["subscribers"] = {"a": reject_item_2, "b": lambda events: None}
    trigger = make_trigger(items_source(sqlite_db), store, **options)
    with pytest.raises(QuarantineError, match="buggy sink failed to store 1 record") as caught:
        trigger.tick(None if shape == "fan-out" else reject_item_2)
    assert isinstance(caught.value.__cause__, TypeError)
    assert sink.calls >= 1
    assert (checkpoint_id(store) or 0) < 2  # the event it could not set aside is kept


def test_a_queue_maps_a_sink_bug_and_keeps_the_row(db: TestDatabase) -> None:
    make_jobs(db, 3)
    source = ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        sink = BuggySink()
        queue = QueueTrigger(name="jobs", source=source, batch_size=10, quarantine=sink)
        with pytest.raises(QuarantineError, match="buggy sink failed to store 1 record"):
            queue.tick_result(reject_item_2)
        assert sink.calls == 1
        with db.engine.connect() as conn:
            statuses = dict(
                conn.execute(sa.text(f"SELECT id, dbt_status FROM {db.qualified('jobs')}")).all()
            )
        # Row 2 is not dead: its claim expires and it is tried again; the others are done.
        assert statuses == {1: "done", 2: "claimed", 3: "done"}
    finally:
        source.close()
