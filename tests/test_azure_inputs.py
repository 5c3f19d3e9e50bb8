"""``@db.input``, ``@db.inject_reader`` and ``@db.inject_writer`` in a real FunctionApp.

An HTTP function reads a row by the key in its request, one gets a query's
rows, one writes in a transaction that a failure rolls back; a poller's
function writes through an injected writer before its checkpoint commit. The
host sees only its own bindings; a missing app setting fails the invocation,
not the import, and nothing connects until a read or a write.
"""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import azure.functions as func
import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import DbBindings, InMemoryCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.dbio import DbReader, DbWriter
from dbtrigger.errors import (
    ConfigurationError,
    MissingSettingError,
    OutputConstraintError,
    RowNotFoundError,
)
from tests.databases import TestDatabase


def request(**params: str) -> func.HttpRequest:
    return func.HttpRequest(method="GET", url="/api/x", params=params, body=b"")


def host_accepts(function: func.decorators.function_app.Function) -> None:
    user = function.get_user_function()
    params = set(inspect.signature(user).parameters)
    bindings = {b["name"] for b in function.get_bindings_dict()["bindings"]} - {"$return"}
    assert params == bindings, (params, bindings)
    assert set(typing.get_type_hints(user)) <= bindings | {"return"}


@pytest.fixture
def users(db: TestDatabase) -> TestDatabase:
    db.execute(
        f"CREATE TABLE {db.qualified('users')} (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT "
        "NULL, active INTEGER NOT NULL)"
    )
    db.execute(
        f"INSERT INTO {db.qualified('users')} VALUES (1, 'ana', 1), (2, 'bo', 0), (3, 'cy', 1)"
    )
    return db


def test_input_reads_a_row_by_the_requests_key_and_a_querys_rows(users: TestDatabase) -> None:
    app = func.FunctionApp()
    db = DbBindings()
    table = users.qualified("users")

    @app.route(route="users/one")
    @db.input("user", url=users.url, table="users", schema=users.schema,
              pk=lambda req: {"id": int(req.params["id"])})  # fmt: skip
    def one(req: func.HttpRequest, user: dict | None) -> func.HttpResponse:
        return func.HttpResponse(user["name"] if user else "none")

    @app.route(route="users/active")
    @db.input("rows", url=users.url, query=f"SELECT id FROM {table} WHERE active = :a "
              "ORDER BY id", params={"a": 1})  # fmt: skip
    def active(req: func.HttpRequest, rows: list[dict]) -> func.HttpResponse:
        return func.HttpResponse(",".join(str(r["id"]) for r in rows))

    @app.route(route="users/must")
    @db.input("user", url=users.url, table="users", schema=users.schema,
              pk=lambda req: {"id": int(req.params["id"])}, on_not_found="raise")  # fmt: skip
    def must(req: func.HttpRequest, user: dict) -> func.HttpResponse:
        return func.HttpResponse(user["name"])

    fns = {f.get_function_name(): f for f in app.get_functions()}
    for function in fns.values():
        host_accepts(function)
    assert fns["one"].get_user_function()(req=request(id="1")).get_body() == b"ana"
    assert fns["one"].get_user_function()(req=request(id="9")).get_body() == b"none"
    assert fns["active"].get_user_function()(req=request()).get_body() == b"1,3"
    with pytest.raises(RowNotFoundError, match="key"):
        fns["must"].get_user_function()(req=request(id="9"))


def test_writer_transaction_commits_together_or_not_at_all(users: TestDatabase) -> None:
    app = func.FunctionApp()
    db = DbBindings()

    @app.route(route="users/rename")
    @db.inject_writer("writer", url=users.url, table="users", schema=users.schema)
    @db.inject_reader("reader", url=users.url, table="users", schema=users.schema)
    def rename(req: func.HttpRequest, writer: DbWriter, reader: DbReader) -> func.HttpResponse:
        with writer.transaction():
            writer.update(data={"name": req.params["name"]}, pk={"id": 1})
            writer.upsert(data={"id": 4, "name": "dee", "active": 1}, conflict_columns=["id"])
            if req.params.get("fail"):
                raise RuntimeError("the second half failed")
        return func.HttpResponse((reader.get(pk={"id": 1}) or {})["name"])

    (function,) = app.get_functions()
    host_accepts(function)
    call = function.get_user_function()
    with pytest.raises(RuntimeError):
        call(req=request(name="zed", fail="1"))
    count = users.scalar(f"SELECT count(*) FROM {users.qualified('users')}")
    assert count == 3  # rolled back: neither the update nor the upsert
    assert call(req=request(name="zed")).get_body() == b"zed"
    assert users.scalar(f"SELECT name FROM {users.qualified('users')} WHERE id = 4") == "dee"
    assert call(req=request(name="zed")).get_body() == b"zed"  # the upsert again: idempotent


def test_a_pollers_function_writes_through_an_injected_writer(sqlite_db: TestDatabase) -> None:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    sqlite_db.execute("CREATE TABLE seen (order_id INTEGER PRIMARY KEY)")
    sqlite_db.execute("INSERT INTO orders VALUES (1, 1), (2, 2)")
    app = func.FunctionApp()
    db = DbBindings()
    source = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
    )

    @app.schedule(schedule="0 */1 * * * *", arg_name="timer")
    @db.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    @db.inject_writer("writer", url=sqlite_db.url, table="seen")
    def poll(timer: func.TimerRequest, events: list[RowChange], writer: DbWriter) -> None:
        writer.upsert_many(rows=[{"order_id": e.pk["id"]} for e in events],
                           conflict_columns=["order_id"])  # fmt: skip

    (function,) = app.get_functions()
    host_accepts(function)
    function.get_user_function()(timer=TimerRequest(past_due=False))
    assert sqlite_db.scalar("SELECT count(*) FROM seen") == 2
    source.close()


def test_settings_and_connections_are_lazy(
    sqlite_db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("USERS_DB", raising=False)
    app = func.FunctionApp()
    db = DbBindings()

    @app.route(route="x")
    @db.input("user", url="%USERS_DB%", table="users", pk={"id": 1})
    def lookup(req: func.HttpRequest, user: dict | None) -> func.HttpResponse:
        return func.HttpResponse(str(user))

    @app.route(route="y")
    @db.inject_writer("writer", url="%USERS_DB%", table="users")
    def untouched(req: func.HttpRequest, writer: DbWriter) -> func.HttpResponse:
        return func.HttpResponse("did not write")  # never connects

    fns = {f.get_function_name(): f for f in app.get_functions()}  # the import worked
    assert fns["untouched"].get_user_function()(req=request()).get_body() == b"did not write"
    with pytest.raises(MissingSettingError, match="USERS_DB"):
        fns["lookup"].get_user_function()(req=request())
    sqlite_db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    sqlite_db.execute("INSERT INTO users VALUES (1, 'ana')")
    monkeypatch.setenv("USERS_DB", sqlite_db.url)  # set it: the function recovers
    assert (
        fns["lookup"].get_user_function()(req=request()).get_body() == b"{'id': 1, 'name': 'ana'}"
    )


def test_mistakes_are_said_at_decoration_or_first_use(sqlite_db: TestDatabase) -> None:
    db = DbBindings()
    with pytest.raises(ConfigurationError, match="exactly one of pk= or query="):
        db.input("x", url=sqlite_db.url, table="t")
    with pytest.raises(ConfigurationError, match="needs table="):
        db.input("x", url=sqlite_db.url, pk={"id": 1})
    with pytest.raises(ConfigurationError, match="has no parameter 'row'"):

        @db.input("row", url=sqlite_db.url, table="t", pk={"id": 1})
        def f(x: int) -> None: ...

    # A key or params that is not a dict (nor a callable giving one): a TypeError
    # at every invocation before.
    with pytest.raises(ConfigurationError, match=r"pk=\.\.\.\): expected a dict or a callable"):
        db.input("row", url=sqlite_db.url, table="t", pk=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"params=\.\.\.\): expected a dict"):
        db.input("rows", url=sqlite_db.url, query="SELECT 1", params=[1])  # type: ignore[arg-type]

    @db.input("row", url=sqlite_db.url, table="t", pk=lambda user_id: user_id)
    def by_id(user_id: int, row: object) -> object:
        return row

    with pytest.raises(ConfigurationError, match="the callable returned int, expected a dict"):
        by_id(user_id=1)

    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
    writer = DbWriter(url=sqlite_db.url, table="t")
    with pytest.raises(ConfigurationError, match=r"no column.*nope"):
        writer.insert(data={"id": 1, "nope": 2})
    # a data problem, not retried (it was an OutputWriteError)
    with pytest.raises(OutputConstraintError, match=r"no column 'v', which is NOT NULL"):
        writer.insert(data={"id": 1})  # v is NOT NULL
    outer = writer.transaction()
    outer.__enter__()
    with pytest.raises(ConfigurationError, match="already open"), writer.transaction():
        pass
    outer.__exit__(None, None, None)
    writer.close()
