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
the etag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    CommitError,
    LostLeaseError,
    StoreError,
)
from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore

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
        self._lock = threading.Lock()

    def update(self, transition: Transition, *, what: str) -> StateDocument:
        """Apply ``transition`` and CAS-write it; returns the written document.

        Raises:
            LostLeaseError: the lease is no longer ours (the transition said so).
            CommitError: the store kept failing; the outcome is not applied.
        """
        with self._lock:
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
                    self.etag = self.store.write(self.key, data, if_match=etag)
                    self.document = new_doc
                    return new_doc
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
                        self.etag = current[1]
                        self.document = new_doc
                        return new_doc
                    doc, etag = docmod.loads(current[0]), current[1]
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
        try:
            stored = self.store.read(self.key)
        except StoreError as exc:
            raise CommitError(
                f"could not re-read state after a conflicting write: {exc}",
                poller=self.document.poller_name,
                fencing_token=self.token,
            ) from exc
        if stored is None:
            return None
        return stored.data, stored.etag
