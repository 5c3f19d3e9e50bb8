"""Run a contract suite in a nested pytest session and report which tests failed.

This is how the meta-tests prove a suite can fail: the suite runs exactly as a
user's pytest runs it (a subclass with one fixture), once per implementation,
each built by an expression over :mod:`tests.contracts.broken` and
:mod:`tests.contracts.harnesses`. All implementations share one nested session
(a session costs seconds; a test costs milliseconds).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

HEADER = """
import pytest
from dbtrigger.testing import {suite}
from tests.contracts import broken, broken_claim, broken_log, harnesses, log_harnesses
"""

CLASS = """

class Test_{name}({suite}):
"""

FIXTURE = """
    @pytest.fixture
    def {fixture}(self):
        return {make}
"""


def nested_failures(
    pytester: pytest.Pytester, suite: str, makes: dict[str, dict[str, str]]
) -> dict[str, set[str]]:
    """For each name in ``makes``: the names of the suite's tests that failed on it.

    ``makes[name]`` maps each fixture the suite needs to the expression that
    builds it for that implementation.

    Fails when an implementation ran no test at all (a nested session that did
    not collect proves nothing).
    """
    source = HEADER.format(suite=suite)
    for name, fixtures in makes.items():
        source += CLASS.format(name=name, suite=suite)
        for fixture, make in fixtures.items():
            source += FIXTURE.format(fixture=fixture, make=make)
    pytester.makepyfile(test_nested=source)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    passed, _, failed = result.reprec.listoutcomes()  # type: ignore[union-attr]
    ran: dict[str, int] = defaultdict(int)
    failures: dict[str, set[str]] = {name: set() for name in makes}
    for report in (*passed, *failed):
        _, cls, test = report.nodeid.split("::")
        ran[cls.removeprefix("Test_")] += 1
    for report in failed:
        _, cls, test = report.nodeid.split("::")
        failures[cls.removeprefix("Test_")].add(test.split("[")[0])
    assert set(ran) == set(makes), result.stdout.str()
    return failures
