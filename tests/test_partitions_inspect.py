"""Visible ownership: ``partitions show`` and ``status`` list members and every partition."""

from __future__ import annotations

import json
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.cli.common import read_state
from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.state.stores.base import CheckpointStore
from tests.databases import TestDatabase


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(db: TestDatabase, rows: int) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (:id, :id)"),
            [{"id": i} for i in range(1, rows + 1)],
        )


def member(db: TestDatabase, store: CheckpointStore, name: str, clock: Clock) -> PartitionedPoller:
    return PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=db.url, table="orders", schema=db.schema, cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=store,
        partitions=4,
        balance_interval_seconds=1,
        member_ttl_seconds=3,
        join_window_seconds=0,
        member_id=name,
        monotonic=clock,
        background=False,
        batch_size=10,
    )


@pytest.fixture
def group(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, PartitionedPoller, PartitionedPoller]:
    """Two members sharing 4 partitions of 100 rows, one batch ticked by each, one
    event waiting for a retry; importable as ``<module>:trigger`` (a third member object)."""
    make_table(sqlite_db, 100)
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    a, b = member(sqlite_db, store, "a", clock), member(sqlite_db, store, "b", clock)
    for _ in range(3):
        a.balance()
        b.balance()
        clock.now += 0.5
    retried: list[str] = []

    def handle(events: list[RowChange], ctx: Any) -> None:
        if not retried:
            retried.append(events[0].event_id)
            ctx.retry(events[0], "downstream busy", delay_seconds=600)

    a.tick(handle)
    b.tick(lambda events: None)
    module = f"inspect_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = member(sqlite_db, store, "cli", Clock())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    return module, a, b


def test_partitions_show_lists_members_and_each_partitions_state(
    group: tuple[str, PartitionedPoller, PartitionedPoller], capsys: pytest.CaptureFixture[str]
) -> None:
    module, _, _ = group
    assert main(["partitions", "show", "--trigger", f"{module}:trigger"]) == 0
    out = capsys.readouterr().out
    assert "4 partitions, 2 member(s), generation 1" in out  # not "0 member(s)"
    members = {line.split()[0]: line.split() for line in out.splitlines() if line[2:3] in "ab"}
    assert set(members) >= {"a", "b"}
    assert "s ago" in out  # the last heartbeat's age
    assert "RETRIES" in out
    assert main(["partitions", "show", "--trigger", f"{module}:trigger", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [m["id"] for m in shown["members"]] == ["a", "b"]
    assert all(m["host"] for m in shown["members"])
    assert {m["id"]: len(m["partitions"]) for m in shown["members"]} == {"a": 2, "b": 2}
    parts = {p["id"]: p for p in shown["partitions"]}
    assert {p["owner"] for p in parts.values()} == {"a", "b"}
    assert sum(p["pending_retries"] for p in parts.values()) == 1
    # Four batches of 10 went out; the one whose first event waits for a retry keeps
    # its checkpoint before that event, so its 10 rows still count as behind.
    assert sum(p["lag_rows"] for p in parts.values()) == 100 - 30
    assert sorted(p["checkpoint"] == "(beginning)" for p in parts.values()) == [0, 0, 0, 1]
    assert all(p["lease"]["state"] == "released" for p in parts.values())


def test_status_shows_the_group_instead_of_its_documents(
    group: tuple[str, PartitionedPoller, PartitionedPoller],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module, _, _ = group
    store = str(tmp_path / "state")
    assert main(["status", "--store", store]) == 0
    out = capsys.readouterr().out
    assert "partitioned poller orders: 4 partitions, 2 member(s)" in out
    assert "orders.p000-064" not in out  # shown as rows of the group, not as pollers
    assert "p000-064" in out
    assert main(["status", "--store", store, "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert shown["partitioned"] is True
    assert len(shown["members"]) == 2
    assert all(p["lag_rows"] is None for p in shown["partitions"])  # no --source: no lag
    assert main(["status", "orders", "--store", store, "--source", f"{module}:trigger"]) == 0
    out = capsys.readouterr().out
    assert "2 member(s)" in out
    argv = ["status", "orders", "--store", store, "--json", "--source", f"{module}:trigger"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert sum(p["lag_rows"] for p in one["partitions"]) == 70


def test_status_with_only_source_uses_the_partitioned_pollers_own_store(
    group: tuple[str, PartitionedPoller, PartitionedPoller],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dbtrigger status --source app:orders`` naming a PartitionedPoller failed with
    "no state store given: ... or name the poller's trigger with --source" - what it
    had just been given - while a PollTrigger's --source brings its own store."""
    module, _, _ = group
    monkeypatch.delenv("DBTRIGGER_STORE", raising=False)
    assert main(["status", "--source", f"{module}:trigger"]) == 0
    assert "partitioned poller orders: 4 partitions, 2 member(s)" in capsys.readouterr().out
    assert main(["status", "orders", "--source", f"{module}:trigger", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert sum(p["lag_rows"] for p in one["partitions"]) == 70
    argv = ["history", "orders.p000-064", "--source", f"{module}:trigger"]
    assert main(argv) == 0


def test_reset_naming_a_partitioned_poller_says_its_partitions_change_one_by_one() -> None:
    """``dbtrigger reset orders`` on a partitioned poller said only that there was no
    state for 'orders' and that the store holds 'orders (partitioned)'."""
    store = InMemoryCheckpointStore()
    for key in ("orders.members", "orders.p000-064", "orders.p064-128"):
        store.write(key, b"{}", if_match=None)
    with pytest.raises(ConfigurationError, match=r"partitioned poller.*dbtrigger reset orders\.p"):
        read_state(store, "orders")
