"""Database URLs: an app setting is read at first use, a malformed URL is a typed error.

A Function App imports ``function_app.py`` to index its functions; a queue
whose URL names a missing app setting must fail only its own function, on
each invocation, and work once the setting exists. A URL SQLAlchemy cannot
parse (including a port that is not a number, which SQLAlchemy reports as a
bare ``ValueError``) must be a ConfigurationError that does not echo the URL.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import azure.functions as func
import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import ClaimSource, DbBindings, RowChange, SqlAlchemySource, SqlCheckpointStore
from dbtrigger.errors import ConfigurationError
from dbtrigger.quarantine import SqlQuarantineSink
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs

BAD_PORT = "postgresql+psycopg://alice:s3cret-pw@db.example:not-a-port/app"
UNPARSABLE = "not a url, password s3cret-pw"


def test_a_queue_with_a_missing_url_setting_indexes_and_fails_only_itself(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_jobs(sqlite_db, 4)
    setting = f"QUEUE_URL_{uuid.uuid4().hex[:8]}"
    monkeypatch.delenv(setting, raising=False)
    app = func.FunctionApp()
    db = DbBindings()
    source = ClaimSource(
        url=f"%{setting}%", table="jobs", schema=sqlite_db.schema, pk_columns=["id"]
    )
    seen: list[int] = []

    @app.schedule(schedule="0 */5 * * * *", arg_name="timer", run_on_startup=False)
    @db.queue_trigger(arg_name="events", source=source, batch_size=10, max_batches_per_tick=10)
    def send(timer: func.TimerRequest, events: list[RowChange]) -> None:
        seen.extend(e.pk["id"] for e in events)

    functions = app.get_functions()
    assert [f.get_function_name() for f in functions] == ["send"]
    user_function = functions[0].get_user_function()
    with pytest.raises(ConfigurationError, match=setting):
        user_function(timer=TimerRequest(past_due=False))
    assert seen == []
    monkeypatch.setenv(setting, sqlite_db.url)  # set later: no restart needed
    user_function(timer=TimerRequest(past_due=False))
    assert sorted(seen) == [1, 2, 3, 4]
    source.close()


BUILDERS: dict[str, Callable[[str], Any]] = {
    "source": lambda url: SqlAlchemySource(
        url=url, table="t", cursor_column="c", pk_columns=["id"]
    ),
    "claim source": lambda url: ClaimSource(url=url, table="t", pk_columns=["id"]),
    "sql store": lambda url: SqlCheckpointStore(url=url),
    "quarantine sink": lambda url: SqlQuarantineSink(url=url),
}


@pytest.mark.parametrize("url", [BAD_PORT, UNPARSABLE], ids=["bad-port", "unparsable"])
@pytest.mark.parametrize("what", sorted(BUILDERS))
def test_a_malformed_url_is_a_configuration_error_without_the_password(what: str, url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        BUILDERS[what](url)
    text = str(caught.value)
    assert "not a valid database URL" in text
    assert "s3cret" not in text
    if url == BAD_PORT:
        assert "port" in text


def test_a_malformed_url_in_a_setting_names_the_problem_not_the_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read at first use, not at construction (286c84e: a malformed setting must not
    fail the import of function_app.py), and then named without its password."""
    setting = f"BAD_URL_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(setting, BAD_PORT)
    source = ClaimSource(url=f"%{setting}%", table="t", pk_columns=["id"])
    with pytest.raises(ConfigurationError, match="port is not a number") as caught:
        source.counts()
    assert setting in str(caught.value)
    assert "s3cret" not in str(caught.value)
