"""docs/testing.md runs as written: its script, and its test module under pytest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# The suites, imported at collection: before pytester's snapshot of sys.modules. Looked
# up inside the test (lazily imported), the modules they import, SQLAlchemy's PostgreSQL
# dialect among them, were forgotten at pytester's teardown, and the next test on the
# worker to use PostgreSQL imported the dialect again, which warns (an error here).
from dbtrigger.testing import SinkContract, SourceContract, StoreContract

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_the_doc_has_a_script_and_a_test_module() -> None:
    blocks = python_blocks()
    assert len(blocks) == 2
    assert blocks[1].startswith("# test_my_adapters.py\n")


def test_the_in_memory_example_runs() -> None:
    script = python_blocks()[0]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_contract_example_passes_every_suite(pytester: pytest.Pytester) -> None:
    module = python_blocks()[1]
    pytester.makepyfile(test_my_adapters=module)
    # A process of its own, as a user's run would be: in-process, pytester forgets the
    # modules the inner run imported, and importing SQLAlchemy's dialects a second time
    # in one process warns (an error here).
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    counts = {StoreContract: 14, SourceContract: 18, SinkContract: 10}
    result.assert_outcomes(passed=sum(counts.values()))
    for suite, n in counts.items():
        tests = [name for name in dir(suite) if name.startswith("test_")]
        assert len(tests) == n, suite.__name__
