"""A public entry point given a value of the wrong kind says which option and what
it wants, as a DbTriggerError, before anything runs: never a TypeError,
AttributeError or FileExistsError from deep inside (found by a review of every
option of the sources, the trigger, the file store and the bindings)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from dbtrigger.dbio import DbReader, DbWriter
from dbtrigger.errors import ConfigurationError, UnsafeIdentifierError
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


_opened: list[DbReader] = []


@pytest.fixture(autouse=True)
def _close_readers_and_writers() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def _reader(db: TestDatabase) -> DbReader:
    _opened.append(DbReader(url=db.url, table="t"))
    return _opened[-1]


def _writer(db: TestDatabase) -> DbWriter:
    _opened.append(DbWriter(url=db.url, table="t"))
    return _opened[-1]  # type: ignore[return-value]


IO_CASES: list[tuple[str, Callable[[TestDatabase], object], str]] = [
    ("get(pk=5)", lambda db: _reader(db).get(pk=5), "pk= takes a dict"),  # type: ignore[arg-type]
    ("query(5)", lambda db: _reader(db).query(5), "a query is SQL text"),  # type: ignore[arg-type]
    (
        "query(params=[1])",
        lambda db: _reader(db).query("SELECT :a", [1]),  # type: ignore[arg-type]
        "params= takes a dict of bind parameter names",
    ),
    ("update(data=5)", lambda db: _writer(db).update(data=5, pk={"id": 1}), "data= takes a dict"),  # type: ignore[arg-type]
    ("update(data={})", lambda db: _writer(db).update(data={}, pk={"id": 1}), "names no column"),
    ("delete(pk=5)", lambda db: _writer(db).delete(pk=5), "pk= takes a dict"),  # type: ignore[arg-type]
    # It inserted a row of defaults (a NULL cursor, in the test's table), said nothing.
    ("insert(data={})", lambda db: _writer(db).insert(data={}), "a row has no columns"),
    (
        "insert_many(rows=a dict)",
        lambda db: _writer(db).insert_many(rows={"id": 1}),  # type: ignore[arg-type]
        "rows= takes a list of dicts",
    ),
    ("DbWriter(table=None)", lambda db: DbWriter(url=db.url, table=None), "needs table="),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("case", "call", "message"), IO_CASES, ids=[c[0] for c in IO_CASES])
def test_the_reader_and_writer_name_a_wrong_kind_of_argument(
    sqlite_db: TestDatabase, case: str, call: Callable[..., object], message: str
) -> None:
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, seq INTEGER)")
    with pytest.raises(ConfigurationError) as err:
        call(sqlite_db)
    assert message in str(err.value), case
    assert sqlite_db.scalar("SELECT count(*) FROM t") == 0  # nothing written


@pytest.mark.parametrize(
    ("option", "value", "told"),
    [
        ("table", "public.items", "schema='public' and 'items'"),
        ("table", '"Items"', "without quotes, 'Items'"),
        ("cursor_column", "`updated_at`", "without quotes, 'updated_at'"),
        ("table", "order lines", "give the table a view with a plain name"),
        ("cursor_column", "updated at", "its column an alias (AS) in query="),
    ],
)
def test_a_name_that_is_not_an_identifier_says_what_was_meant(
    option: str, value: str, told: str
) -> None:
    """A schema-qualified or quoted name, or one with a space: the refusal said only which
    characters may be used, not how to name such a table or column."""
    settings: dict[str, Any] = {"table": "items", "cursor_column": "v", "pk_columns": ["id"]}
    settings[option] = value
    with pytest.raises(UnsafeIdentifierError) as refused:
        SqlAlchemySource(url="sqlite://", **settings)
    assert told in str(refused.value)
