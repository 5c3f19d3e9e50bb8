"""dbtrigger: any SQL table as an at-least-once event source.

A timer fires, :class:`PollTrigger` reads the rows changed since its checkpoint
from a :class:`SqlAlchemySource`, hands them to your handler as
:class:`RowChange` batches and advances the checkpoint in a checkpoint store
only after the handler succeeded.

The root offers the names most code needs (``__all__``: triggers, sources,
stores, contexts, bindings, sinks, health, the worker's loop). Everything else
has its public module (``docs/api.md`` lists them); errors are in
:mod:`dbtrigger.errors`.
``DbTriggerError`` and the six errors the runtime contract names
(``LeaseAcquireError``, ``FetchError``, ``SerializationError``,
``HandlerError``, ``LostLeaseError``, ``CommitError``) are importable from
here too. Names the root offered before are still found, with a
``DeprecationWarning`` naming their module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dbtrigger import _lazy
from dbtrigger import errors as _errors
from dbtrigger import redaction as _redaction  # importing it protects our loggers
from dbtrigger.errors import CommitError as CommitError
from dbtrigger.errors import DbTriggerError as DbTriggerError
from dbtrigger.errors import FetchError as FetchError
from dbtrigger.errors import HandlerError as HandlerError
from dbtrigger.errors import LeaseAcquireError as LeaseAcquireError
from dbtrigger.errors import LostLeaseError as LostLeaseError
from dbtrigger.errors import SerializationError as SerializationError
from dbtrigger.events import RowChange
from dbtrigger.runtime import deprecated as _deprecated

if TYPE_CHECKING:
    from dbtrigger.azure import DbBindings
    from dbtrigger.changelog.source import ChangeLogSource
    from dbtrigger.health import check_health
    from dbtrigger.metrics import MetricsCollector
    from dbtrigger.output import DbOut
    from dbtrigger.quarantine import JsonLinesQuarantineSink, SqlQuarantineSink
    from dbtrigger.queue import ClaimContext, ClaimSource, QueueTrigger
    from dbtrigger.runtime.context import BatchContext
    from dbtrigger.runtime.poller import PollTrigger, TickResult
    from dbtrigger.runtime.retry import RetryPolicy
    from dbtrigger.runtime.runner import Runner
    from dbtrigger.runtime.subscriber_options import renamed
    from dbtrigger.sources.sqlalchemy import SqlAlchemySource
    from dbtrigger.state.stores import (
        BlobCheckpointStore,
        FileCheckpointStore,
        InMemoryCheckpointStore,
        SqlCheckpointStore,
        TableCheckpointStore,
    )

#: Importable from the root although not listed: the runtime contract names them.
_CONTRACT_ERRORS = (
    "DbTriggerError",
    "LeaseAcquireError",
    "FetchError",
    "SerializationError",
    "HandlerError",
    "LostLeaseError",
    "CommitError",
)

# Everything that pulls in SQLAlchemy, a driver, tenacity or an Azure SDK is
# imported the first time one of its names is used, so ``import dbtrigger``
# stays cheap for a Functions worker's cold start.
_NAMES = {
    "PollTrigger": "dbtrigger.runtime.poller",
    "TickResult": "dbtrigger.runtime.poller",
    "RetryPolicy": "dbtrigger.runtime.retry",
    "Runner": "dbtrigger.runtime.runner",
    "renamed": "dbtrigger.runtime.subscriber_options",
    "BatchContext": "dbtrigger.runtime.context",
    "QueueTrigger": "dbtrigger.queue",
    "ClaimSource": "dbtrigger.queue",
    "ClaimContext": "dbtrigger.queue",
    "SqlAlchemySource": "dbtrigger.sources.sqlalchemy",
    "ChangeLogSource": "dbtrigger.changelog.source",
    "InMemoryCheckpointStore": "dbtrigger.state.stores",
    "FileCheckpointStore": "dbtrigger.state.stores",
    "BlobCheckpointStore": "dbtrigger.state.stores",
    "TableCheckpointStore": "dbtrigger.state.stores",
    "SqlCheckpointStore": "dbtrigger.state.stores",
    "DbBindings": "dbtrigger.azure",
    "DbOut": "dbtrigger.output",
    "JsonLinesQuarantineSink": "dbtrigger.quarantine",
    "SqlQuarantineSink": "dbtrigger.quarantine",
    "check_health": "dbtrigger.health",
    "MetricsCollector": "dbtrigger.metrics",
}

#: Names the root offered before this release, and their public module now.
_MOVED = {
    **dict.fromkeys(("BEGINNING", "Position"), "dbtrigger.cursor"),
    **dict.fromkeys(("dedup_key", "make_event_id"), "dbtrigger.events"),
    **dict.fromkeys(("InMemoryMetrics", "NullMetrics"), "dbtrigger.metrics"),
    **dict.fromkeys(("CheckpointStore", "StoredDocument"), "dbtrigger.state.stores"),
    **dict.fromkeys(
        ("NoGuard", "SafetyWindow", "SnapshotHorizon", "TransactionHorizon"),
        "dbtrigger.sources.visibility",
    ),
    "install_visibility_trigger": "dbtrigger.sources.visibility",
    "LeaseScheduleWarning": "dbtrigger.azure",
    "QueueTickResult": "dbtrigger.queue",
    "RedactingFilter": "dbtrigger.redaction",
    "SourceAdapter": "dbtrigger.sources",
    "StateDocument": "dbtrigger.state.document",
    # Every other error: they live in dbtrigger.errors.
    **dict.fromkeys(set(_errors.__all__) - set(_CONTRACT_ERRORS), "dbtrigger.errors"),
}


def _partitioned_member(**options: Any) -> Any:
    """The member a deprecated ``PollTrigger(partitions=N)`` delegates to: the
    root stands above the runtime and the partitions wing, so it ties them."""
    from dbtrigger.partitions.member import PartitionedPoller  # noqa: PLC0415 - on use only

    return PartitionedPoller(**options)


_deprecated.partitioned_member = _partitioned_member

_exported, _exported_dir = _lazy.exports(__name__, _NAMES, moved=_MOVED)

if TYPE_CHECKING:
    __version__: str


def __getattr__(name: str) -> Any:
    # The version is read on first use: importlib.metadata and its scan of the
    # installed distributions were about a tenth of `import dbtrigger`.
    if name == "__version__":
        version = globals()["__version__"] = _lazy.installed_version("dbtrigger")
        return version
    return _exported(name)


def __dir__() -> list[str]:
    return sorted({*_exported_dir(), "__version__"})


del _redaction, _deprecated

__all__ = [
    "BatchContext",
    "BlobCheckpointStore",
    "ChangeLogSource",
    "ClaimContext",
    "ClaimSource",
    "DbBindings",
    "DbOut",
    "FileCheckpointStore",
    "InMemoryCheckpointStore",
    "JsonLinesQuarantineSink",
    "MetricsCollector",
    "PollTrigger",
    "QueueTrigger",
    "RetryPolicy",
    "RowChange",
    "Runner",
    "SqlAlchemySource",
    "SqlCheckpointStore",
    "SqlQuarantineSink",
    "TableCheckpointStore",
    "TickResult",
    "check_health",
    "renamed",
]
