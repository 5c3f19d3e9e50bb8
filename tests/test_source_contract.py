"""The source contract against every source here.

``MemorySource`` (alone and behind a plan-less ``FaultySource``), and
``SqlAlchemySource`` on SQLite, PostgreSQL and MariaDB: integer and timestamp
cursors, table and query mode, the visibility guard ``auto`` picks and
``visibility="none"``. Which guard each variant really ran under is checked
too, so the matrix cannot quietly collapse to "no guard anywhere".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import ConfigurationError, SerializationError
from dbtrigger.sources.base import CountsAfter, FindsNullCursors, ReportsVisibility
from dbtrigger.testing import MemorySource, SourceContract
from tests.contracts.harnesses import (
    MemoryHarness,
    PartitionHarness,
    SqlHarness,
    faulty_memory_harness,
)
from tests.contracts.nested import nested_failures
from tests.databases import make_database


class TestMemorySource(SourceContract):
    @pytest.fixture
    def source_harness(self) -> MemoryHarness:
        return MemoryHarness()


class TestFaultySourceWithoutFaults(SourceContract):
    @pytest.fixture
    def source_harness(self) -> MemoryHarness:
        return faulty_memory_harness()


# (database, cursor kind, visibility, query mode) -> the guard in force after a fetch
SQL_VARIANTS = {
    ("sqlite", "int", "auto", False): "none",
    ("sqlite", "int", "auto", True): "none",
    ("sqlite", "timestamp", "auto", False): "safety-window(5s)",
    ("postgresql", "int", "auto", False): "transaction-horizon",
    ("postgresql", "int", "none", False): "none",
    ("postgresql", "timestamp", "auto", False): "transaction-horizon",
    ("postgresql", "timestamp", "auto", True): "transaction-horizon",
    ("mariadb", "int", "none", False): "none",
    ("mariadb", "timestamp", "auto", False): "transaction-horizon",  # root has PROCESS
}


def _param(variant: tuple[str, str, str, bool]) -> object:
    kind, cursor, visibility, query = variant
    marks = [getattr(pytest.mark, kind)] if kind != "sqlite" else []
    name = f"{kind}-{cursor}-{visibility}{'-query' if query else ''}"
    return pytest.param(variant, marks=marks, id=name)


@pytest.fixture(params=[_param(v) for v in SQL_VARIANTS])
def sql_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlHarness]:
    kind, cursor, visibility, query = request.param
    for db in make_database(kind, tmp_path):
        yield SqlHarness(db, cursor=cursor, visibility=visibility, query_mode=query)


class TestSqlAlchemySource(SourceContract):
    @pytest.fixture
    def source_harness(self, sql_harness: SqlHarness) -> SqlHarness:
        return sql_harness


#: The partition source over the variants that differ in what the bucket
#: condition meets: SQLite's Python bucket function, PostgreSQL and MariaDB
#: SQL, an integer and a timestamp cursor, and query mode.
PARTITION_VARIANTS = [
    ("sqlite", "int", "auto", False),
    ("sqlite", "timestamp", "auto", False),
    ("postgresql", "timestamp", "auto", False),
    ("postgresql", "int", "auto", True),
    ("mariadb", "timestamp", "auto", False),
]


@pytest.fixture(params=[_param(v) for v in PARTITION_VARIANTS])
def partition_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PartitionHarness]:
    kind, cursor, visibility, query = request.param
    for db in make_database(kind, tmp_path):
        yield PartitionHarness(
            SqlHarness(db, cursor=cursor, visibility=visibility, query_mode=query)
        )


class TestPartitionSource(SourceContract):
    @pytest.fixture
    def source_harness(self, partition_harness: PartitionHarness) -> PartitionHarness:
        return partition_harness


def test_each_sql_variant_runs_under_the_guard_it_names(sql_harness: SqlHarness) -> None:
    from dbtrigger.testing.contracts.source import ROWS  # noqa: PLC0415

    sql_harness.put(ROWS)
    source = sql_harness.open()
    try:
        assert len(source.fetch(BEGINNING, 100)) == len(ROWS)
        key = (
            sql_harness.db.kind,
            sql_harness.cursor_kind,
            sql_harness.visibility,
            sql_harness.query_mode,
        )
        assert source.visibility_mode == SQL_VARIANTS[key]
        assert source.last_fetch_info is not None
    finally:
        source.close()


# --- the suite can fail -------------------------------------------------------------

pytest_plugins = ["pytester"]

#: Each broken source, and a test of the suite that must catch it.
CAUGHT_BY = {
    "insertion_order": "test_rows_come_in_cursor_then_key_order",
    "cursor_only_order": "test_equal_cursors_are_ordered_by_the_whole_key",
    "keys_as_text": "test_equal_cursors_are_ordered_by_the_whole_key",
    "inclusive_after": "test_fetch_is_strictly_after_each_row",
    "cursor_only_after": "test_fetch_is_strictly_after_each_row",
    "ignores_limit": "test_limit_returns_the_first_rows",
    "fingerprint_per_instance": (
        "test_fingerprint_is_stable_across_instances_and_follows_the_definition"
    ),
    "fingerprint_of_data": "test_fingerprint_is_a_sha256_of_the_definition",
    "events_without_tiebreaker": "test_events_sit_at_their_rows_positions",
}


def test_the_suite_passes_the_memory_source_and_fails_every_broken_one(
    pytester: pytest.Pytester,
) -> None:
    makes = {"correct": {"source_harness": "harnesses.MemoryHarness()"}}
    for name in CAUGHT_BY:
        makes[name] = {"source_harness": f"broken.BROKEN_SOURCES[{name!r}]()"}
    failures = nested_failures(pytester, "SourceContract", makes)
    assert failures.pop("correct") == set()
    missed = {name: got for name, got in failures.items() if CAUGHT_BY[name] not in got}
    assert missed == {}, f"a broken source the suite did not catch as expected: {missed}"


# --- what is specific to MemorySource ------------------------------------------------


def _memory(*rows: dict[str, object]) -> MemorySource:
    return MemorySource(rows, cursor_column="v", pk_columns=["id"], name="orders")


def test_memory_source_refuses_rows_it_could_not_deliver() -> None:
    source = _memory({"id": 1, "v": 1}, {"id": 3, "v": 3})
    with pytest.raises(ConfigurationError, match="lacks column 'v'"):
        source.put({"id": 2})
    with pytest.raises(ConfigurationError, match="NULL key"):
        source.put({"id": None, "v": 2})
    with pytest.raises(SerializationError, match="cannot be stored in a checkpoint"):
        source.put({"id": 2, "v": object()})
    with pytest.raises(ConfigurationError, match="cannot be ordered"):
        source.put({"id": 2, "v": "two"})
    with pytest.raises(ConfigurationError, match="cannot be ordered"):
        source.put({"id": 1, "v": "one"})  # an update that fails keeps the old row
    assert [dict(r) for r in source.fetch(BEGINNING, 10)] == [
        {"id": 1, "v": 1},
        {"id": 3, "v": 3},
    ]
    assert len(source) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pk_columns": "id"}, "not a string"),
        ({"pk_columns": []}, "at least one"),
        ({"pk_columns": ["v"]}, "must not also be a pk column"),
        ({"pk_columns": ["id"], "name": ""}, "non-empty name"),
    ],
)
def test_memory_source_configuration_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        MemorySource(cursor_column="v", **kwargs)  # type: ignore[arg-type]


def test_memory_source_null_cursors_are_reported_never_fetched() -> None:
    source = _memory({"id": 1, "v": 1}, {"id": 2, "v": None}, {"id": 3, "v": 3})
    assert [r["id"] for r in source.fetch(BEGINNING, 10)] == [1, 3]
    assert source.null_cursor_keys() == [{"id": 2}]
    assert source.count_after(BEGINNING) == 2
    source.put({"id": 2, "v": 4})
    assert source.null_cursor_keys() == []
    assert [r["id"] for r in source.fetch(Position(cursor=3, pk={"id": 3}), 10)] == [2]


def test_memory_source_delete_count_and_limits() -> None:
    source = _memory({"id": 1, "v": 1}, {"id": 2, "v": 2})
    assert len(source) == 2
    assert source.count_after(Position(cursor=1, pk={"id": 1})) == 1
    assert source.delete({"id": 1}) is True
    assert source.delete({"id": 1}) is False
    assert [r["id"] for r in source.fetch(BEGINNING, 10)] == [2]
    with pytest.raises(ConfigurationError, match="at least 1"):
        source.fetch(BEGINNING, 0)
    with pytest.raises(SerializationError, match="needs a cursor"):
        source.fetch(Position(cursor=None, pk={"id": 1}), 1)
    with pytest.raises(SerializationError, match="another source"):
        source.fetch(Position(cursor="2024-01-01", pk={"id": 1}), 1)


def test_memory_source_declares_the_optional_capabilities_it_has() -> None:
    source = _memory({"id": 1, "v": 1})
    assert isinstance(source, CountsAfter)
    assert isinstance(source, FindsNullCursors)
    assert not isinstance(source, ReportsVisibility)  # it has no guard to report on


def test_memory_source_hands_out_copies() -> None:
    source = _memory({"id": 1, "v": 1, "note": "a"})
    (row,) = source.fetch(BEGINNING, 1)
    row["note"] = "changed"  # type: ignore[index]
    assert source.fetch(BEGINNING, 1)[0]["note"] == "a"
