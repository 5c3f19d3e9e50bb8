"""Functions spread over ``func.Blueprint`` modules, each with a ``DbBindings`` of its own.

The poller name is the state document's name. One ``DbBindings`` refuses a name
twice; two of them could not see each other, so two functions of one app (a
blueprint module copied with ``name="orders"`` kept) shared one checkpoint and
lease: each firing delivered the new rows to whichever function won the lease,
and each function silently missed the other's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import azure.functions as func
import pytest

from dbtrigger import DbBindings, FileCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.errors import ConfigurationError
from tests.databases import TestDatabase


@pytest.fixture
def source(sqlite_db: TestDatabase) -> Iterator[SqlAlchemySource]:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT NOT NULL)")
    src = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    yield src
    src.close()


def blueprint(
    db: DbBindings, source: SqlAlchemySource, state: Path, fn_name: str, poller: str
) -> func.Blueprint:
    bp = func.Blueprint()

    def handler(timer: func.TimerRequest, events: list[RowChange]) -> None:
        del timer, events

    handler.__name__ = handler.__qualname__ = fn_name
    bp.schedule(schedule="0 */1 * * * *", arg_name="timer", use_monitor=True)(
        db.trigger(
            arg_name="events", source=source, checkpoint_store=FileCheckpointStore(state),
            name=poller,
        )(handler)
    )  # fmt: skip
    return bp


def test_one_poller_name_in_two_blueprints_is_refused(
    source: SqlAlchemySource, tmp_path: Path
) -> None:
    first, second = DbBindings(), DbBindings()
    blueprint(first, source, tmp_path / "state", "orders_a", "orders")
    with pytest.raises(ConfigurationError) as err:
        blueprint(second, source, tmp_path / "state", "orders_b", "orders")
    message = str(err.value)
    assert "'orders'" in message
    assert "orders_a" in message
    assert "name=" in message


def test_distinct_names_or_stores_and_a_module_imported_again_are_fine(
    source: SqlAlchemySource, tmp_path: Path
) -> None:
    first, second, third, again = DbBindings(), DbBindings(), DbBindings(), DbBindings()
    app = func.FunctionApp()
    app.register_functions(blueprint(first, source, tmp_path / "state", "orders_a", "orders"))
    app.register_functions(blueprint(second, source, tmp_path / "state", "orders_b", "refunds"))
    app.register_functions(blueprint(third, source, tmp_path / "other", "orders_c", "orders"))
    assert [f.get_function_name() for f in app.get_functions()] == [
        "orders_a",
        "orders_b",
        "orders_c",
    ]
    # The same function decorated again (the module imported once more): not a second poller.
    blueprint(again, source, tmp_path / "state", "orders_a", "orders")
