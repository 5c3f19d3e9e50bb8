"""A public entry point given a value of the wrong kind says which option and what
it wants, as a DbTriggerError, before anything runs: never a TypeError,
AttributeError or FileExistsError from deep inside (found by a review of every
option of the sources, the trigger, the file store and the bindings)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import (
    DbBindings,
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.errors import ConfigurationError
from tests.databases import TestDatabase


def _source(db: TestDatabase, **options: Any) -> SqlAlchemySource:
    base: dict[str, Any] = {"url": db.url, "table": "t", "cursor_column": "seq"}
    return SqlAlchemySource(**(base | {"pk_columns": ["id"]} | options))


def _tick(db: TestDatabase, **options: Any) -> int:
    source = _source(db, **options)
    try:
        trigger = PollTrigger(name="p", source=source, checkpoint_store=InMemoryCheckpointStore())
        return trigger.tick(lambda events: None)
    finally:
        source.close()


CASES: list[tuple[str, Callable[[TestDatabase, Path], object], str]] = [
    ("pk_columns=5", lambda db, _: _source(db, pk_columns=5), "pk_columns must be a list"),
    ("parameters=[1]", lambda db, _: _source(db, parameters=[1]), "parameters= must be a dict"),
    ("where=5", lambda db, _: _source(db, where=5), "where= must be SQL text"),
    ("query=5", lambda db, _: _source(db, table=None, query=5), "query= must be SQL text"),
    ("url=5", lambda db, _: _source(db, url=5), "database URL: expected a URL"),
    ("engine_kwargs=5", lambda db, _: _source(db, engine_kwargs=5), "engine_kwargs must be a dict"),
    (
        "engine_kwargs={'bogus': 1}",
        lambda db, _: _tick(db, engine_kwargs={"bogus": 1}),
        "engine_kwargs: Invalid argument(s) 'bogus'",
    ),
    (
        "checkpoint_store=None",
        lambda db, _: PollTrigger(name="p", source=_source(db), checkpoint_store=None),  # type: ignore[arg-type]
        "checkpoint_store= must be a checkpoint store object",
    ),
    (
        "source=a URL",
        lambda db, _: PollTrigger(
            name="p", source=db.url, checkpoint_store=InMemoryCheckpointStore()
        ),  # type: ignore[arg-type]
        "source= must be a source object",
    ),
    (
        "tick('handler')",
        lambda db, _: PollTrigger(
            name="p", source=_source(db), checkpoint_store=InMemoryCheckpointStore()
        ).tick("handler"),  # type: ignore[arg-type]
        "the handler must be a function, got str",
    ),
    ("FileCheckpointStore(5)", lambda db, _: FileCheckpointStore(5), "takes a directory path"),  # type: ignore[arg-type]
    (
        "FileCheckpointStore(a file)",
        lambda db, tmp: FileCheckpointStore(tmp / "source.db"),
        "is a file: name a directory",
    ),
    (
        "db.output(url=5)",
        lambda db, _: DbBindings().output("out", url=5, table="t"),  # type: ignore[arg-type]
        "db.output url: expected a URL",
    ),
]


@pytest.mark.parametrize(("case", "call", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_wrong_kind_of_value_is_a_configuration_error_naming_it(
    sqlite_db: TestDatabase, tmp_path: Path, case: str, call: Callable[..., object], message: str
) -> None:
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    with pytest.raises(ConfigurationError) as err:
        call(sqlite_db, tmp_path)
    assert message in str(err.value), case


def test_a_schedule_that_is_not_text_is_refused(sqlite_db: TestDatabase) -> None:
    """It was taken for an app setting that cannot be resolved here, and not checked."""
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    with pytest.raises(ConfigurationError, match="expected text"):

        @DbBindings().trigger(
            arg_name="events",
            source=_source(sqlite_db),
            checkpoint_store=InMemoryCheckpointStore(),
            schedule=300,  # type: ignore[arg-type]
        )
        def orders(timer: object, events: list[RowChange]) -> None:
            return None
