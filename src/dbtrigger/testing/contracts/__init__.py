"""One contract suite per port: subclass a suite in a pytest module, provide its fixture.

Importing this package imports pytest (the suites are pytest test classes),
and asks pytest to rewrite the suites' ``assert`` statements so a failing
contract shows the values it compared.
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite(
    "dbtrigger.testing.contracts.claim_source",
    "dbtrigger.testing.contracts.log_source",
    "dbtrigger.testing.contracts.sink",
    "dbtrigger.testing.contracts.source",
    "dbtrigger.testing.contracts.store",
)

from dbtrigger.testing.contracts.claim_source import (  # noqa: E402
    ClaimPort,
    ClaimSourceContract,
    ClaimSourceHarness,
)
from dbtrigger.testing.contracts.log_source import (  # noqa: E402
    LogOp,
    LogSourceContract,
    LogSourceHarness,
)
from dbtrigger.testing.contracts.sink import SinkContract  # noqa: E402
from dbtrigger.testing.contracts.source import ContractRow, SourceContract, SourceHarness  # noqa: E402
from dbtrigger.testing.contracts.store import StoreContract  # noqa: E402

__all__ = [
    "ClaimPort",
    "ClaimSourceContract",
    "ClaimSourceHarness",
    "ContractRow",
    "LogOp",
    "LogSourceContract",
    "LogSourceHarness",
    "SinkContract",
    "SourceContract",
    "SourceHarness",
    "StoreContract",
]
