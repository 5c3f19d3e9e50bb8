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

import datetime as dt
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

    def _credential(self) -> str:
        """The credential as a refusal names it: the app setting it was read from
        (a store built from one) and what its SAS says of its validity now; never
        a secret. In a Function App with several storage settings, "check the
        credential" alone leaves a person guessing which one ran out."""
        words = azure_errors.CREDENTIAL
        what = getattr(self._client_source, "what", None)
        if what:
            words += f" in {what}"
        client = peek(self._client_source)
        now = dt.datetime.now(dt.timezone.utc)
        # Blob clients keep a SAS in their URL, Table clients as an AzureSasCredential.
        sas = str(getattr(getattr(client, "credential", None), "signature", "") or "")
        url = str(getattr(client, "url", "") or "")
        notes = azure_errors.sas_validity(url, now) or azure_errors.sas_validity(f"?{sas}", now)
        return notes + words

    def close(self) -> None:
        """Close the client, if it was built (one never built holds nothing open)."""
        client = peek(self._client_source)
        if client is not None:
            client.close()


__all__ = ["SdkClientHolder"]
