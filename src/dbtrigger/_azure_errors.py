"""Azure Storage failures as dbtrigger errors: one mapper for Blob, Table and Queue.

The three services fail the same ways, and a caller must act the same way on
each, so they are sorted once, here, most specific first:

* a refused credential (401/403, or azure-identity's
  ``ClientAuthenticationError``): :class:`~dbtrigger.errors.StoreAuthError`,
  naming the data role the identity needs;
* a missing container, table or queue the caller names (``missing``):
  :class:`~dbtrigger.errors.StoreUnavailableError` with its fix;
* on a write, 409/412 with a code that means "the precondition lost a race"
  (or no code): :class:`~dbtrigger.errors.CasConflictError` (another instance
  won); any other 409/412 code (someone's lease on the blob, an immutability
  policy, a table being deleted) no retry will pass:
  :class:`~dbtrigger.errors.StoreRefusedError`. A write that finds its
  target gone (404) lost the race too;
* nothing was sent (``ServiceRequestError``): unavailable, certainly not applied;
* sent, but no complete answer (``ServiceResponseError``, a response without
  a status): on a write :class:`~dbtrigger.errors.AmbiguousWriteError` (it may
  have landed; the runtime re-reads to find out), on a read unavailable;
* **the one ambiguous-5xx policy**: a write answered with a 5xx other than
  503 may have been applied (500 ``OperationTimedOut``, 502, 504...):
  ambiguous. 503 (server busy) and 429 (throttled) were not processed, and
  every 5xx of a read leaves nothing changed: unavailable, retried;
* anything else: :class:`~dbtrigger.errors.StoreError`.

Messages carry the operation, the HTTP status and the storage error code;
where there is no status, the exception's first line, redacted (SDK messages
can echo request URLs, and with SAS authentication those carry a signature).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ServiceRequestError,
    ServiceResponseError,
)

from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    StoreAuthError,
    StoreError,
    StoreRefusedError,
    StoreUnavailableError,
)
from dbtrigger.redaction import redact

_CODE_IN_TEXT = re.compile(r'"code"\s*:\s*"(\w+)"|ErrorCode:(\w+)')


@dataclass(frozen=True)
class StorageService:
    """What differs between the storage services: their words, not their policy."""

    #: What a write writes ("blob", "entity", "message").
    what: str
    #: The data role an Entra ID identity needs for dbtrigger's use of it.
    role: str
    #: 409/412 codes that mean the precondition lost a race.
    lost_race_codes: frozenset[str] = frozenset()
    #: Other 409/412 codes: what to do about each.
    refusal_hints: Mapping[str, str] = field(default_factory=dict)


_LEASED = "the state blob is leased by someone else; break that lease"

BLOB = StorageService(
    what="blob",
    role="Storage Blob Data Contributor",
    lost_race_codes=frozenset({"ConditionNotMet", "BlobAlreadyExists", "TargetConditionNotMet"}),
    refusal_hints={
        "LeaseIdMissing": "the state blob has an active blob lease held by someone else; "
        "break it (az storage blob lease break) or find who took it",
        "LeaseIdMismatchWithBlobOperation": _LEASED,
        "LeaseIdMismatchWithLeaseOperation": _LEASED,
        "LeaseLost": _LEASED,
        "LeaseNotPresentWithBlobOperation": "the blob lease state changed; break any lease on it",
        "BlobImmutableDueToPolicy": "an immutability (WORM) policy or legal hold protects the "
        "state blob; use a container without one",
        "BlobArchived": "the state blob is in the archive tier; rehydrate it or restore a backup",
        "BlobBeingRehydrated": "the state blob is being rehydrated from the archive tier",
        "ContainerBeingDeleted": "the container is being deleted",
        "ContainerDisabled": "the container is disabled",
        "OperationNotAllowedOnIncrementalCopyBlob": "the state blob is an incremental copy",
        "SnapshotsPresent": "the state blob has snapshots; delete them first",
    },
)

TABLE = StorageService(
    what="entity",
    role="Storage Table Data Contributor",
    lost_race_codes=frozenset(
        {"EntityAlreadyExists", "UpdateConditionNotSatisfied", "ConditionNotMet"}
    ),
)

QUEUE = StorageService(what="message", role="Storage Queue Data Message Sender")


def error_code(exc: BaseException) -> str | None:
    """The service's error code (``ConditionNotMet``, ``TableNotFound``...), or None."""
    code = getattr(exc, "error_code", None)
    if code:
        return str(getattr(code, "value", code))
    # Some SDK paths raise before parsing the body; the code is still in the text.
    found = _CODE_IN_TEXT.search(str(exc))
    return (found.group(1) or found.group(2)) if found else None


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def short(exc: BaseException) -> str:
    """One line naming an SDK error, with anything that looks like a credential removed."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return redact(f"{type(exc).__name__}: {first}")[:300]


#: How a refusal names the credential when nothing more is known of it.
CREDENTIAL = "the credential (key, SAS or identity)"


def sas_validity(url: str, now: dt.datetime) -> str:
    """What the SAS in ``url``'s query says of its own validity at ``now``: when it
    expired (``se``) or when it starts (``st``, a clock behind), as words ending in
    ``"; "``, or ``""``. Only those two fields are read; the signature never is."""
    query = parse_qs(urlsplit(url).query)
    notes = []
    for field_name, passed, words in (
        ("se", True, "the SAS expired at {}: issue a new one"),
        ("st", False, "the SAS is valid only from {} (is this machine's clock behind?)"),
    ):
        text = (query.get(field_name) or [""])[0]
        try:
            when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            continue
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        if (now >= when) == passed:
            notes.append(words.format(text) + "; ")
    return "".join(notes)


def credential_words(client: Any, what: str | None) -> str:
    """The credential of ``client`` as a refusal names it: the app setting it was
    read from (``what``, when known) and what its SAS says of its validity now;
    never a secret. In a Function App with several storage settings, "check the
    credential" alone leaves a person guessing which one ran out."""
    words = CREDENTIAL + (f" in {what}" if what else "")
    now = dt.datetime.now(dt.timezone.utc)
    # Blob and queue clients keep a SAS in their URL, Table clients as an AzureSasCredential.
    sas = str(getattr(getattr(client, "credential", None), "signature", "") or "")
    url = str(getattr(client, "url", "") or "")
    return (sas_validity(url, now) or sas_validity(f"?{sas}", now)) + words


def _detail(exc: BaseException, status: int | None, code: str | None) -> str:
    if status is None:
        return short(exc)
    return f"HTTP {status} {code}" if code else f"HTTP {status}"


def translate(
    exc: AzureError,
    *,
    service: StorageService,
    where: str,
    write: bool,
    missing: Mapping[str, str] | None = None,
    credential: str = CREDENTIAL,
) -> StoreError:
    """The store error for ``exc``, raised while ``where`` (see the module docstring).

    ``write``: the request changes something (a write, a delete, a send), so
    an answer that went missing is ambiguous. ``missing``: error codes of a
    container (table, queue) that does not exist, and what to say about each.
    ``credential``: the words a refusal names the credential with (the app
    setting it comes from, its SAS expired...).
    """
    status, code = status_of(exc), error_code(exc)
    detail = _detail(exc, status, code)
    fields: dict[str, Any] = {"status": status, "error_code": code}
    if isinstance(exc, ClientAuthenticationError) or status in (401, 403):
        return StoreAuthError(
            f"{where} was refused ({detail}): check {credential}, "
            f"and that an identity has the '{service.role}' role",
            **fields,
        )
    if missing and code is not None and code in missing:
        return StoreUnavailableError(f"{where} failed: {missing[code]}", **fields)
    race = status in (409, 412) or isinstance(exc, (ResourceExistsError, ResourceModifiedError))
    if write and race:
        if code is None or code in service.lost_race_codes:
            lost = (
                f"the {service.what} already exists (create-only write)"
                if status == 409 or isinstance(exc, ResourceExistsError)
                else f"the {service.what} changed since it was read (etag mismatch)"
            )
            return CasConflictError(
                f"{where} lost the compare-and-swap ({detail}): {lost}", **fields
            )
        hint = service.refusal_hints.get(code, "see the storage error code")
        return StoreRefusedError(
            f"{where} was refused ({detail}), and not because another instance wrote first: {hint}",
            **fields,
        )
    if write and status == 404:
        return CasConflictError(
            f"{where} lost the compare-and-swap ({detail}): the {service.what} to update no "
            "longer exists",
            **fields,
        )
    if isinstance(exc, ServiceRequestError):
        # azure-core: the request was never sent, so nothing was changed.
        return StoreUnavailableError(
            f"{where} failed: the storage endpoint is unreachable ({detail})", **fields
        )
    if isinstance(exc, ServiceResponseError) or (
        isinstance(exc, HttpResponseError) and status is None
    ):
        if write:
            return AmbiguousWriteError(
                f"{where}: the request was sent but no complete answer came back ({detail}); "
                "it may or may not have been applied",
                **fields,
            )
        return StoreUnavailableError(f"{where} got no answer ({detail})", **fields)
    if status is not None and status >= 500 and status != 503 and write:
        return AmbiguousWriteError(
            f"{where} failed on the server ({detail}); it may or may not have been applied",
            **fields,
        )
    if status is not None and (status >= 500 or status == 429):
        return StoreUnavailableError(
            f"{where} failed: storage is busy or unavailable ({detail})", **fields
        )
    return StoreError(f"{where} failed ({detail})", **fields)


@contextlib.contextmanager
def mapped(
    service: StorageService,
    where: str,
    *,
    write: bool = False,
    missing: Mapping[str, str] | None = None,
    credential: Callable[[], str] | None = None,
) -> Iterator[None]:
    """Raise an Azure SDK failure inside the block as :func:`translate` sorts it, cause
    chained; ``credential`` (called only on a failure) gives its words for the credential."""
    try:
        yield
    except AzureError as exc:
        words = credential() if credential is not None else CREDENTIAL
        raise translate(
            exc, service=service, where=where, write=write, missing=missing, credential=words
        ) from exc


__all__ = [
    "BLOB",
    "CREDENTIAL",
    "QUEUE",
    "TABLE",
    "StorageService",
    "credential_words",
    "error_code",
    "mapped",
    "sas_validity",
    "short",
    "status_of",
    "translate",
]
