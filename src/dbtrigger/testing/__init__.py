"""Public helpers for testing code built on dbtrigger, and the contract suites.

In-memory parts, each passing the same contract suite as the real thing:

* :class:`MemorySource` - a ``SourceAdapter`` over rows a test puts in;
* :class:`MemoryLogSource` - a log-based source over transactions a test commits;
* :class:`MemoryQuarantineSink` - a dead-letter sink that keeps records in a list;
* :class:`CountingStore` - wraps any ``CheckpointStore`` and counts its calls.

The contract suites, one per port, for anyone writing an implementation of
their own (subclass the suite in a pytest module and provide one fixture; see
``docs/testing.md``):

* :class:`StoreContract` - ``CheckpointStore`` (fixture ``store``);
* :class:`SourceContract` - ``SourceAdapter`` (fixture ``source_harness``, a
  :class:`SourceHarness`);
* :class:`LogSourceContract` - a log-based source (fixture ``log_harness``, a
  :class:`LogSourceHarness`);
* :class:`SinkContract` - ``QuarantineSink`` (fixtures ``sink`` and
  ``unavailable_sink``);
* :class:`ClaimSourceContract` - a claim queue's source (fixture
  ``claim_harness``, a :class:`ClaimSourceHarness`): disjoint claims,
  attempts, fencing, settle counts, expiry.

The suites need pytest; they are imported on first use, so importing this
module (or ``dbtrigger``) never imports pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dbtrigger.sources.memory import MemorySource
from dbtrigger.testing.counting import CountingStore, StoreCall, StoreCounts
from dbtrigger.testing.memory_log import MemoryLogSource
from dbtrigger.testing.sinks import MemoryQuarantineSink

if TYPE_CHECKING:
    from dbtrigger.testing.contracts import (
        ClaimPort,
        ClaimSourceContract,
        ClaimSourceHarness,
        ContractRow,
        LogOp,
        LogSourceContract,
        LogSourceHarness,
        SinkContract,
        SourceContract,
        SourceHarness,
        StoreContract,
    )


def __getattr__(name: str) -> Any:
    # The suites import pytest: load them only when someone asks for one (every
    # public name not bound above is a contract suite's).
    if name in __all__:
        try:
            from dbtrigger.testing import contracts  # noqa: PLC0415
        except ModuleNotFoundError as exc:
            if exc.name != "pytest":
                raise
            raise ModuleNotFoundError(
                f"{name} is a pytest suite (its tests are pytest test methods): "
                "pip install pytest, then run your test module with python -m pytest",
                name="pytest",
            ) from exc
        return getattr(contracts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClaimPort",
    "ClaimSourceContract",
    "ClaimSourceHarness",
    "ContractRow",
    "CountingStore",
    "LogOp",
    "LogSourceContract",
    "LogSourceHarness",
    "MemoryLogSource",
    "MemoryQuarantineSink",
    "MemorySource",
    "SinkContract",
    "SourceContract",
    "SourceHarness",
    "StoreCall",
    "StoreContract",
    "StoreCounts",
]
