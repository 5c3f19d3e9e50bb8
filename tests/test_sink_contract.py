"""The dead-letter sink contract against every quarantine sink here.

``SqlQuarantineSink`` on SQLite, PostgreSQL and MariaDB, ``JsonLinesQuarantineSink``
and the in-memory ``MemoryQuarantineSink``. Each also shows how it fails: a
database that does not answer, a path that cannot be appended to, a memory
sink marked unavailable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger.quarantine import JsonLinesQuarantineSink, SqlQuarantineSink
from dbtrigger.testing import MemoryQuarantineSink, SinkContract
from tests.contracts.nested import nested_failures
from tests.databases import TestDatabase

#: Where nothing listens: port 1 on loopback refuses at once.
UNREACHABLE = {
    "postgresql": "postgresql+psycopg://dbtrigger:pw@127.0.0.1:1/none?connect_timeout=2",
    "mariadb": "mysql+pymysql://dbtrigger:pw@127.0.0.1:1/none?connect_timeout=2",
}


class TestSqlSink(SinkContract):
    @pytest.fixture
    def sink(self, db: TestDatabase) -> Iterator[SqlQuarantineSink]:
        sink = SqlQuarantineSink(engine=db.engine, schema=db.schema, table="contract_poison")
        yield sink
        sink.close()

    @pytest.fixture
    def unavailable_sink(self, db: TestDatabase, tmp_path: Path) -> Iterator[SqlQuarantineSink]:
        if db.kind == "sqlite":
            url = f"sqlite:///{tmp_path / 'missing-directory' / 'poison.db'}"
        else:
            url = UNREACHABLE[db.kind]
        sink = SqlQuarantineSink(url=url)
        yield sink
        sink.close()


class TestJsonLinesSink(SinkContract):
    @pytest.fixture
    def sink(self, tmp_path: Path) -> JsonLinesQuarantineSink:
        return JsonLinesQuarantineSink(tmp_path / "quarantine" / "poison.jsonl")

    @pytest.fixture
    def unavailable_sink(self, tmp_path: Path) -> JsonLinesQuarantineSink:
        (tmp_path / "a-directory.jsonl").mkdir()
        return JsonLinesQuarantineSink(tmp_path / "a-directory.jsonl")


class TestMemorySink(SinkContract):
    @pytest.fixture
    def sink(self) -> MemoryQuarantineSink:
        return MemoryQuarantineSink()

    @pytest.fixture
    def unavailable_sink(self) -> MemoryQuarantineSink:
        sink = MemoryQuarantineSink()
        sink.unavailable = True
        return sink


def test_the_unreachable_urls_really_are(db: TestDatabase) -> None:
    """The failure fixtures fail for the stated reason, not a typo in a URL."""
    if db.kind == "sqlite":
        return
    engine = sa.create_engine(UNREACHABLE[db.kind])
    try:
        with pytest.raises(sa.exc.OperationalError, match=r"(?i)refused|connect"):
            engine.connect()
    finally:
        engine.dispose()


# --- the suite can fail -------------------------------------------------------------

pytest_plugins = ["pytester"]

#: Each broken sink, and a test of the suite that must catch it.
CAUGHT_BY = {
    "keeps_last_put": "test_later_puts_add_to_earlier_ones",
    "keyed_by_event_only": "test_the_same_event_of_two_pollers_is_two_records",
    "stringifies_rows": "test_row_values_of_every_type_round_trip",
    "raw_os_error": "test_a_sink_that_cannot_store_raises_quarantine_error",
    "swallows_failures": "test_a_sink_that_cannot_store_raises_quarantine_error",
}


def test_the_suite_passes_the_memory_sink_and_fails_every_broken_one(
    pytester: pytest.Pytester,
) -> None:
    makes = {
        "correct": {
            "sink": "broken.MemoryQuarantineSink()",
            "unavailable_sink": "broken.unavailable(broken.MemoryQuarantineSink())",
        }
    }
    for name in CAUGHT_BY:
        makes[name] = {
            "sink": f"broken.BROKEN_SINKS[{name!r}]()",
            "unavailable_sink": f"broken.unavailable(broken.BROKEN_SINKS[{name!r}]())",
        }
    failures = nested_failures(pytester, "SinkContract", makes)
    assert failures.pop("correct") == set()
    missed = {name: got for name, got in failures.items() if CAUGHT_BY[name] not in got}
    assert missed == {}, f"a broken sink the suite did not catch as expected: {missed}"


def test_memory_sink_counts_puts_and_filters_by_poller() -> None:
    from dbtrigger.errors import QuarantineError  # noqa: PLC0415
    from dbtrigger.testing.contracts.sink import make_record  # noqa: PLC0415

    sink = MemoryQuarantineSink("poison")
    assert sink.describe() == "memory:poison"
    sink.put([make_record(1, poller="a"), make_record(2, poller="b")])
    sink.unavailable = True
    with pytest.raises(QuarantineError, match="marked unavailable"):
        sink.put([make_record(3, poller="a")])
    assert sink.puts == 2
    assert [r.pk for r in sink.records("a")] == [{"id": 1}]
