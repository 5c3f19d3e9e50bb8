"""dbtrigger: any SQL table as an at-least-once event source.

A timer fires, :class:`PollTrigger` reads the rows changed since its checkpoint
from a :class:`SqlAlchemySource`, hands them to your handler as
:class:`RowChange` batches and advances the checkpoint in a
:class:`CheckpointStore` only after the handler succeeded.
"""

from typing import TYPE_CHECKING, Any

from dbtrigger.azure import DbBindings, LeaseScheduleWarning
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import (
    AmbiguousCommitError,
    AmbiguousWriteError,
    CasConflictError,
    CommitError,
    ConfigurationError,
    ContentionError,
    CorruptStateError,
    DbTriggerError,
    FetchError,
    FingerprintMismatchError,
    HandlerError,
    LeaseAcquireError,
    LostLeaseError,
    OperatorError,
    PartialBatchError,
    QuarantineError,
    RetryableError,
    SerializationError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
    UnsafeIdentifierError,
)
from dbtrigger.events import RowChange, dedup_key, make_event_id
from dbtrigger.metrics import InMemoryMetrics, MetricsCollector, NullMetrics
from dbtrigger.output import DbOut
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.poller import PollTrigger, TickResult
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores import (
    CheckpointStore,
    FileCheckpointStore,
    InMemoryCheckpointStore,
    StoredDocument,
)

if TYPE_CHECKING:
    from dbtrigger.state.stores.blob import BlobCheckpointStore


def __getattr__(name: str) -> Any:
    # BlobCheckpointStore needs the optional azure extra: import it on first use.
    if name == "BlobCheckpointStore":
        from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

        return BlobCheckpointStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "BEGINNING",
    "AmbiguousCommitError",
    "AmbiguousWriteError",
    "BatchContext",
    "BlobCheckpointStore",
    "CasConflictError",
    "CheckpointStore",
    "CommitError",
    "ConfigurationError",
    "ContentionError",
    "CorruptStateError",
    "DbBindings",
    "DbOut",
    "DbTriggerError",
    "FetchError",
    "FileCheckpointStore",
    "FingerprintMismatchError",
    "HandlerError",
    "InMemoryCheckpointStore",
    "InMemoryMetrics",
    "LeaseAcquireError",
    "LeaseScheduleWarning",
    "LostLeaseError",
    "MetricsCollector",
    "NullMetrics",
    "OperatorError",
    "PartialBatchError",
    "PollTrigger",
    "Position",
    "QuarantineError",
    "RetryPolicy",
    "RetryableError",
    "RowChange",
    "SerializationError",
    "SourceAdapter",
    "SqlAlchemySource",
    "StateDocument",
    "StoreAuthError",
    "StoreError",
    "StoreUnavailableError",
    "StoredDocument",
    "TickResult",
    "UnsafeIdentifierError",
    "__version__",
    "dedup_key",
    "make_event_id",
]
