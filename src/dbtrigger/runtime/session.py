"""A held lease: the document we last wrote, its etag, and CAS updates on it.

This is the only code that writes the state document during a tick. The
acquisition (:meth:`LeaseSession.acquire`) writes the lease the tick decided
to take; every later write (commit, heartbeat, failure record, release) goes
through :meth:`LeaseSession.update`, which applies a *pure* transition to the
document and writes it with the etag we hold. When the write loses (someone
else wrote) or its outcome is unknown (timeout), the session re-reads and
applies the same transition to what is there now: if the lease is still ours
the update goes through on the fresh etag, if not the transition itself raises
``LostLeaseError``. That makes an ambiguous write safe to retry: we recognise
our own landed write by its bytes. Both paths share one CAS step
(:meth:`LeaseSession._cas`): write, and on an ambiguous outcome re-read to
learn whether the write landed.

After an update that moved the checkpoint has landed, ``on_checkpoint`` is
called with the new (now durable) position: a source that holds data until it
is checkpointed (a replication slot) may then release it. It is called outside
the lock, once per new position.

A lock serialises updates so a heartbeat thread and the tick never race on
the etag. A store that is briefly unreachable (nothing was written) is retried
under the tick's :class:`~dbtrigger.runtime.retry.RetryPolicy`; credentials the
store refuses are an operator error and propagate unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from dbtrigger.cursor import Position
from dbtrigger.errors import (
    AmbiguousCommitError,
    AmbiguousWriteError,
    CasConflictError,
    CommitError,
    DbTriggerError,
    FetchError,
    LostLeaseError,
    OperatorError,
    StoreError,
    StoreUnavailableError,
)
from dbtrigger.runtime.retry import RetryHook, RetryPolicy
from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.lease import Acquired
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument
from dbtrigger.state.unreadable import load_state

Transition = Callable[[StateDocument], StateDocument]

#: Re-read-and-reapply rounds before a CAS update gives up.
MAX_CAS_ROUNDS = 4

#: Rounds an acquisition writes again after an ambiguous write that did not land.
MAX_ACQUIRE_ROUNDS = 3


@dataclass(frozen=True)
class _Landed:
    etag: str


@dataclass(frozen=True)
class _Conflict:
    """Someone else wrote. ``current`` is what is there now (None: deleted);
    it is only read when the caller resolves conflicts."""

    cause: StoreError
    current: StoredDocument | None = None


@dataclass(frozen=True)
class _NotLanded:
    """The write timed out and the document is unchanged: write it again."""

    cause: StoreError


_Outcome = _Landed | _Conflict | _NotLanded

#: Turns a store failure into the error the caller raises (``stage`` is
#: ``"write"``, ``"re-read"`` after a conflict, or ``"re-read after an
#: unanswered write"``, when the outcome of our own write is unknown).
_Translate = Callable[[str, StoreError], DbTriggerError]


@dataclass(eq=False, repr=False)
class LeaseSession:
    """The lease one tick holds on ``key``: the document and etag as last written
    under it, and every write the tick makes (compare-and-swap on that etag)."""

    store: CheckpointStore
    key: str
    document: StateDocument
    etag: str
    _: KW_ONLY
    owner: str
    token: int
    retry: RetryPolicy = field(default_factory=RetryPolicy.none)
    on_retry: RetryHook | None = None
    on_checkpoint: Callable[[Position], None] | None = None
    released: bool = field(default=False, init=False)
    lost: bool = field(default=False, init=False)
    writes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._checkpointed = self.document.position
        self._last_write = time.monotonic()
        self._lock = threading.Lock()

    @classmethod
    def acquire(
        cls,
        store: CheckpointStore,
        key: str,
        decision: Acquired,
        etag: str | None,
        *,
        owner: str,
        retry: RetryPolicy | None = None,
        on_retry: RetryHook | None = None,
        on_checkpoint: Callable[[Position], None] | None = None,
    ) -> LeaseSession | None:
        """Write the lease ``decision`` took on the document read with ``etag``
        (None: there was no document); the session, or None if we lost the race.

        Unlike :meth:`update`, a conflict is not re-decided: the rows the tick
        fetched were chosen for the document it read, so a lost race ends the
        tick. An ambiguous write is resolved by reading back: our bytes mean we
        hold the lease, an unchanged document means the write did not land
        (write again), anything else means somebody else got there.

        Raises:
            FetchError: the store failed, or the outcome could not be learnt.
            OperatorError: the store refused our credentials.
        """
        session = cls(
            store,
            key,
            decision.document,
            etag or "",
            owner=owner,
            token=decision.fencing_token,
            retry=retry or RetryPolicy.none(),
            on_retry=on_retry,
            on_checkpoint=on_checkpoint,
        )
        data = docmod.dumps(decision.document)

        def translate(stage: str, exc: StoreError) -> DbTriggerError:
            what = "acquire" if stage == "write" else "tell whether"
            tail = "" if stage == "write" else " was acquired"
            return FetchError(
                f"could not {what} the lease of poller {key!r}{tail}: {exc}", poller=key
            )

        sent_before = False
        for _ in range(MAX_ACQUIRE_ROUNDS):
            outcome = session._cas(
                data,
                etag,
                "lease acquire",
                translate,
                resolve_conflict=False,
                sent_before=sent_before,
            )
            if isinstance(outcome, _Landed):
                session._landed(decision.document, outcome.etag)
                return session
            if isinstance(outcome, _Conflict):
                return None
            sent_before = True  # unanswered, not there yet: it may still land
        return None

    def idle_seconds(self) -> float:
        """Seconds since the last write that landed (the acquisition counts)."""
        return time.monotonic() - self._last_write

    def update(self, transition: Transition, *, what: str) -> StateDocument:
        """Apply ``transition`` and CAS-write it; returns the written document.

        Raises:
            LostLeaseError: the lease is no longer ours (the transition said so).
            CommitError: the store kept failing; the outcome is not applied.
            OperatorError: the store refused our credentials (never retried).
        """
        with self._lock:
            written = self._update_locked(transition, what=what)
        if self.on_checkpoint is not None and written.position != self._checkpointed:
            self._checkpointed = written.position
            self.on_checkpoint(written.position)
        return written

    def renew(self, transition: Transition, *, min_idle_seconds: float) -> bool:
        """Heartbeat: write ``transition`` only if nothing was written for a while.

        Returns False without writing when the lease was released or lost, or
        when another write (a commit renews the lease too) landed less than
        ``min_idle_seconds`` ago; that is what keeps fast batches free of
        heartbeat writes.
        """
        with self._lock:
            if self.released or self.lost:
                return False
            if self.idle_seconds() < min_idle_seconds:
                return False
            self._update_locked(transition, what="heartbeat")
            return True

    def _landed(self, new_doc: StateDocument, etag: str) -> StateDocument:
        self.etag = etag
        self.document = new_doc
        self._last_write = time.monotonic()
        lease = new_doc.lease
        self.released = bool(
            lease is not None
            and lease.released
            and lease.owner_id == self.owner
            and lease.fencing_token == self.token
        )
        return new_doc

    def _cas(
        self,
        data: bytes,
        etag: str | None,
        operation: str,
        translate: _Translate,
        *,
        resolve_conflict: bool,
        sent_before: bool = False,
    ) -> _Outcome:
        """One conditional write of ``data`` over ``etag``, its outcome resolved.

        An ambiguous write (timeout) is always resolved by re-reading: our
        bytes there mean it landed. A plain conflict is re-read when the
        caller will decide again on the current document (``resolve_conflict``),
        or when these bytes were sent before (``sent_before``, or a retry here)
        and may be what the write lost to.
        """
        sent = 0

        def write() -> str:
            nonlocal sent
            sent += 1
            return self.store.write(self.key, data, if_match=etag)

        try:
            self.writes += 1
            return _Landed(
                self.retry.call(
                    write,
                    operation=operation,
                    kinds=(StoreUnavailableError,),
                    on_retry=self.on_retry,
                    fields={"poller": self.key, "fencing_token": self.token},
                )
            )
        except CasConflictError as exc:
            if not (resolve_conflict or sent_before or sent > 1):
                return _Conflict(exc)
            current = self._reread(translate, stage="re-read")
            if current is not None and current.data == data:
                # Our own bytes: an earlier attempt of this write, reported as not
                # landed, was applied late (a PUT the service finished after its
                # answer was lost and the re-read); this one lost to it.
                return _Landed(current.etag)
            return _Conflict(exc, current)
        except AmbiguousWriteError as exc:
            current = self._reread(translate, stage="re-read after an unanswered write")
            if current is not None and current.data == data:
                return _Landed(current.etag)  # our write landed after all
            if (current.etag if current is not None else None) == etag:
                return _NotLanded(exc)
            return _Conflict(exc, current)
        except OperatorError:
            raise
        except StoreError as exc:
            raise translate("write", exc) from exc

    def _update_locked(self, transition: Transition, *, what: str) -> StateDocument:
        if self.lost:
            raise LostLeaseError(
                f"{what} refused: the lease was already lost",
                poller=self.document.poller_name,
                fencing_token=self.token,
            )
        doc, etag = self.document, self.etag

        def translate(stage: str, exc: StoreError) -> DbTriggerError:
            if stage == "write":
                return CommitError(
                    f"{what} failed: {exc}", poller=doc.poller_name, fencing_token=self.token
                )
            if stage == "re-read":
                return CommitError(
                    f"could not re-read state after a conflicting write: {exc}",
                    poller=doc.poller_name,
                    fencing_token=self.token,
                )
            # The write got no answer and the store stayed down: nobody knows.
            return AmbiguousCommitError(
                f"{what}: the store did not answer the write and could not be read back "
                f"({exc}); it may or may not have landed. The next tick re-reads the state "
                "and carries on from whatever is there (worst case: the batch is delivered "
                "again)",
                poller=doc.poller_name,
                fencing_token=self.token,
            )

        last_error: BaseException | None = None
        for _ in range(MAX_CAS_ROUNDS):
            try:
                new_doc = transition(doc)
            except LostLeaseError:
                self.lost = True
                raise
            outcome = self._cas(
                docmod.dumps(new_doc), etag, "state write", translate, resolve_conflict=True
            )
            if isinstance(outcome, _Landed):
                return self._landed(new_doc, outcome.etag)
            last_error = outcome.cause
            if isinstance(outcome, _NotLanded):
                continue  # nothing changed: the same transition, written again
            if outcome.current is None:
                self.lost = True
                raise LostLeaseError(
                    f"{what} refused: the state document was deleted",
                    poller=doc.poller_name,
                    fencing_token=self.token,
                ) from outcome.cause
            doc = load_state(self.store, self.key, outcome.current)
            etag = outcome.current.etag
        raise CommitError(
            f"{what} failed: the state document kept changing under us",
            poller=doc.poller_name,
            fencing_token=self.token,
        ) from last_error

    def _reread(self, translate: _Translate, *, stage: str) -> StoredDocument | None:
        def read() -> StoredDocument | None:
            return self.store.read(self.key)

        try:
            return self.retry.call(
                read,
                operation="state re-read",
                kinds=(StoreUnavailableError,),
                on_retry=self.on_retry,
                fields={"poller": self.key, "fencing_token": self.token},
            )
        except OperatorError:
            raise
        except StoreError as exc:
            raise translate(stage, exc) from exc
