"""The whole dbtrigger error tree.

Errors are grouped by what the caller should do about them, not by which
module raised them:

* :class:`RetryableError` - something outside us hiccupped; the next tick
  retries from the last committed checkpoint and nothing is lost.
* :class:`ContentionError` - another instance won a race for the state
  document; that is the lease protocol working, not a fault.
* :class:`OperatorError` - polling cannot make progress until a person
  fixes configuration, data or credentials. These must never be reported as
  "0 rows processed": they propagate so the Functions invocation fails loudly.

The six errors named by the runtime contract (``LeaseAcquireError``,
``FetchError``, ``SerializationError``, ``HandlerError``, ``LostLeaseError``,
``CommitError``) sit in that tree where their recovery belongs.

Each error's default message is its class docstring, so ``raise FetchError()``
still explains itself; structured fields (poller, batch id, fencing token) are
kept as attributes for logs and metrics.
"""

from __future__ import annotations

from typing import Any


class DbTriggerError(Exception):
    """A dbtrigger operation failed."""

    def __init__(
        self,
        message: str | None = None,
        *,
        poller: str | None = None,
        batch_id: str | None = None,
        fencing_token: int | None = None,
        **fields: Any,
    ) -> None:
        doc = (type(self).__doc__ or "").strip().splitlines()
        self.message = message or (doc[0] if doc else type(self).__name__)
        self.poller = poller
        self.batch_id = batch_id
        self.fencing_token = fencing_token
        self.fields = fields
        super().__init__(self.message)

    def log_fields(self) -> dict[str, Any]:
        """Structured context for ``logging`` ``extra=`` and metrics labels."""
        out: dict[str, Any] = {"error_type": type(self).__name__}
        if self.poller is not None:
            out["poller"] = self.poller
        if self.batch_id is not None:
            out["batch_id"] = self.batch_id
        if self.fencing_token is not None:
            out["fencing_token"] = self.fencing_token
        out.update(self.fields)
        return out


# --- groups -----------------------------------------------------------------


class RetryableError(DbTriggerError):
    """A transient failure; the next tick retries from the committed checkpoint."""


class ContentionError(DbTriggerError):
    """Another instance changed the state document first."""


class OperatorError(DbTriggerError):
    """Polling cannot progress until configuration, data or credentials are fixed."""


# --- the contract's six -------------------------------------------------------


class LeaseAcquireError(ContentionError):
    """Another instance holds a live lease; this tick does nothing."""


class FetchError(RetryableError):
    """Reading the source or the state store failed; the handler was not invoked."""


class SerializationError(OperatorError):
    """Source rows could not be turned into events or cursors; the cursor did not move."""


class HandlerError(RetryableError):
    """The handler raised; the checkpoint did not advance and the batch will be redelivered."""


class AckTimeoutError(HandlerError):
    """A subscriber did not finish within ``ack_timeout_seconds``: its events count as
    failed for it alone and are delivered to it again; the other subscribers go on."""


class CommitError(RetryableError):
    """The checkpoint commit failed; the batch will be redelivered."""


class LostLeaseError(CommitError, ContentionError):
    """Another instance took the lease over; this instance's results were discarded."""


# --- beyond the six ----------------------------------------------------------


class AmbiguousCommitError(CommitError):
    """The commit timed out; it may or may not have persisted. The next tick re-reads."""


class ConfigurationError(OperatorError, ValueError):
    """The dbtrigger configuration is invalid."""


class MissingSettingError(ConfigurationError):
    """A ``%SETTING%`` reference names an app setting that is not set."""


class UnsafeIdentifierError(ConfigurationError):
    """An identifier from configuration is not a safe SQL or storage name."""


class SourceDefinitionError(ConfigurationError):
    """The source database, table or columns do not fit the configuration (or the checkpoint).

    Missing database, table or column, a column type that cannot be compared
    exactly, key columns that are not unique, a cursor column whose type changed
    under a stored checkpoint: retrying cannot help, a person must fix the
    definition or the table. ``fields`` carry ``column`` and ``sqlstate`` when known.
    """


class ChangeLogDriftError(SourceDefinitionError):
    """The change log's triggers no longer match the watched table; re-install the change log.

    A migration changed the table after ``dbtrigger changelog install`` (a
    column added, dropped or renamed, the key renamed or retyped, the table
    dropped or rebuilt), or the triggers were installed by an older dbtrigger.
    The application's writes are not affected; the log may be missing row
    images or keys until the change log is installed again. ``fields`` carry
    ``problems`` (one line each) and ``fix`` (the install command).
    """


class ChangeLogGapError(SourceDefinitionError):
    """Change-log rows record changes to a row that cannot be named; they cannot be delivered.

    A trigger that could not read the changed row's key (the key column was
    renamed or dropped and the database gave the trigger no way to read it)
    still logs that a change happened, so the gap is reported, never skipped.
    """


class SourcePermissionError(OperatorError):
    """The source database refused these credentials or this user's privileges."""


class FingerprintMismatchError(OperatorError):
    """The source definition changed since the checkpoint was written; reset or rename."""


class CorruptStateError(OperatorError):
    """The stored state document is malformed; restore a backup or reset it."""


class StoreError(DbTriggerError):
    """A checkpoint store operation failed."""


class CasConflictError(StoreError, ContentionError):
    """The conditional write lost: the document changed since it was read."""


class StoreUnavailableError(StoreError, RetryableError):
    """The checkpoint store could not be reached; nothing was changed."""


class HistoryPrunedError(StoreUnavailableError):
    """Retention pruned history records while they were being read; read again."""


class AmbiguousWriteError(StoreError, RetryableError):
    """The store did not answer a write in time; the write may or may not have landed."""


class StoreAuthError(StoreError, OperatorError):
    """The checkpoint store refused our credentials or permissions."""


class StoreRefusedError(StoreError, OperatorError):
    """The store refused the change for a reason other than a lost race; a person must act.

    For example a lease someone took on the state blob, an immutability policy,
    a table being deleted: retrying will not help, and it is not another
    instance winning (that is :class:`CasConflictError`).
    """


class UnsupportedDocumentError(StoreError, OperatorError):
    """The checkpoint store cannot hold this document (too large for it, or not UTF-8 text)."""


class PartialBatchError(DbTriggerError):
    """Raised by a handler to say which rows of the batch failed.

    The rows not named are treated as processed; only the named ones are retried
    (and quarantined, when a quarantine sink is configured).
    """

    def __init__(
        self,
        failed_pks: list[dict[str, Any]],
        message: str | None = None,
        *,
        causes: dict[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message or f"{len(failed_pks)} row(s) of the batch failed")
        self.failed_pks = failed_pks
        self.causes = causes or {}


class FailureRecordError(OperatorError):
    """A failed attempt could not be recorded; attempts are not counted until this is fixed."""


class CrashLoopError(OperatorError):
    """A batch killed the process delivering it on every attempt; it is not handed over again.

    Raised before the handler is called, so the worker stops instead of dying
    again; the message names the batch's first and last row and the ways on.
    Without a dead-letter sink; with one, the batch's rows are handed over one
    at a time and the row at fault is set aside (docs/reliability.md), unless
    the process keeps dying outside the handler calls.
    """


class LiveLeaseError(ContentionError):
    """A live lease is held; the manual change was refused (``--force`` fences the holder out)."""


class QuarantineError(RetryableError):
    """Rows could not be written to the quarantine sink; nothing was skipped."""


class OutputWriteError(RetryableError):
    """The output binding could not write its rows; the batch is not committed and comes again."""


class OutputLockTimeoutError(OutputWriteError):
    """The write waited ``lock_timeout_seconds`` for a lock another transaction holds and
    gave up; nothing was written and the batch comes again. ``fields`` carry ``table``,
    ``seconds`` and ``holders`` (who holds locks on the table, when it could be told)."""


class OutputReferenceError(OutputWriteError):
    """A row to write refers to a row that is not there, or a row to delete is still
    referred to (a foreign key); retryable, since the other row may come later. ``fields``
    carry ``table``, ``constraint``, ``columns``, ``row`` and ``key``; never values."""


class OutputConstraintError(OperatorError):
    """A row to write breaks a constraint of its table: a unique key other than the
    upsert's conflict key (or a key that exists, on insert), NOT NULL or CHECK. Writing
    it again cannot help: the row is a data problem (dead-letter it, or fix the data or
    the table). ``fields`` carry ``table``, ``kind``, ``constraint``, ``columns``,
    ``row`` and ``key`` (the row's key columns); the message never shows other values."""


class OutputValueError(OperatorError, TypeError):
    """A row to write holds a value its column cannot store (a dict in a text column,
    an object the driver cannot send); writing it again cannot help. ``fields`` carry
    ``table``, ``column`` and ``value_type``; the message never shows the value."""


class RowNotFoundError(DbTriggerError, LookupError):
    """A read that needs a row found none (``DbReader.one``, ``@db.input(...,
    on_not_found="raise")``)."""


# --- log-based capture (dbtrigger.cdc) -------------------------------------------


class DecodeBacklogError(FetchError):
    """Reading the log did not finish within the read timeout: the backlog to decode is
    too large for one read. The next reads step forward through it in bounded windows."""


class SlotLostError(OperatorError):
    """The replication slot is gone or invalidated, so the changes since the checkpoint
    can no longer be read; recreate it with a snapshot (``dbtrigger cdc recreate --snapshot``)."""


class ServerSettingError(ConfigurationError):
    """The database server is not set up for log-based capture; the message names the
    setting and how to change it."""


class SchemaChangedError(SourceDefinitionError):
    """A column of a watched table changed type in the log; accept the new shape
    (``dbtrigger cdc accept-schema``) before delivery goes on."""


class ReplayRefusedError(OperatorError):
    """A replay, rewind or dead-letter action cannot be done as asked: the history or
    the source cannot serve it (pruned, not recorded, no longer in the log); the
    message says which and what can be done instead."""


__all__ = [
    "AckTimeoutError",
    "AmbiguousCommitError",
    "AmbiguousWriteError",
    "CasConflictError",
    "ChangeLogDriftError",
    "ChangeLogGapError",
    "CommitError",
    "ConfigurationError",
    "ContentionError",
    "CorruptStateError",
    "CrashLoopError",
    "DbTriggerError",
    "DecodeBacklogError",
    "FailureRecordError",
    "FetchError",
    "FingerprintMismatchError",
    "HandlerError",
    "HistoryPrunedError",
    "LeaseAcquireError",
    "LiveLeaseError",
    "LostLeaseError",
    "OperatorError",
    "OutputConstraintError",
    "OutputLockTimeoutError",
    "OutputReferenceError",
    "OutputValueError",
    "OutputWriteError",
    "PartialBatchError",
    "QuarantineError",
    "ReplayRefusedError",
    "RetryableError",
    "SchemaChangedError",
    "SerializationError",
    "ServerSettingError",
    "SlotLostError",
    "SourceDefinitionError",
    "SourcePermissionError",
    "StoreAuthError",
    "StoreError",
    "StoreRefusedError",
    "StoreUnavailableError",
    "UnsafeIdentifierError",
    "UnsupportedDocumentError",
]
