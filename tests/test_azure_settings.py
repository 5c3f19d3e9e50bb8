"""App settings in a real ``azure.functions.FunctionApp``: read at first use, per function.

One missing ``%SETTING%`` used to make the whole module fail to import, so the
host indexed no function at all. Now the app indexes every function and only
the function that needs the setting fails, each invocation, with a
``ConfigurationError`` naming it. Numeric options may come from app settings.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import sys
import textwrap
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from dbtrigger.azure import ENTRA_SCOPES, SQL_COPT_SS_ACCESS_TOKEN, entra_id_engine
from dbtrigger.errors import ConfigurationError
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table

APP = """
import azure.functions as func
from dbtrigger import BlobCheckpointStore, DbBindings, DbOut, SqlAlchemySource

app = func.FunctionApp()
db = DbBindings()
store = BlobCheckpointStore.from_connection_string(
    "AzureWebJobsStorage", app_name="%APP_NAME_{tag}%", container="{container}",
    create_container=True)
bad_store = BlobCheckpointStore.from_connection_string(
    "AzureWebJobsStorage", app_name="%MISSING_APP_NAME_{tag}%", container="{container}",
    create_container=True)
SEEN = []

def source(url):
    return SqlAlchemySource(url=url, table="orders", cursor_column="updated_at",
                            pk_columns=["id"])

@app.function_name(name="good")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source("%ORDERS_URL_{tag}%"), checkpoint_store=store,
            batch_size="%BATCH_{tag}%", max_batches_per_tick="%BATCHES_{tag}%",
            lease_ttl_seconds="%TTL_{tag}%")
def good(timer: func.TimerRequest, events) -> None:
    SEEN.extend(e.pk["id"] for e in events)

@app.function_name(name="no_url")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source("%MISSING_URL_{tag}%"), checkpoint_store=store)
def no_url(timer: func.TimerRequest, events) -> None:
    pass

@app.function_name(name="no_batch_size")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source("%ORDERS_URL_{tag}%"), checkpoint_store=store,
            batch_size="%MISSING_BATCH_{tag}%")
def no_batch_size(timer: func.TimerRequest, events) -> None:
    pass

@app.function_name(name="not_a_number")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source("%ORDERS_URL_{tag}%"), checkpoint_store=store,
            lease_ttl_seconds="%WORDS_{tag}%")
def not_a_number(timer: func.TimerRequest, events) -> None:
    pass

@app.function_name(name="no_app_name")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source("%ORDERS_URL_{tag}%"), checkpoint_store=bad_store)
def no_app_name(timer: func.TimerRequest, events) -> None:
    pass

@app.function_name(name="no_output_url")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source("%ORDERS_URL_{tag}%"), checkpoint_store=store,
            name="with_output")
@db.output("out", url="%MISSING_DEST_{tag}%", table="processed", action="upsert",
           conflict_columns=["order_id"])
def no_output_url(timer: func.TimerRequest, events, out: DbOut) -> None:
    out.set([{{"order_id": e.pk["id"]}} for e in events])
"""


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def timer() -> TimerRequest:
    return TimerRequest(past_due=False)


@pytest.mark.azurite
def test_a_missing_setting_fails_only_the_function_that_needs_it(
    azurite: Azurite,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(7)])
    tag = uuid.uuid4().hex[:8]
    container = f"t{tag}"
    monkeypatch.setenv("AzureWebJobsStorage", azurite.connection_string)
    monkeypatch.setenv(f"APP_NAME_{tag}", "settings-test")
    monkeypatch.setenv(f"ORDERS_URL_{tag}", sqlite_db.url)
    monkeypatch.setenv(f"BATCH_{tag}", "3")
    monkeypatch.setenv(f"BATCHES_{tag}", " 2 ")
    monkeypatch.setenv(f"TTL_{tag}", "90.5")
    monkeypatch.setenv(f"WORDS_{tag}", "two minutes")
    path = tmp_path / f"function_app_{tag}.py"
    path.write_text(textwrap.dedent(APP.format(tag=tag, container=container)))
    module = load(path, f"function_app_{tag}")  # imports although four settings are missing

    functions = {f.get_function_name(): f for f in module.app.get_functions()}
    assert sorted(functions) == sorted(
        ["good", "no_app_name", "no_batch_size", "no_output_url", "not_a_number", "no_url"]
    )
    good = module.db.triggers["good"]
    assert (good.batch_size, good.max_batches_per_tick) == (3, 2)
    assert good.lease_ttl == dt.timedelta(seconds=90.5)

    functions["good"].get_user_function()(timer=timer())
    assert module.SEEN == [0, 1, 2, 3, 4, 5]  # 2 batches of 3 in one tick

    expected = {
        "no_url": f"app setting 'MISSING_URL_{tag}' is referenced but not set",
        "no_batch_size": f"batch_size: app setting 'MISSING_BATCH_{tag}' is referenced",
        "not_a_number": f"lease_ttl_seconds='%WORDS_{tag}%' is 'two minutes', not a number",
        "no_app_name": f"app setting 'MISSING_APP_NAME_{tag}' is referenced but not set",
        "no_output_url": f"app setting 'MISSING_DEST_{tag}' is referenced but not set",
    }
    for name, message in expected.items():
        for _ in range(2):  # every invocation, not only the first
            with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
                functions[name].get_user_function()(timer=timer())
    # The good function keeps working next to them.
    functions["good"].get_user_function()(timer=timer())
    assert list(range(7)) == module.SEEN
    # A missing output URL is found before anything is committed: the batch is not lost.
    monkeypatch.setenv(f"MISSING_DEST_{tag}", sqlite_db.url)
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE processed (order_id integer PRIMARY KEY)"))
    functions["no_output_url"].get_user_function()(timer=timer())
    with sqlite_db.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM processed")).scalar() == 7
    module.store.close()
    module.bad_store.close()


class FakeCredential:
    def __init__(self) -> None:
        self.scopes: list[str] = []

    def get_token(self, scope: str) -> Any:
        self.scopes.append(scope)

        class Token:
            token = "eyJ0eXAiOiJKV1QiLCJ.fake.token"  # noqa: S105 - a test value

        return Token()


def test_entra_id_engine_logs_in_with_a_fresh_token_per_connection(pg: TestDatabase) -> None:
    credential = FakeCredential()
    engine = entra_id_engine(pg.url, credential=credential)  # trust auth accepts any password
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
        assert credential.scopes == [ENTRA_SCOPES["postgresql"]]
        assert "fake" not in engine.url.render_as_string(hide_password=False)
    finally:
        engine.dispose()


def test_entra_id_engine_passes_the_token_to_odbc_for_azure_sql() -> None:
    credential = FakeCredential()
    engine = entra_id_engine(
        "mssql+pyodbc://@server.database.windows.net/shop?driver=ODBC+Driver+18+for+SQL+Server",
        credential=credential,
        # No pyodbc here: nothing connects, the listener is called directly.
        module=types.SimpleNamespace(paramstyle="qmark", version="5.1.0", Cursor=object),
    )
    cparams: dict[str, Any] = {}
    engine.dialect.dispatch.do_connect(engine.dialect, None, [], cparams)
    raw = "eyJ0eXAiOiJKV1QiLCJ.fake.token".encode("utf-16-le")
    assert cparams["attrs_before"][SQL_COPT_SS_ACCESS_TOKEN] == len(raw).to_bytes(4, "little") + raw
    assert credential.scopes == [ENTRA_SCOPES["mssql"]]
    with pytest.raises(ConfigurationError, match="no Entra ID login is known for sqlite"):
        entra_id_engine("sqlite://", credential=credential)


STORES_APP = """
import azure.functions as func
from dbtrigger import (BlobCheckpointStore, DbBindings, SqlAlchemySource, SqlCheckpointStore,
                       TableCheckpointStore)

app = func.FunctionApp()
db = DbBindings()
SEEN = []

def source():
    return SqlAlchemySource(url="%ORDERS_URL_{tag}%", table="orders",
                            cursor_column="updated_at", pk_columns=["id"])

# As in examples/function_app.py: the storage account of the Functions host.
blob = BlobCheckpointStore.from_connection_string(
    "Storage_{tag}", app_name="shop", container="{container}", create_container=True)
table = TableCheckpointStore(connection_setting="Storage_{tag}", table="t{tag}", app_name="shop")
sql = SqlCheckpointStore(url="%STATE_URL_{tag}%")

@app.function_name(name="on_blob")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source(), checkpoint_store=blob)
def on_blob(timer: func.TimerRequest, events) -> None:
    SEEN.extend(("blob", e.pk["id"]) for e in events)

@app.function_name(name="on_table")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source(), checkpoint_store=table)
def on_table(timer: func.TimerRequest, events) -> None:
    SEEN.extend(("table", e.pk["id"]) for e in events)

@app.function_name(name="on_sql")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=False)
@db.trigger(arg_name="events", source=source(), checkpoint_store=sql)
def on_sql(timer: func.TimerRequest, events) -> None:
    SEEN.extend(("sql", e.pk["id"]) for e in events)
"""


@pytest.mark.azurite
def test_a_missing_storage_connection_fails_only_the_functions_using_it(
    azurite: Azurite,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The storage connection string (AzureWebJobsStorage in the example) and a state
    store URL are app settings too: missing, they fail the invocations of the functions
    whose store needs them, with the setting named; set, those functions recover."""
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(3)])
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv(f"ORDERS_URL_{tag}", sqlite_db.url)
    monkeypatch.setenv(f"STATE_URL_{tag}", f"sqlite:///{tmp_path / 'state.db'}")
    path = tmp_path / f"stores_app_{tag}.py"
    path.write_text(textwrap.dedent(STORES_APP.format(tag=tag, container=f"s{tag}")))
    module = load(path, f"stores_app_{tag}")  # Storage_<tag> is not set: it imports anyway

    functions = {f.get_function_name(): f for f in module.app.get_functions()}
    assert sorted(functions) == ["on_blob", "on_sql", "on_table"]
    for name in ("on_blob", "on_table"):
        for _ in range(2):  # every invocation, not only the first
            with pytest.raises(ConfigurationError, match=f"app setting 'Storage_{tag}'"):
                functions[name].get_user_function()(timer=timer())
    functions["on_sql"].get_user_function()(timer=timer())  # its settings are there
    assert module.SEEN == [("sql", 0), ("sql", 1), ("sql", 2)]

    monkeypatch.setenv(f"Storage_{tag}", azurite.connection_string)  # the operator fixes it
    functions["on_blob"].get_user_function()(timer=timer())
    functions["on_table"].get_user_function()(timer=timer())
    assert sorted(module.SEEN) == sorted(
        [(kind, i) for kind in ("blob", "sql", "table") for i in range(3)]
    )
    for store in (module.blob, module.table, module.sql):
        store.close()


def test_a_quarantine_sink_reads_its_url_setting_at_first_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from dbtrigger.quarantine import SqlQuarantineSink  # noqa: PLC0415

    name = f"QUARANTINE_URL_{uuid.uuid4().hex[:8]}"
    sink = SqlQuarantineSink(url=f"%{name}%")  # importing a function_app.py must not fail
    assert sink.describe() == f"sql:(%{name}%, unresolved):dbtrigger_quarantine"
    for _ in range(2):
        with pytest.raises(ConfigurationError, match=name):
            sink.records()
    monkeypatch.setenv(name, f"sqlite:///{tmp_path / 'q.db'}")
    assert sink.records() == []
    sink.close()
