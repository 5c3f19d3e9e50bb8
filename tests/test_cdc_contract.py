"""The log-source contract on every log source here, and proof that it can fail.

``MemoryLogSource`` (the in-memory fake users test with), ``PgLogicalSource``
on a private ``wal_level=logical`` server, ``BinlogSource`` and the
trigger-maintained ``ChangeLogSource`` (a sequence log, on SQLite, PostgreSQL
and MariaDB) pass the same suite; seven
broken sources, each with one mistake a real reader could make (the
position-only checkpoint of Debezium's DBZ-1554 among them), each fail it in the
test that names the mistake.
"""

from __future__ import annotations

import pytest

from dbtrigger.testing import LogSourceContract
from tests.cdc_servers import BinlogDatabase, CdcDatabase
from tests.contracts.log_harnesses import (
    BinlogLogHarness,
    ChangeLogHarness,
    MemoryLogHarness,
    PgLogHarness,
)
from tests.contracts.nested import nested_failures
from tests.databases import TestDatabase


class TestMemoryLogSource(LogSourceContract):
    @pytest.fixture
    def log_harness(self) -> MemoryLogHarness:
        return MemoryLogHarness()


class TestPgLogicalSource(LogSourceContract):
    @pytest.fixture
    def log_harness(self, cdc_db: CdcDatabase) -> PgLogHarness:
        return PgLogHarness(cdc_db)


class TestPgLogicalSourceStream(LogSourceContract):
    @pytest.fixture
    def log_harness(self, cdc_db: CdcDatabase) -> PgLogHarness:
        return PgLogHarness(cdc_db, mode="stream")


class TestBinlogSource(LogSourceContract):
    @pytest.fixture
    def log_harness(self, binlog_db: BinlogDatabase) -> BinlogLogHarness:
        return BinlogLogHarness(binlog_db)


pytest_plugins = ["pytester"]

#: Each broken log source, and a test of the suite that must catch it.
CAUGHT_BY = {
    "position_only_checkpoint": "test_fetch_is_strictly_after_each_change_inside_a_transaction",
    "inclusive_after": "test_fetch_is_strictly_after_each_change_inside_a_transaction",
    "ids_by_key": "test_event_ids_name_the_change",
    "forgets_on_acknowledge": "test_acknowledging_a_checkpoint_keeps_everything_after_it",
    "start_order": "test_transactions_arrive_in_commit_order_not_start_order",
    "keeps_rolled_back": "test_a_rolled_back_transaction_never_appears",
    "keyless_delete": "test_inserts_updates_and_deletes_in_commit_order",
}


def test_the_log_suite_passes_the_memory_log_and_fails_every_broken_one(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(log_harness_glue="from tests.contracts import broken_log, log_harnesses\n")
    makes = {"correct": {"log_harness": "log_harnesses.MemoryLogHarness()"}}
    for name in CAUGHT_BY:
        makes[name] = {"log_harness": f"broken_log.BROKEN_LOG_HARNESSES[{name!r}]()"}
    failures = nested_failures(pytester, "LogSourceContract", makes)
    assert failures.pop("correct") == set()
    missed = {name: got for name, got in failures.items() if CAUGHT_BY[name] not in got}
    assert missed == {}, f"a broken log source the suite did not catch as expected: {missed}"


class TestChangeLogSource(LogSourceContract):
    """The trigger-maintained change log: a sequence log (see the suite's doc)."""

    commit_ordered = False
    position_field = "dbt_seq"

    @pytest.fixture
    def log_harness(self, db: TestDatabase) -> ChangeLogHarness:
        return ChangeLogHarness(db)
