"""A held lease: the document we last wrote, its etag, and CAS updates on it.

Every write during a tick (commit, heartbeat, failure record, release) goes
through :meth:`LeaseSession.update`, which applies a *pure* transition to the
document and writes it with the etag we hold. When the write loses (someone
else wrote) or its outcome is unknown (timeout), the session re-reads and
applies the same transition to what is there now: if the lease is still ours
the update goes through on the fresh etag, if not the transition itself raises
``LostLeaseError``. That makes an ambiguous write safe to retry: we recognise
our own landed write by its bytes.

A lock serialises updates so a heartbeat thread and the tick never race on
the etag. A store that is briefly unreachable (nothing was written) is retried
under the tick's :class:`~dbtrigger.runtime.retry.RetryPolicy`; credentials the
store refuses are an operator error and propagate unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    CommitError,
    LostLeaseError,
    OperatorError,
    StoreError,
    StoreUnavailableError,
)
from dbtrigger.runtime.retry import RetryHook, RetryPolicy
from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument

Transition = Callable[[StateDocument], StateDocument]

#: Re-read-and-reapply rounds before a CAS update gives up.
MAX_CAS_ROUNDS = 4


class LeaseSession:
    def __init__(
        self,
        store: CheckpointStore,
        key: str,
        document: StateDocument,
        etag: str,
        *,
        owner: str,
        token: int,
        retry: RetryPolicy | None = None,
        on_retry: RetryHook | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.document = document
        self.etag = etag
        self.owner = owner
        self.token = token
        self.released = False
        self.lost = False
        self.writes = 0
        self.retry = retry or RetryPolicy.none()
        self.on_retry = on_retry
        self._last_write = time.monotonic()
        self._lock = threading.Lock()

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
            return self._update_locked(transition, what=what)

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

    def _write(self, data: bytes, etag: str) -> str:
        return self.retry.call(
            lambda: self.store.write(self.key, data, if_match=etag),
            operation="state write",
            kinds=(StoreUnavailableError,),
            on_retry=self.on_retry,
            fields={"poller": self.key, "fencing_token": self.token},
        )

    def _update_locked(self, transition: Transition, *, what: str) -> StateDocument:
        if self.lost:
            raise LostLeaseError(
                f"{what} refused: the lease was already lost",
                poller=self.document.poller_name,
                fencing_token=self.token,
            )
        doc, etag = self.document, self.etag
        last_error: BaseException | None = None
        for _ in range(MAX_CAS_ROUNDS):
            try:
                new_doc = transition(doc)
            except LostLeaseError:
                self.lost = True
                raise
            data = docmod.dumps(new_doc)
            try:
                self.writes += 1
                return self._landed(new_doc, self._write(data, etag))
            except (CasConflictError, AmbiguousWriteError) as exc:
                last_error = exc
                current = self._reread()
                if current is None:
                    self.lost = True
                    raise LostLeaseError(
                        f"{what} refused: the state document was deleted",
                        poller=doc.poller_name,
                        fencing_token=self.token,
                    ) from exc
                if isinstance(exc, AmbiguousWriteError) and current[0] == data:
                    # Our write landed after all.
                    return self._landed(new_doc, current[1])
                doc, etag = docmod.loads(current[0]), current[1]
            except OperatorError:
                raise
            except StoreError as exc:
                raise CommitError(
                    f"{what} failed: {exc}",
                    poller=doc.poller_name,
                    fencing_token=self.token,
                ) from exc
        raise CommitError(
            f"{what} failed: the state document kept changing under us",
            poller=doc.poller_name,
            fencing_token=self.token,
        ) from last_error

    def _reread(self) -> tuple[bytes, str] | None:
        def read() -> StoredDocument | None:
            return self.store.read(self.key)

        try:
            stored = self.retry.call(
                read,
                operation="state re-read",
                kinds=(StoreUnavailableError,),
                on_retry=self.on_retry,
                fields={"poller": self.key, "fencing_token": self.token},
            )
        except OperatorError:
            raise
        except StoreError as exc:
            raise CommitError(
                f"could not re-read state after a conflicting write: {exc}",
                poller=self.document.poller_name,
                fencing_token=self.token,
            ) from exc
        if stored is None:
            return None
        return stored.data, stored.etag
