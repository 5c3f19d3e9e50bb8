"""``@db.trigger`` with a PgLogicalSource in a real Azure Functions app (poll mode).

The Functions timer runs one tick per firing; the slot is named after the
function (the poller) and is released after each commit, so a firing that
fails to commit is redelivered at the next one.
"""

from __future__ import annotations

import azure.functions as func
import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import DbBindings, HandlerError, InMemoryCheckpointStore, RowChange
from dbtrigger.cdc import PgLogicalSource
from dbtrigger.state import document as docmod
from tests.cdc_servers import CdcDatabase

#: Slots are cluster-wide: another test (or a benchmark run) may hold one on this server.
OWN_SLOT_NAMES = "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"


EVERY_MINUTE = "0 */1 * * * *"


def timer() -> TimerRequest:
    return TimerRequest(past_due=False, schedule_status={}, schedule={"AdjustForDST": True})


def test_a_functions_timer_delivers_log_changes_in_commit_order(
    cdc_db: CdcDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    cdc_db.execute("CREATE TABLE orders (id int PRIMARY KEY, status text)")
    monkeypatch.setenv("ORDERS_CDC_URL", cdc_db.url)
    store = InMemoryCheckpointStore()
    app = func.FunctionApp()
    db = DbBindings()
    received: list[list[tuple[str, int]]] = []
    fail = {"next": False}

    @app.function_name(name="orders_cdc")
    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer", use_monitor=True)
    @db.trigger(
        arg_name="events",
        source=PgLogicalSource("%ORDERS_CDC_URL%", ["orders"], snapshot="never"),
        checkpoint_store=store,
        schedule=EVERY_MINUTE,
        batch_size=3,
        max_batches_per_tick=10,
    )
    def orders_cdc(timer: func.TimerRequest, events: list[RowChange]) -> None:
        if fail["next"]:
            fail["next"] = False
            raise RuntimeError("downstream unavailable")
        received.append([(e.op, e.pk["id"]) for e in events])

    (function,) = app.get_functions()
    invoke = function.get_user_function()
    invoke(timer=timer())  # first firing: publication and slot dbtrigger_orders_cdc created
    assert cdc_db.scalar(OWN_SLOT_NAMES) == "dbtrigger_orders_cdc"

    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 4) g")
        conn.execute("UPDATE orders SET status = 'paid' WHERE id = 2")
        conn.execute("DELETE FROM orders WHERE id = 3")
    fail["next"] = True
    with pytest.raises(HandlerError):
        invoke(timer=timer())
    assert received == []
    invoke(timer=timer())
    assert received == [
        [("insert", 1), ("insert", 2), ("insert", 3)],
        [("insert", 4), ("update", 2), ("delete", 3)],
    ]
    state = docmod.loads(store.read("orders_cdc").data)  # type: ignore[union-attr]
    assert state.checkpoint is not None
    assert str(state.checkpoint.position.cursor).endswith("#0000000001")  # the delete's commit
