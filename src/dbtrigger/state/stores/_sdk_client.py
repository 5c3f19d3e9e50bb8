"""The SDK client an Azure store holds, built now or at its first use (internal).

The blob and the table store are given a client, build one from a literal
connection string or endpoint at once, or build it from app settings when
first used (:class:`~dbtrigger.settings.Deferred`): in a Function App a
missing setting then fails the functions using the store, not the indexing of
the whole app. What follows from that is the same for both stores and lives
here: getting the client, naming where it comes from before it could be built,
and closing it only if it was.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from dbtrigger import _azure_errors as azure_errors
from dbtrigger.settings import Deferred, peek, resolve


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


class SdkClientHolder(Generic[C]):
    """Base of a store whose SDK client may be built at its first use."""

    _client_source: C | Deferred[C]

    @property
    def _client(self) -> C:
        """The client, built now if it comes from app settings not read yet.

        Raises:
            ConfigurationError: an app setting it needs is missing or malformed.
        """
        return resolve(self._client_source)

    def _unresolved(self) -> str:
        """Where the client comes from, in words and without a secret, for a
        description made while its app settings cannot be read."""
        return str(getattr(self._client_source, "what", "app settings"))

    def credential_words(self) -> str:
        """The credential as a refusal names it (see ``_azure_errors.credential_words``):
        the app setting the client is read from and its SAS's validity. Public so a
        history kept beside the store names the same credential."""
        what = getattr(self._client_source, "what", None)
        return azure_errors.credential_words(peek(self._client_source), what)

    def close(self) -> None:
        """Close the client, if it was built (one never built holds nothing open)."""
        client = peek(self._client_source)
        if client is not None:
            client.close()


__all__ = ["SdkClientHolder"]
