"""dbtrigger: any SQL table as an at-least-once event source.

A timer fires, :class:`PollTrigger` reads the rows changed since its checkpoint
from a :class:`SqlAlchemySource`, hands them to your handler as
:class:`RowChange` batches and advances the checkpoint in a
:class:`CheckpointStore` only after the handler succeeded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Light modules (the standard library only) are imported eagerly; everything
# that pulls in SQLAlchemy, a driver, tenacity or an Azure SDK is imported the
# first time one of its names is used (see ``_LAZY`` and ``__getattr__``), so
# ``import dbtrigger`` stays cheap for a Functions worker's cold start and for
# tools that only need the error classes or ``RowChange``.
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import (
    AckTimeoutError,
    AmbiguousCommitError,
    AmbiguousWriteError,
    CasConflictError,
    CommitError,
    ConfigurationError,
    ContentionError,
    CorruptStateError,
    DbTriggerError,
    FailureRecordError,
    FetchError,
    FingerprintMismatchError,
    HandlerError,
    LeaseAcquireError,
    LiveLeaseError,
    LostLeaseError,
    OperatorError,
    OutputWriteError,
    PartialBatchError,
    QuarantineError,
    RetryableError,
    SerializationError,
    SourceDefinitionError,
    SourcePermissionError,
    StoreAuthError,
    StoreError,
    StoreRefusedError,
    StoreUnavailableError,
    UnsafeIdentifierError,
    UnsupportedDocumentError,
)
from dbtrigger.events import RowChange, dedup_key, make_event_id
from dbtrigger.redaction import RedactingFilter  # importing it protects our loggers

if TYPE_CHECKING:
    from dbtrigger.azure import DbBindings, LeaseScheduleWarning
    from dbtrigger.metrics import InMemoryMetrics, MetricsCollector, NullMetrics
    from dbtrigger.output import DbOut
    from dbtrigger.queue import ClaimContext, ClaimSource, QueueTickResult, QueueTrigger
    from dbtrigger.runtime.context import BatchContext
    from dbtrigger.runtime.poller import PollTrigger, TickResult
    from dbtrigger.runtime.retry import RetryPolicy
    from dbtrigger.sources.base import SourceAdapter
    from dbtrigger.sources.sqlalchemy import SqlAlchemySource
    from dbtrigger.sources.visibility import (
        NoGuard,
        SafetyWindow,
        SnapshotHorizon,
        TransactionHorizon,
        install_visibility_trigger,
    )
    from dbtrigger.state.document import StateDocument
    from dbtrigger.state.stores import (
        CheckpointStore,
        FileCheckpointStore,
        InMemoryCheckpointStore,
        StoredDocument,
    )
    from dbtrigger.state.stores.blob import BlobCheckpointStore
    from dbtrigger.state.stores.sql import SqlCheckpointStore
    from dbtrigger.state.stores.table import TableCheckpointStore

#: Public name -> the module that defines it, imported on first use.
_LAZY = {
    "DbBindings": "dbtrigger.azure",
    "LeaseScheduleWarning": "dbtrigger.azure",
    "InMemoryMetrics": "dbtrigger.metrics",
    "MetricsCollector": "dbtrigger.metrics",
    "NullMetrics": "dbtrigger.metrics",
    "DbOut": "dbtrigger.output",
    "ClaimContext": "dbtrigger.queue",
    "ClaimSource": "dbtrigger.queue",
    "QueueTickResult": "dbtrigger.queue",
    "QueueTrigger": "dbtrigger.queue",
    "BatchContext": "dbtrigger.runtime.context",
    "PollTrigger": "dbtrigger.runtime.poller",
    "TickResult": "dbtrigger.runtime.poller",
    "RetryPolicy": "dbtrigger.runtime.retry",
    "SourceAdapter": "dbtrigger.sources.base",
    "SqlAlchemySource": "dbtrigger.sources.sqlalchemy",
    "NoGuard": "dbtrigger.sources.visibility",
    "SafetyWindow": "dbtrigger.sources.visibility",
    "SnapshotHorizon": "dbtrigger.sources.visibility",
    "TransactionHorizon": "dbtrigger.sources.visibility",
    "install_visibility_trigger": "dbtrigger.sources.visibility",
    "StateDocument": "dbtrigger.state.document",
    "CheckpointStore": "dbtrigger.state.stores",
    "FileCheckpointStore": "dbtrigger.state.stores",
    "InMemoryCheckpointStore": "dbtrigger.state.stores",
    "StoredDocument": "dbtrigger.state.stores",
    "BlobCheckpointStore": "dbtrigger.state.stores",
    "SqlCheckpointStore": "dbtrigger.state.stores",
    "TableCheckpointStore": "dbtrigger.state.stores",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "BEGINNING",
    "AckTimeoutError",
    "AmbiguousCommitError",
    "AmbiguousWriteError",
    "BatchContext",
    "BlobCheckpointStore",
    "CasConflictError",
    "CheckpointStore",
    "ClaimContext",
    "ClaimSource",
    "CommitError",
    "ConfigurationError",
    "ContentionError",
    "CorruptStateError",
    "DbBindings",
    "DbOut",
    "DbTriggerError",
    "FailureRecordError",
    "FetchError",
    "FileCheckpointStore",
    "FingerprintMismatchError",
    "HandlerError",
    "InMemoryCheckpointStore",
    "InMemoryMetrics",
    "LeaseAcquireError",
    "LeaseScheduleWarning",
    "LiveLeaseError",
    "LostLeaseError",
    "MetricsCollector",
    "NoGuard",
    "NullMetrics",
    "OperatorError",
    "OutputWriteError",
    "PartialBatchError",
    "PollTrigger",
    "Position",
    "QuarantineError",
    "QueueTickResult",
    "QueueTrigger",
    "RedactingFilter",
    "RetryPolicy",
    "RetryableError",
    "RowChange",
    "SafetyWindow",
    "SerializationError",
    "SnapshotHorizon",
    "SourceAdapter",
    "SourceDefinitionError",
    "SourcePermissionError",
    "SqlAlchemySource",
    "SqlCheckpointStore",
    "StateDocument",
    "StoreAuthError",
    "StoreError",
    "StoreRefusedError",
    "StoreUnavailableError",
    "StoredDocument",
    "TableCheckpointStore",
    "TickResult",
    "TransactionHorizon",
    "UnsafeIdentifierError",
    "UnsupportedDocumentError",
    "__version__",
    "dedup_key",
    "install_visibility_trigger",
    "make_event_id",
]
