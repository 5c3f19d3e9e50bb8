"""An app setting that is set but malformed fails the functions that use it, not the import.

A database URL in ``ORDERS_DB_URL`` with a port that is not a number, or a
store's ``app_name`` setting that is no safe name, made ``function_app.py``
fail to import: the host then indexes no function of the app at all, and the
error said "database URL: not a valid database URL" without naming the
setting. docs/azure.md promises what a missing setting already does: the app
indexes, only the functions that need the setting fail, each invocation, with a
``ConfigurationError`` naming it, and they recover once it is fixed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import textwrap
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from dbtrigger.errors import ConfigurationError
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table

PASSWORD = "Pw4MalformedSetting"  # noqa: S105 - a test value that must never be shown

APP = """
import azure.functions as func
from dbtrigger import BlobCheckpointStore, DbBindings, DbOut, SqlAlchemySource

app = func.FunctionApp()
db = DbBindings()
store = BlobCheckpointStore.from_connection_string(
    "AzureWebJobsStorage", app_name="%APP_NAME_{tag}%", container="{container}",
    create_container=True)
SEEN = []

@app.function_name(name="orders")
@app.schedule(schedule="0 */5 * * * *", arg_name="timer", use_monitor=True)
@db.trigger(arg_name="events", name="orders", checkpoint_store=store,
            source=SqlAlchemySource(url="%ORDERS_DB_URL_{tag}%", table="orders",
                                    cursor_column="updated_at", pk_columns=["id"]))
@db.output("out", url="%DEST_DB_URL_{tag}%", table="processed", action="upsert",
           conflict_columns=["order_id"])
def orders(timer: func.TimerRequest, events, out: DbOut) -> None:
    SEEN.extend(e.pk["id"] for e in events)
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


@pytest.mark.azurite
def test_a_malformed_setting_fails_the_invocations_naming_it_and_the_app_still_imports(
    azurite: Azurite,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(3)])
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE processed (order_id integer PRIMARY KEY)"))
    tag = uuid.uuid4().hex[:8]
    bad_url = f"postgresql+psycopg://app:{PASSWORD}@db.example:five432/shop"
    monkeypatch.setenv("AzureWebJobsStorage", azurite.connection_string)
    monkeypatch.setenv(f"APP_NAME_{tag}", "orders/prod")  # a '/' is no safe blob segment
    monkeypatch.setenv(f"ORDERS_DB_URL_{tag}", bad_url)
    monkeypatch.setenv(f"DEST_DB_URL_{tag}", bad_url)
    path = tmp_path / f"function_app_{tag}.py"
    path.write_text(textwrap.dedent(APP.format(tag=tag, container=f"m{tag}")))
    caplog.set_level(logging.DEBUG)

    module = load(path, f"function_app_{tag}")  # the import does not fail
    (function,) = module.app.get_functions()

    good = {
        f"ORDERS_DB_URL_{tag}": sqlite_db.url,
        f"APP_NAME_{tag}": "orders-prod",
        f"DEST_DB_URL_{tag}": sqlite_db.url,
    }
    while good:  # each invocation names one bad setting; fixed, the next one is named
        for _ in range(2):  # every invocation, not only the first
            with pytest.raises(ConfigurationError, match="app setting '") as info:
                function.get_user_function()(timer=TimerRequest(past_due=False))
            assert PASSWORD not in "".join(traceback.format_exception(info.value))
            named = [name for name in good if f"app setting {name!r}" in str(info.value)]
            assert len(named) == 1, str(info.value)
        monkeypatch.setenv(named[0], good.pop(named[0]))
    assert module.SEEN == []  # nothing was handed over before the output could be written

    function.get_user_function()(timer=TimerRequest(past_due=False))  # recovered, no restart
    assert module.SEEN == [0, 1, 2]
    with sqlite_db.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM processed")).scalar() == 3
    assert PASSWORD not in caplog.text
    module.store.close()


def test_a_malformed_literal_url_still_fails_when_the_object_is_built() -> None:
    from dbtrigger import SqlAlchemySource  # noqa: PLC0415

    with pytest.raises(ConfigurationError, match="not a valid database URL") as info:
        SqlAlchemySource(
            url=f"postgresql+psycopg://app:{PASSWORD}@db.example:five432/shop",
            table="orders",
            cursor_column="updated_at",
            pk_columns=["id"],
        )
    assert PASSWORD not in str(info.value)
