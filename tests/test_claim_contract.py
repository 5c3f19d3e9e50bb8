"""The claim-source contract (issue #21 item 9) on every database, in both modes.

``ClaimSource`` in columns mode (the claim columns on the queue table) and in
sidecar mode (a claims table a feeder fills), on SQLite, PostgreSQL and
MariaDB: disjoint claims (also from four threads at once), attempts,
fencing, settle counts and expiry.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dbtrigger.testing import ClaimSourceContract
from tests.contracts.claim_harnesses import ColumnsHarness, SidecarHarness
from tests.contracts.nested import nested_failures
from tests.databases import TestDatabase


class TestClaimSourceColumns(ClaimSourceContract):
    @pytest.fixture
    def claim_harness(self, db: TestDatabase) -> ColumnsHarness:
        return ColumnsHarness(db)


class TestClaimSourceSidecar(ClaimSourceContract):
    @pytest.fixture
    def claim_harness(self, db: TestDatabase) -> Iterator[SidecarHarness]:
        harness = SidecarHarness(db)
        yield harness
        harness.close()


pytest_plugins = ["pytester"]

#: Each broken claim source, and a test of the suite that must catch it.
CAUGHT_BY = {
    "unfenced": "test_an_expired_claim_is_taken_over_and_fenced_out",
    "overreporting": "test_settle_reports_exactly_what_it_wrote",
    "first_attempt_forever": "test_a_retry_waits_its_delay_and_counts_an_attempt",
    "sharing": "test_claims_take_each_ready_row_once_first_attempt_first",
}


def test_the_claim_suite_passes_a_real_queue_and_fails_every_broken_one(
    pytester: pytest.Pytester,
) -> None:
    makes = {"correct": {"claim_harness": "broken_claim.sqlite_queue()"}}
    for name in CAUGHT_BY:
        makes[name] = {"claim_harness": f"broken_claim.BROKEN_CLAIM_HARNESSES[{name!r}]()"}
    failures = nested_failures(pytester, "ClaimSourceContract", makes)
    assert failures.pop("correct") == set()
    missed = {name: got for name, got in failures.items() if CAUGHT_BY[name] not in got}
    assert missed == {}, f"a broken claim source the suite did not catch as expected: {missed}"
