"""DbBindings in a real ``azure.functions.FunctionApp``, invoked with real TimerRequests."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.util
import inspect
import logging
import subprocess
import sys
import textwrap
import threading
import typing
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest
import sqlalchemy as sa
from azure.functions.decorators.core import BindingDirection
from azure.functions.timer import TimerRequest
from azure.storage.blob import BlobServiceClient

from dbtrigger import (
    BatchContext,
    DbBindings,
    DbOut,
    HandlerError,
    InMemoryCheckpointStore,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.azure import (
    LeaseScheduleWarning,
    binding_of,
    lease_schedule_conflict,
    schedule_interval,
)
from dbtrigger.errors import ConfigurationError, FingerprintMismatchError
from dbtrigger.settings import DeferredSettingError
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.stores.blob import BlobCheckpointStore
from dbtrigger.testing import CountingStore, StoreCounts
from tests.azurite import Azurite
from tests.databases import TestDatabase

ROOT = Path(__file__).resolve().parent.parent
EVERY_MINUTE = "0 */1 * * * *"


def timer(past_due: bool = False) -> TimerRequest:
    return TimerRequest(past_due=past_due, schedule_status={}, schedule={"AdjustForDST": True})


def assert_host_accepts(function: func.decorators.function_app.Function) -> None:
    """The worker's indexing rule: Python parameters == binding names (``context`` aside),
    and every annotation resolves."""
    user = function.get_user_function()
    params = set(inspect.signature(user).parameters) - {"context"}
    bindings = {b["name"] for b in function.get_bindings_dict()["bindings"]} - {"$return"}
    assert params == bindings, (params, bindings)
    hints = typing.get_type_hints(user)
    assert set(hints) <= bindings | {"return"}


@pytest.fixture
def orders(sqlite_db: TestDatabase) -> TestDatabase:
    sqlite_db.execute(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, "
        "amount INTEGER NOT NULL, updated_at TEXT NOT NULL)"
    )
    sqlite_db.execute(
        "INSERT INTO orders VALUES (:id, 'new', :amount, :ts)",
        [{"id": i, "amount": i * 10, "ts": f"2026-01-01 12:00:{i:02d}"} for i in range(1, 8)],
    )
    return sqlite_db


@pytest.fixture
def source(orders: TestDatabase) -> Iterator[SqlAlchemySource]:
    src = SqlAlchemySource(
        url=orders.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    yield src
    src.close()


def ids(events: list[RowChange]) -> list[int]:
    return [e.pk["id"] for e in events]


# --- registration ---------------------------------------------------------------------


def test_function_app_lists_the_function_with_its_timer_binding(
    source: SqlAlchemySource,
) -> None:
    app = func.FunctionApp()
    db = DbBindings()

    @app.function_name(name="orders_poll")
    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer", use_monitor=True)
    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        schedule=EVERY_MINUTE,
    )
    def orders_poll(timer: func.TimerRequest, events: list[RowChange]) -> None:
        return None

    functions = app.get_functions()
    assert [f.get_function_name() for f in functions] == ["orders_poll"]
    (function,) = functions
    trigger = function.get_trigger()
    assert trigger is not None
    assert trigger.get_binding_name() == "timerTrigger"
    assert function.get_bindings_dict()["bindings"] == [
        {
            "direction": BindingDirection.IN,
            "type": "timerTrigger",
            "name": "timer",
            "schedule": EVERY_MINUTE,
            "useMonitor": True,
        }
    ]
    assert_host_accepts(function)
    user = function.get_user_function()
    assert user.__name__ == "orders_poll"
    assert inspect.signature(user).return_annotation is None
    assert db.triggers["orders_poll"] is binding_of(user).poll_trigger


def test_invoking_with_a_timer_request_drains_rows_into_the_handler(
    source: SqlAlchemySource,
) -> None:
    app = func.FunctionApp()
    db = DbBindings()
    store = InMemoryCheckpointStore()
    received: list[tuple[Any, list[int]]] = []

    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer")
    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=store,
        name="orders",
        batch_size=3,
        max_batches_per_tick=5,
    )
    def orders_poll(timer: func.TimerRequest, events: list[RowChange]) -> None:
        received.append((timer, ids(events)))

    (function,) = app.get_functions()
    invoke = function.get_user_function()
    request = timer()
    assert invoke(timer=request) is None
    assert [batch for _, batch in received] == [[1, 2, 3], [4, 5, 6], [7]]
    assert all(t is request for t, _ in received)  # the host's binding reaches the handler
    invoke(request)  # positional works too; nothing new
    assert len(received) == 3
    state = docmod.loads(store.read("orders").data)
    assert state.checkpoint is not None
    assert state.checkpoint.position.pk == {"id": 7}


def test_context_parameter_and_custom_event_name(source: SqlAlchemySource) -> None:
    app = func.FunctionApp()
    db = DbBindings()
    contexts: list[BatchContext] = []

    @app.schedule(schedule=EVERY_MINUTE, arg_name="tick")
    @db.trigger(arg_name="rows", source=source, checkpoint_store=InMemoryCheckpointStore())
    def poll(tick: func.TimerRequest, rows: list[RowChange], context: BatchContext) -> None:
        assert len(rows) == 7
        contexts.append(context)

    (function,) = app.get_functions()
    assert list(inspect.signature(function.get_user_function()).parameters) == ["tick"]
    assert_host_accepts(function)
    function.get_user_function()(tick=timer())
    (ctx,) = contexts
    assert ctx.poller_name == "poll"
    assert ctx.fencing_token == 1
    assert ctx.checkpoint_after.pk == {"id": 7}


def test_async_handler_runs_on_the_hosts_event_loop(source: SqlAlchemySource) -> None:
    app = func.FunctionApp()
    db = DbBindings()
    seen: list[tuple[list[int], int]] = []

    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer")
    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=4,
        max_batches_per_tick=2,
    )
    async def orders_poll(timer: func.TimerRequest, events: list[RowChange]) -> None:
        await asyncio.sleep(0)
        seen.append((ids(events), threading.get_ident()))

    (function,) = app.get_functions()
    user = function.get_user_function()
    assert inspect.iscoroutinefunction(user)
    assert_host_accepts(function)

    async def host() -> int:
        await user(timer=timer())
        return threading.get_ident()

    loop_thread = asyncio.run(host())
    assert [batch for batch, _ in seen] == [[1, 2, 3, 4], [5, 6, 7]]
    assert {thread for _, thread in seen} == {loop_thread}


def test_async_handler_with_output(source: SqlAlchemySource, orders: TestDatabase) -> None:
    orders.execute(
        "CREATE TABLE processed (order_id INTEGER, cursor TEXT, PRIMARY KEY (order_id, cursor))"
    )
    app = func.FunctionApp()
    db = DbBindings()

    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer")
    @db.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    @db.output(
        "out",
        url=orders.url,
        table="processed",
        action="upsert",
        conflict_columns=["order_id", "cursor"],
    )
    async def orders_poll(timer: func.TimerRequest, events: list[RowChange], out: DbOut) -> None:
        out.set([{"order_id": e.pk["id"], "cursor": str(e.cursor)} for e in events])

    (function,) = app.get_functions()
    assert_host_accepts(function)
    user = function.get_user_function()
    try:
        asyncio.run(user(timer=timer()))
    finally:
        binding_of(user).output.close()
    assert orders.scalar("SELECT count(*) FROM processed") == 7


# --- failure policy ---------------------------------------------------------------------


def test_lease_contention_returns_quietly(source: SqlAlchemySource) -> None:
    store = CountingStore(InMemoryCheckpointStore())
    now = dt.datetime.now(dt.timezone.utc)
    held = leasemod.decide_acquire(
        None,
        poller="orders",
        fingerprint=source.fingerprint(),
        owner="another-instance",
        now=now,
        ttl=dt.timedelta(minutes=5),
    )
    assert isinstance(held, leasemod.Acquired)
    store.inner.write("orders", docmod.dumps(held.document), if_match=None)
    store.reset()
    db = DbBindings()
    calls: list[int] = []

    @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="orders")
    def orders_poll(timer: object, events: list[RowChange]) -> None:
        calls.append(len(events))

    assert orders_poll(timer=timer()) is None
    assert calls == []
    assert store.counts == StoreCounts(reads=1)


def test_lost_lease_returns_quietly(source: SqlAlchemySource) -> None:
    """Another instance takes over mid-batch: ours is discarded, without failing the host."""
    store = InMemoryCheckpointStore()
    clock_now = [dt.datetime(2026, 4, 7, tzinfo=dt.timezone.utc)]
    db = DbBindings()

    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=store,
        name="orders",
        lease_ttl_seconds=30,
        owner_id="b",
        clock=lambda: clock_now[0],
    )
    def other(timer: object, events: list[RowChange]) -> None:
        return None

    slow_db = DbBindings()

    @slow_db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=store,
        name="orders",
        lease_ttl_seconds=30,
        owner_id="a",
        clock=lambda: clock_now[0],
    )
    def slow(timer: object, events: list[RowChange]) -> None:
        clock_now[0] += dt.timedelta(minutes=5)
        other(timer=None)  # takes the expired lease and commits everything

    assert slow(timer=timer()) is None
    state = docmod.loads(store.read("orders").data)
    assert state.lease is not None
    assert state.lease.owner_id == "b"


def test_handler_and_operator_errors_fail_the_invocation(
    source: SqlAlchemySource, orders: TestDatabase
) -> None:
    store = InMemoryCheckpointStore()
    db = DbBindings()

    @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="orders")
    def failing(timer: object, events: list[RowChange]) -> None:
        raise RuntimeError("downstream is down")

    with pytest.raises(HandlerError, match="downstream is down"):
        failing(timer=timer())

    changed = SqlAlchemySource(
        url=orders.url, table="orders", cursor_column="updated_at", pk_columns=["id", "status"]
    )
    del db  # redeployed: the app before is gone (a live one would refuse the name)
    try:
        other_db = DbBindings()

        @other_db.trigger(arg_name="events", source=changed, checkpoint_store=store, name="orders")
        def redefined(timer: object, events: list[RowChange]) -> None:
            return None

        with pytest.raises(FingerprintMismatchError):
            redefined(timer=timer())
    finally:
        changed.close()


# --- decoration-time checks ----------------------------------------------------------------


def test_output_above_a_trigger_is_refused_before_the_trigger_is_built(
    source: SqlAlchemySource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order check read an attribute set only once the poller was built: above a
    trigger whose app setting was missing, @db.output passed and would have written
    its rows after the checkpoint commit."""
    monkeypatch.delenv("DBT_MISSING_BATCH", raising=False)
    db = DbBindings()
    store = InMemoryCheckpointStore()
    with pytest.raises(ConfigurationError, match=r"below @db\.trigger"):

        @db.output("out", url="sqlite://", table="t")
        @db.trigger(
            arg_name="events",
            source=source,
            checkpoint_store=store,
            batch_size="%DBT_MISSING_BATCH%",
        )
        def deferred(timer: object, events: list[RowChange], out: DbOut) -> None:
            return None


def test_decoration_errors(source: SqlAlchemySource) -> None:
    app = func.FunctionApp()
    db = DbBindings()
    store = InMemoryCheckpointStore()
    with pytest.raises(ConfigurationError, match="no parameter 'events'"):
        db.trigger(arg_name="events", source=source, checkpoint_store=store)(lambda timer: None)
    with pytest.raises(ConfigurationError, match=r"below @app\.schedule"):

        @db.trigger(arg_name="events", source=source, checkpoint_store=store)
        @app.schedule(schedule=EVERY_MINUTE, arg_name="timer")
        def upside_down(timer: object, events: list[RowChange]) -> None:
            return None

    with pytest.raises(ConfigurationError, match=r"below @db\.trigger"):

        @db.output("out", url="sqlite://", table="t")
        @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="x")
        def output_on_top(timer: object, events: list[RowChange], out: DbOut) -> None:
            return None

    @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="dup")
    def first(timer: object, events: list[RowChange]) -> None:
        return None

    with pytest.raises(ConfigurationError, match="two triggers are named 'dup'"):

        @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="dup")
        def second(timer: object, events: list[RowChange]) -> None:
            return None

    with pytest.raises(ConfigurationError, match="by name"):

        @db.trigger(arg_name="events", source=source, checkpoint_store=store, name="va")
        def varargs(timer: object, events: list[RowChange], *rest: object) -> None:
            return None


def test_ttl_shorter_than_the_timer_interval_warns_at_decoration(
    source: SqlAlchemySource,
) -> None:
    db = DbBindings()
    store = InMemoryCheckpointStore()
    with pytest.warns(LeaseScheduleWarning, match="shorter than the timer interval") as record:

        @db.trigger(
            arg_name="events",
            source=source,
            checkpoint_store=store,
            name="slow_timer",
            lease_ttl_seconds=60,
            schedule="0 */5 * * * *",
        )
        def slow_timer(timer: object, events: list[RowChange]) -> None:
            return None

    assert record[0].filename == __file__  # points at the decorated function

    # A timer faster than the TTL (even faster than TTL/2) is fine: no warning,
    # and pytest turns any warning into an error here.
    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=store,
        name="fast_timer",
        lease_ttl_seconds=120,
        schedule="*/10 * * * * *",
    )
    def fast_timer(timer: object, events: list[RowChange]) -> None:
        return None

    with pytest.raises(ConfigurationError, match="applied twice"):
        db.trigger(arg_name="events", source=source, checkpoint_store=store)(fast_timer)

    def plain(timer: object, events: list[RowChange]) -> None:
        return None

    with pytest.raises(ConfigurationError, match="six-field"):
        db.trigger(
            arg_name="events",
            source=source,
            checkpoint_store=store,
            name="bad",
            schedule="*/5 * * * *",
        )(plain)


def test_schedule_hint_may_be_an_app_setting(
    source: SqlAlchemySource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBT_TIMER", "0 0 * * * *")
    db = DbBindings()
    with pytest.warns(LeaseScheduleWarning, match="3600"):

        @db.trigger(
            arg_name="events",
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            schedule="%DBT_TIMER%",
        )
        def hourly(timer: object, events: list[RowChange]) -> None:
            return None

    monkeypatch.delenv("DBT_TIMER")

    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        schedule="%DBT_TIMER%",  # unresolvable here: the host reports it, we skip the check
    )
    def unresolved(timer: object, events: list[RowChange]) -> None:
        return None


@pytest.mark.parametrize(
    ("schedule", "seconds"),
    [
        ("0 */5 * * * *", 300),
        ("*/10 * * * * *", 10),
        ("0 0 * * * *", 3600),
        ("0 30 9 * * 1-5", 86400),
        ("0 30 9 * * Mon-Fri", 86400),
        ("0 0 9,17 * * *", 8 * 3600),
        ("0 30 9 * Jan Mon", 7 * 86400),
        ("0 0 0 1 * *", 28 * 86400),
        ("0 0 12 * * 0,7", 7 * 86400),
        ("15,45 * * * * *", 30),
        ("0 5-10/5 * * * *", 300),
        ("00:05:00", 300),
        ("1.00:00:00", 86400),
        ("0 0 0 29 2 *", 1461 * 86400),  # leap days: 2024 and 2028
        ("0 0 0 29 2 Mon", None),  # a Monday only in 2016 and 2044: not twice in 5 years
        # The host's TimeSpan rules (.NET TimeSpan.Parse): a first number of 24 or
        # more makes "a:b:c" days:hours:minutes, and "d:hh:mm:ss" is days too.
        ("24:00:00", 24 * 86400),
        ("25:00:00:00", 25 * 86400),
        ("30:12:00", 30 * 86400 + 12 * 3600),
        ("00:00:30.5", 30.5),
    ],
)
def test_schedule_interval(schedule: str, seconds: int | None) -> None:
    interval = schedule_interval(schedule)
    assert (interval.total_seconds() if interval else None) == seconds


@pytest.mark.parametrize(
    "schedule",
    [
        "* * * * *",
        "61 * * * * *",
        "0 */0 * * * *",
        "0 0 25 * * *",
        "0 0 0 * Foo *",
        "00:00:00",
        "0 \u00b2 * * * *",  # a superscript two: str.isdigit says yes, int() says no
        "0 \u0665 * * * *",  # an Arabic-Indic five: not an NCRONTAB number
        "00:60:00",
        "00:00:60",
        "1.24:00:00",
    ],
)
def test_malformed_schedules_are_refused(schedule: str) -> None:
    with pytest.raises(ConfigurationError):
        schedule_interval(schedule)


@pytest.mark.parametrize(
    ("schedule", "why"),
    [
        ("0 0 0 31 2 *", "Feb has no day 31"),
        ("0 0 0 30 2 *", "Feb has no day 30"),
        ("0 0 0 30,31 Feb *", "Feb has no day 30 or 31"),
        ("0 0 12 31 4,6,9,11 *", "Apr, Jun, Sep, Nov have no day 31"),
    ],
)
def test_a_schedule_that_never_fires_is_refused(schedule: str, why: str) -> None:
    """It was taken as "fires fewer than twice in five years" and accepted: a timer
    function that silently never runs."""
    with pytest.raises(ConfigurationError, match="never fires") as err:
        schedule_interval(schedule)
    assert repr(schedule) in str(err.value)
    assert why in str(err.value)


def test_a_trigger_with_a_schedule_that_never_fires_is_refused_at_import(
    source: SqlAlchemySource, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = DbBindings()
    with pytest.raises(ConfigurationError, match="never fires"):

        @db.trigger(
            arg_name="events",
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            schedule="0 0 0 31 2 *",
            lease_ttl_seconds=300,
        )
        def never(timer: object, events: list[RowChange]) -> None:
            return None

    # From an app setting it is configuration: the import goes on, the function fails
    # (tests/test_azure_schedule_settings.py), whether the lease TTL is known or not.
    monkeypatch.setenv("DBT_NEVER", "0 0 0 31 2 *")
    monkeypatch.delenv("DBT_UNSET_TTL", raising=False)

    @DbBindings().trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        schedule="%DBT_NEVER%",
        lease_ttl_seconds="%DBT_UNSET_TTL%",
    )
    def from_setting(timer: object, events: list[RowChange]) -> None:
        return None

    with pytest.raises(DeferredSettingError, match=r"'DBT_NEVER'.*never fires"):
        from_setting(timer=None)

    app = func.FunctionApp()
    with pytest.raises(ConfigurationError, match="never fires"):

        @DbBindings().partitioned_trigger(
            app,
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            partitions=2,
            schedule="0 0 0 30 2 *",
        )
        def spread(events: list[RowChange]) -> None:
            return None

    assert app.get_functions() == []  # nothing registered


def test_lease_schedule_rule() -> None:
    assert lease_schedule_conflict(120, "0 */1 * * * *") is None  # interval 60 <= ttl
    assert lease_schedule_conflict(120, "*/5 * * * * *") is None  # a fast timer is harmless
    assert lease_schedule_conflict(300, "0 */5 * * * *") is None  # equal is fine
    problem = lease_schedule_conflict(299, "0 */5 * * * *")
    assert problem is not None
    assert "lease_ttl_seconds >= 300" in problem


# --- with Azurite ---------------------------------------------------------------------


@pytest.mark.azurite
def test_function_with_blob_state_on_azurite(source: SqlAlchemySource, azurite: Azurite) -> None:
    container = f"t{uuid.uuid4().hex[:20]}"
    store = BlobCheckpointStore.from_connection_string(
        azurite.connection_string, app_name="func-app", container=container, create_container=True
    )
    app = func.FunctionApp()
    db = DbBindings()
    batches: list[list[int]] = []

    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer")
    @db.trigger(
        arg_name="events", source=source, checkpoint_store=store, name="orders", batch_size=5
    )
    def orders_poll(timer: func.TimerRequest, events: list[RowChange]) -> None:
        batches.append(ids(events))

    (function,) = app.get_functions()
    run: Callable[..., None] = function.get_user_function()
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    try:
        run(timer=timer())
        run(timer=timer())
        run(timer=timer())
        assert batches == [[1, 2, 3, 4, 5], [6, 7]]
        blob = service.get_blob_client(container, "state/func-app/orders.json")
        state = docmod.loads(blob.download_blob().readall())
        assert state.checkpoint is not None
        assert state.checkpoint.position.pk == {"id": 7}
        assert state.lease is not None
        assert state.lease.released
    finally:
        service.delete_container(container)


@pytest.mark.azurite
def test_example_function_app_imports_and_runs(
    azurite: Azurite, sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    app_name = f"example-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AzureWebJobsStorage", azurite.connection_string)
    monkeypatch.setenv("DBTRIGGER_APP_NAME", app_name)
    monkeypatch.setenv("ORDERS_DB_URL", sqlite_db.url)
    monkeypatch.setenv("DEST_DB_URL", sqlite_db.url)
    sqlite_db.execute(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, "
        "amount NUMERIC NOT NULL, updated_at TEXT NOT NULL)"
    )
    sqlite_db.execute(
        "CREATE TABLE processed_orders (order_id INTEGER NOT NULL, cursor TEXT NOT NULL, "
        "status TEXT NOT NULL, amount NUMERIC NOT NULL, PRIMARY KEY (order_id, cursor))"
    )
    sqlite_db.execute(
        "INSERT INTO orders VALUES (:id, 'paid', :amount, :ts)",
        [{"id": i, "amount": i * 5, "ts": f"2026-02-01 08:00:{i:02d}"} for i in range(1, 4)],
    )
    http_logger = logging.getLogger("azure.core.pipeline.policies.http_logging_policy")
    previous_level = http_logger.level
    spec = importlib.util.spec_from_file_location(
        f"example_function_app_{app_name.replace('-', '_')}", ROOT / "examples" / "function_app.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        assert http_logger.level == logging.WARNING  # the example silences azure-core's HTTP log
        (function,) = module.app.get_functions()
        assert function.get_function_name() == "orders_poll"
        assert function.get_bindings_dict()["bindings"][0]["type"] == "timerTrigger"
        assert function.get_bindings_dict()["bindings"][0]["schedule"] == module.SCHEDULE
        assert_host_accepts(function)
        run = function.get_user_function()
        run(timer=timer(past_due=True))
        run(timer=timer())  # a replay-free second firing: idle
        with sqlite_db.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT order_id, cursor, status FROM processed_orders ORDER BY order_id")
            ).all()
        assert [tuple(r) for r in rows] == [
            (i, f"2026-02-01 08:00:{i:02d}", "paid") for i in range(1, 4)
        ]
        assert module.state_store.list_keys() == ["orders"]
        assert module.state_store.describe().endswith(f"/db-state/state/{app_name}/")
    finally:
        http_logger.setLevel(previous_level)  # the example's module-level setting is global
        module.orders_source.close()
        binding_of(run).output.close()
        module.state_store.close()


def test_import_dbtrigger_without_the_azure_extra() -> None:
    """The azure packages are an optional extra: only the Blob store needs them."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoAzure(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "azure" or name.startswith("azure."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoAzure())
        import dbtrigger
        from dbtrigger.azure import DbBindings
        from dbtrigger.state import stores
        assert dbtrigger.DbBindings is DbBindings
        try:
            dbtrigger.BlobCheckpointStore
        except ModuleNotFoundError as exc:
            print("blob needs", exc.name)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("blob needs azure")
