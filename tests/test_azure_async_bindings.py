"""Async functions whose bindings read and write, several ticks at once, in a real
``azure.functions.FunctionApp`` (``dbtrigger.azure.blocking``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import azure.functions as func
import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from dbtrigger import DbBindings, DbOut, InMemoryCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.azure import binding_of
from tests.databases import TestDatabase


def timer() -> TimerRequest:
    return TimerRequest(past_due=False, schedule_status={}, schedule={"AdjustForDST": True})


def test_async_functions_with_bindings_do_not_starve_the_default_executor(
    sqlite_db: TestDatabase, request: pytest.FixtureRequest
) -> None:
    """Each async tick waits in a thread of the loop's default executor while its
    handler runs; the output write and the input read then asked that executor for a
    thread too. With as many functions firing at once as it has threads (here 2, as
    on a one-core host with more functions) none was left: every invocation hung."""
    db = sqlite_db
    db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    db.execute("INSERT INTO orders VALUES (1, 1), (2, 2)")
    db.execute("CREATE TABLE sink (id INTEGER, fn TEXT, seen INTEGER, PRIMARY KEY (id, fn))")
    app = func.FunctionApp()
    bindings = DbBindings()
    functions = ("first", "second")

    def register(name: str) -> None:
        source = SqlAlchemySource(
            url=db.url, table="orders", cursor_column="seq", pk_columns=["id"]
        )
        request.addfinalizer(source.close)

        @app.function_name(name=name)
        @app.schedule(schedule="0 */5 * * * *", arg_name="timer")
        @bindings.trigger(
            arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore(), name=name
        )
        @bindings.input("count", url=db.url, query="SELECT count(*) AS n FROM orders")
        @bindings.output(
            "out", url=db.url, table="sink", action="upsert", conflict_columns=["id", "fn"]
        )
        async def poll(
            timer: func.TimerRequest,
            events: list[RowChange],
            count: list[dict[str, Any]],
            out: DbOut,
        ) -> None:
            out.set([{"id": e.pk["id"], "fn": name, "seen": count[0]["n"]} for e in events])

    for name in functions:
        register(name)
    invocations = [f.get_user_function() for f in app.get_functions()]
    for invoke in invocations:
        request.addfinalizer(binding_of(invoke).output.close)

    async def both() -> None:
        small = concurrent.futures.ThreadPoolExecutor(max_workers=len(functions))
        asyncio.get_running_loop().set_default_executor(small)
        # Bounded: a hang shows as a timeout here, not as a stuck test run.
        await asyncio.wait_for(asyncio.gather(*(f(timer=timer()) for f in invocations)), 60)

    asyncio.run(both())
    with db.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, fn, seen FROM sink ORDER BY fn, id")).all()
    assert [tuple(r) for r in rows] == [
        (1, "first", 2),
        (2, "first", 2),
        (1, "second", 2),
        (2, "second", 2),
    ]
