"""An orders poller on Azure Functions (Python v2 model), state in Blob Storage.

Every minute the timer fires; the function reads the ``orders`` rows changed
since the checkpoint and upserts one row per (order, change) into
``processed_orders``. The upsert key ``(order_id, cursor)`` makes every
redelivery (a crash, a lost lease, a failed commit) collapse onto the rows
already written, so the sink sees each change exactly once even though
delivery is at-least-once.

App settings (``local.settings.json`` locally, App Settings in Azure):

* ``AzureWebJobsStorage``: where the state blobs live. Locally
  ``UseDevelopmentStorage=true`` (Azurite). In Azure either a connection
  string, or an identity-based connection (``AzureWebJobsStorage__accountName``)
  with the Function App's managed identity holding "Storage Blob Data
  Contributor" on the ``db-state`` container.
* ``DBTRIGGER_APP_NAME``: separates this app's state from other apps and
  deployment slots sharing the storage account (the ``dbtrigger`` CLI reads the
  same name for ``--app``).
* ``ORDERS_DB_URL`` / ``DEST_DB_URL``: SQLAlchemy URLs of the source and the sink.

Operate it from this folder with the CLI, which reads ``local.settings.json``
like ``func start`` does: ``dbtrigger status orders --source
function_app:orders_poll``, ``dbtrigger backfill orders-rebuild --trigger
function_app:orders_poll --from-beginning --reason ... --yes`` (docs/azure.md).

Tables (PostgreSQL shown; any SQLAlchemy database works for the source)::

    CREATE TABLE orders (
        id integer PRIMARY KEY,
        status text NOT NULL,
        amount numeric(12, 2) NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()  -- set on insert, and on update below
    );
    CREATE INDEX orders_cursor ON orders (updated_at, id);
    -- The cursor moves on every UPDATE, whatever the writer sets: one that
    -- forgot updated_at would otherwise change a row the poller never sees again.
    CREATE FUNCTION orders_touch() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN NEW.updated_at := now(); RETURN NEW; END $$;
    CREATE TRIGGER orders_touch BEFORE UPDATE ON orders
        FOR EACH ROW EXECUTE FUNCTION orders_touch();

    CREATE TABLE processed_orders (
        order_id integer NOT NULL,
        cursor text NOT NULL,
        status text NOT NULL,
        amount numeric(12, 2) NOT NULL,
        PRIMARY KEY (order_id, cursor)
    );
"""

from __future__ import annotations

import logging

import azure.functions as func

from dbtrigger import BlobCheckpointStore, DbBindings, DbOut, RowChange, SqlAlchemySource

# azure-core logs every blob request and response at INFO as a 10-20 line record;
# the Python worker forwards it under the function's category, so host.json
# cannot filter it by logger name: silence it here.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)

#: Every minute. Repeated on db.trigger so the lease TTL is checked against it.
SCHEDULE = "0 */1 * * * *"

app = func.FunctionApp()
db = DbBindings()

orders_source = SqlAlchemySource(
    url="%ORDERS_DB_URL%",
    table="orders",
    cursor_column="updated_at",
    pk_columns=["id"],
)

state_store = BlobCheckpointStore.from_connection_string(
    "AzureWebJobsStorage",
    app_name="%DBTRIGGER_APP_NAME%",
    container="db-state",
    # Only used if the container is missing; with container-scoped RBAC create
    # it once at deployment instead.
    create_container=True,
)


@app.function_name(name="orders_poll")
@app.schedule(schedule=SCHEDULE, arg_name="timer", use_monitor=True)
@db.trigger(
    arg_name="events",
    source=orders_source,
    checkpoint_store=state_store,
    name="orders",
    batch_size=100,
    max_batches_per_tick=10,
    lease_ttl_seconds=120,
    schedule=SCHEDULE,
)
@db.output(
    "out",
    url="%DEST_DB_URL%",
    table="processed_orders",
    action="upsert",
    conflict_columns=["order_id", "cursor"],
)
def orders_poll(timer: func.TimerRequest, events: list[RowChange], out: DbOut) -> None:
    if timer.past_due:
        logging.info("orders_poll is running late; catching up from the checkpoint")
    out.set(
        [
            {
                "order_id": event.pk["id"],
                "cursor": str(event.cursor),
                "status": event.after["status"],
                "amount": event.after["amount"],
            }
            for event in events
            if event.after is not None
        ]
    )
