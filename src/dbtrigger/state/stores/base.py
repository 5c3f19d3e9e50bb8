"""The ``CheckpointStore`` port: read with an etag, write only if it still matches.

A store holds opaque bytes (the serialised state document) under a key (the
poller name). It must offer exactly two guarantees, and every adapter is held
to them by one shared contract test suite:

* ``read`` returns the bytes together with an etag that changes on *every*
  successful write, even one that writes identical bytes.
* ``write(if_match=etag)`` succeeds only if the stored etag still equals
  ``etag``; ``write(if_match=None)`` succeeds only if nothing is stored yet.
  Of any number of concurrent writers presenting the same etag, exactly one
  wins; the others get :class:`~dbtrigger.errors.CasConflictError`.

Adapters translate their SDK's failures at the edge: a lost precondition is
``CasConflictError``, a write that timed out after it may have landed is
``AmbiguousWriteError``, an unreachable service ``StoreUnavailableError``,
rejected credentials ``StoreAuthError``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from dbtrigger.errors import CasConflictError, UnsupportedDocumentError


class StoredDocument(NamedTuple):
    data: bytes
    etag: str


def check_match(current: StoredDocument | None, if_match: str | None, what: str) -> None:
    """The compare-and-swap rule, for a store that compares etags itself (the memory
    and the file store): ``if_match=None`` only where nothing is stored, an etag
    only while ``current`` still carries it.

    Raises:
        CasConflictError: the rule does not hold; the message names ``what``.
    """
    if if_match is None:
        if current is not None:
            raise CasConflictError(f"{what} already exists (create-only write)")
    elif current is None or current.etag != if_match:
        raise CasConflictError(f"{what} changed since it was read (etag mismatch)")


def document_text(key: str, data: bytes, store: str) -> str:
    """``data`` as the text a store that keeps documents in text columns or
    properties (the SQL and the table store) writes.

    Raises:
        UnsupportedDocumentError: ``data`` is not UTF-8, so it cannot be kept as text.
    """
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise UnsupportedDocumentError(
            f"document for {key!r} is not UTF-8 text; the {store} store keeps documents as text"
        ) from None


@runtime_checkable
class CheckpointStore(Protocol):
    def read(self, key: str) -> StoredDocument | None:
        """The stored bytes and their etag, or None when nothing is stored."""
        ...

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        """Store ``data`` if the etag still matches (None: only if absent); return the new etag."""
        ...

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Remove the document (if the etag matches, when one is given). Absent is fine."""
        ...

    def list_keys(self) -> list[str]:
        """All keys that hold a document, sorted."""
        ...

    def describe(self) -> str:
        """Where the documents live, for logs and the CLI; never contains a secret."""
        ...
