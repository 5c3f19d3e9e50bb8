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
    LiveLeaseError,
    LostLeaseError,
    OperatorError,
    OutputWriteError,
    PartialBatchError,
    QuarantineError,
    RetryableError,
    SerializationError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
    UnsafeIdentifierError,
    UnsupportedDocumentError,
)
from dbtrigger.events import RowChange, dedup_key, make_event_id
from dbtrigger.metrics import InMemoryMetrics, MetricsCollector, NullMetrics
from dbtrigger.output import DbOut
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

if TYPE_CHECKING:
    from dbtrigger.state.stores.blob import BlobCheckpointStore
    from dbtrigger.state.stores.sql import SqlCheckpointStore
    from dbtrigger.state.stores.table import TableCheckpointStore

_LAZY_STORES = ("BlobCheckpointStore", "SqlCheckpointStore", "TableCheckpointStore")


def __getattr__(name: str) -> Any:
    # Stores whose modules need optional SDKs are imported on first use.
    if name in _LAZY_STORES:
        from dbtrigger.state import stores  # noqa: PLC0415

        return getattr(stores, name)
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
    "RetryPolicy",
    "RetryableError",
    "RowChange",
    "SafetyWindow",
    "SerializationError",
    "SnapshotHorizon",
    "SourceAdapter",
    "SqlAlchemySource",
    "SqlCheckpointStore",
    "StateDocument",
    "StoreAuthError",
    "StoreError",
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
