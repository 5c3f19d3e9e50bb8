"""Partitioned polling in a real FunctionApp: a timer coordinator and a queue worker, on Azurite."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest
from azure.functions.timer import TimerRequest
from azure.storage.queue import QueueClient

from dbtrigger import RowChange, SqlAlchemySource
from dbtrigger.azure import DbBindings
from dbtrigger.azure.partitions import work
from dbtrigger.state.stores.blob import BlobCheckpointStore
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.test_partitions_poller import insert, make_table

pytestmark = pytest.mark.azurite


def timer() -> TimerRequest:
    return TimerRequest(past_due=False, schedule_status={}, schedule={"AdjustForDST": True})


def test_coordinator_queues_partitions_with_work_and_workers_drain_them(
    sqlite_db: TestDatabase, azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_table(sqlite_db, 300)
    monkeypatch.setenv("AzureWebJobsStorage", azurite.connection_string)
    store = BlobCheckpointStore.from_connection_string(
        azurite.connection_string, container="fnparts", app_name="app", create_container=True
    )
    app = func.FunctionApp()
    db = DbBindings()
    delivered: list[int] = []

    @db.partitioned_trigger(
        app,
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=store,
        partitions=4,
        schedule="0 */1 * * * *",
        batch_size=20,
        max_batches_per_tick=2,
    )
    def orders(events: list[RowChange]) -> None:
        delivered.extend(e.pk["id"] for e in events)

    functions = {f.get_function_name(): f for f in app.get_functions()}
    assert set(functions) == {"orders", "orders_coordinator"}
    kinds = {name: [b.type for b in f.get_bindings()] for name, f in functions.items()}
    assert kinds["orders_coordinator"] == ["timerTrigger"]
    assert kinds["orders"] == ["queueTrigger"]

    queue = QueueClient.from_connection_string(azurite.connection_string, "orders-partitions")

    def run_coordinator() -> list[str]:
        functions["orders_coordinator"].get_user_function()(timer=timer())
        bodies = []
        for message in queue.receive_messages(max_messages=32):
            bodies.append(base64.b64decode(message.content).decode())
            queue.delete_message(message)
        return bodies

    bodies = run_coordinator()
    assert sorted(json.loads(b)["partition"] for b in bodies) == [
        "p000-064",
        "p064-128",
        "p128-192",
        "p192-256",
    ]
    worker = functions["orders"].get_user_function()
    for body in bodies:
        worker(msg=func.QueueMessage(body=body.encode()))
    assert sorted(delivered) == list(range(1, 301))
    assert run_coordinator() == []  # nothing pending: nothing queued

    insert(sqlite_db, range(301, 311))
    bodies = run_coordinator()
    assert 1 <= len(bodies) <= 4
    for body in bodies + bodies:  # a message delivered twice is harmless
        worker(msg=func.QueueMessage(body=body.encode()))
    assert Counter(delivered).most_common(1)[0][1] == 1
    assert sorted(delivered) == list(range(1, 311))


def test_work_refuses_foreign_messages_and_drops_stale_ones(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    from dbtrigger import FileCheckpointStore  # noqa: PLC0415
    from dbtrigger.errors import ConfigurationError  # noqa: PLC0415
    from dbtrigger.partitions import PartitionedPoller  # noqa: PLC0415

    make_table(sqlite_db, 10)
    (tmp_path / "s").mkdir()
    poller = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "s"),
        partitions=2,
    )
    handler: Any = lambda events, ctx: None  # noqa: E731
    with pytest.raises(ConfigurationError, match="not a dbtrigger partition message"):
        work(poller, b"hello", handler, time_budget_seconds=5)
    with pytest.raises(ConfigurationError, match="reached the function"):
        work(
            poller,
            json.dumps({"poller": "x", "partition": "p000-128"}),
            handler,
            time_budget_seconds=5,
        )
    stale = json.dumps({"poller": "orders", "partition": "p000-064"})
    assert work(poller, stale, handler, time_budget_seconds=5) == 0
    fresh = json.dumps({"poller": "orders", "partition": "p000-128"})
    assert work(poller, fresh, handler, time_budget_seconds=5) > 0


def test_what_partitioned_trigger_registers_runs_and_is_inspected_locally(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dbtrigger run`` and ``partitions show/split`` take the decorated function."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    from dbtrigger import FileCheckpointStore  # noqa: PLC0415
    from dbtrigger.cli import main  # noqa: PLC0415

    make_table(sqlite_db, 90)
    app = func.FunctionApp()
    db = DbBindings()
    delivered: list[int] = []

    @db.partitioned_trigger(
        app,
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=2,
        schedule="0 */1 * * * *",
        batch_size=10,
        max_batches_per_tick=10,
    )
    def orders(events: list[RowChange], context: Any) -> None:
        assert context.fencing_token >= 1
        delivered.extend(e.pk["id"] for e in events)

    module = f"fn_parts_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.orders = orders  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    assert main(["run", f"{module}:orders", "--max-ticks", "3", "--interval", "0"]) == 0
    assert sorted(delivered) == list(range(1, 91))
    assert main(["partitions", "show", "--trigger", f"{module}:orders", "--no-lag"]) == 0
    assert main(["partitions", "split", "--trigger", f"{module}:orders"]) == 0
