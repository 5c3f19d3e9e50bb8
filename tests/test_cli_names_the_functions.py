"""``dbtrigger run function_app:app``: a new user names the Function App, or its
``DbBindings``, where one function is wanted.

The worker runs the functions it is given by name (several in one process,
``dbtrigger run function_app:orders function_app:refunds``); the app itself is
not a trigger. The error then lists the ``MODULE:ATTR`` of each trigger in the
module, so the command to type is in the message.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from dbtrigger.cli.loading import load_trigger
from dbtrigger.errors import ConfigurationError

MODULE = "dbtrigger_names_app"


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / f"{MODULE}.py").write_text(
        textwrap.dedent(
            """
            import azure.functions as func
            from dbtrigger import DbBindings, InMemoryCheckpointStore, SqlAlchemySource

            app = func.FunctionApp()
            db = DbBindings()
            SCHEDULE = "0 */1 * * * *"

            def source():
                return SqlAlchemySource(
                    url="sqlite://", table="orders", cursor_column="id", pk_columns=["id"]
                )

            @app.schedule(schedule=SCHEDULE, arg_name="timer", use_monitor=True)
            @db.trigger(arg_name="events", source=source(),
                        checkpoint_store=InMemoryCheckpointStore())
            def orders(timer: func.TimerRequest, events: list) -> None:
                pass

            @app.schedule(schedule=SCHEDULE, arg_name="timer", use_monitor=True)
            @db.trigger(arg_name="events", source=source(),
                        checkpoint_store=InMemoryCheckpointStore(), name="refunds-poller")
            def refunds(timer: func.TimerRequest, events: list) -> None:
                pass

            def helper() -> None:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


@pytest.mark.parametrize("attr", ["app", "db", "SCHEDULE", "helper"])
def test_naming_the_app_lists_the_triggers_to_name_instead(module: str, attr: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        load_trigger(f"{module}:{attr}")
    message = str(err.value)
    assert f"{module}:{attr} is a " in message
    assert f"name one of its triggers instead: {module}:orders, {module}:refunds" in message
