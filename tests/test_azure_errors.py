"""One Azure error mapper for Blob, Table and Queue: the same failure, the same error.

Table-tested with the SDK's own exception types (no service needed), then at
the edges that use it: the Table store's translation and the Storage Queue
sender of partitioned Functions.
"""

from __future__ import annotations

import pytest
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)

from dbtrigger import _azure_errors as azure_errors
from dbtrigger.azure.partitions import storage_queue
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    StoreAuthError,
    StoreError,
    StoreRefusedError,
    StoreUnavailableError,
)
from dbtrigger.state.stores.table import TableCheckpointStore
from tests.azurite import KEY, Azurite

SERVICES = [azure_errors.BLOB, azure_errors.TABLE, azure_errors.QUEUE]


def http_error(
    status: int, code: str | None = None, cls: type[HttpResponseError] = HttpResponseError
) -> HttpResponseError:
    exc = cls(message=f"{status} {code}")
    exc.status_code = status
    exc.error_code = code
    return exc


# (exception, on a write, the error) - the same for every service.
POLICY = [
    (http_error(500, "OperationTimedOut"), True, AmbiguousWriteError),
    (http_error(502), True, AmbiguousWriteError),
    (http_error(504), True, AmbiguousWriteError),
    (http_error(503, "ServerBusy"), True, StoreUnavailableError),
    (http_error(429), True, StoreUnavailableError),
    (http_error(500, "InternalError"), False, StoreUnavailableError),
    (http_error(502), False, StoreUnavailableError),
    (http_error(401), False, StoreAuthError),
    (http_error(403, "AuthorizationPermissionMismatch"), True, StoreAuthError),
    (ClientAuthenticationError("no token"), False, StoreAuthError),
    (ServiceRequestError("connection refused"), True, StoreUnavailableError),
    (ServiceResponseError("connection reset"), True, AmbiguousWriteError),
    (ServiceResponseError("connection reset"), False, StoreUnavailableError),
    (http_error(412), True, CasConflictError),
    (http_error(409), True, CasConflictError),
    (http_error(404, cls=ResourceNotFoundError), True, CasConflictError),
    (http_error(400, "InvalidHeaderValue"), True, StoreError),
]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.what)
@pytest.mark.parametrize(("exc", "write", "expected"), POLICY)
def test_one_policy_for_every_storage_service(
    service: azure_errors.StorageService,
    exc: Exception,
    write: bool,
    expected: type[Exception],
) -> None:
    translated = azure_errors.translate(exc, service=service, where="op", write=write)  # type: ignore[arg-type]
    assert type(translated) is expected


@pytest.mark.parametrize(
    ("service", "exc", "expected"),
    [
        (azure_errors.BLOB, http_error(412, "ConditionNotMet"), CasConflictError),
        (azure_errors.BLOB, http_error(409, "BlobAlreadyExists"), CasConflictError),
        (azure_errors.BLOB, http_error(412, "LeaseIdMissing"), StoreRefusedError),
        (
            azure_errors.TABLE,
            http_error(409, "EntityAlreadyExists", ResourceExistsError),
            CasConflictError,
        ),
        (
            azure_errors.TABLE,
            http_error(412, "UpdateConditionNotSatisfied", ResourceModifiedError),
            CasConflictError,
        ),
        (
            azure_errors.TABLE,
            http_error(409, "TableBeingDeleted", ResourceExistsError),
            StoreRefusedError,
        ),
    ],
)
def test_each_service_names_its_own_lost_races(
    service: azure_errors.StorageService, exc: HttpResponseError, expected: type[Exception]
) -> None:
    translated = azure_errors.translate(exc, service=service, where="write of p", write=True)
    assert type(translated) is expected


def test_missing_container_says_what_to_do() -> None:
    exc = http_error(404, "ContainerNotFound", ResourceNotFoundError)
    translated = azure_errors.translate(
        exc,
        service=azure_errors.BLOB,
        where="read of blob c/p",
        write=False,
        missing={"ContainerNotFound": "container 'c' does not exist; create it"},
    )
    assert type(translated) is StoreUnavailableError
    assert "does not exist; create it" in str(translated)


def test_auth_errors_name_the_role_and_never_the_sdk_text() -> None:
    exc = http_error(403, "AuthorizationFailure")
    exc.message = "https://acct.blob.core.windows.net/c/p?sv=2020&sig=SECRETSIG"
    for service in SERVICES:
        translated = azure_errors.translate(exc, service=service, where="op", write=False)
        assert service.role in str(translated)
        assert "SECRETSIG" not in str(translated)


def test_a_table_write_answered_502_may_have_landed() -> None:
    """The Table store called only 500 and 504 ambiguous: a 502 write was reported as
    certainly not applied, so a retried write could fail its own precondition."""
    store = TableCheckpointStore(
        connection_string=(
            "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            "AccountKey=a2V5;TableEndpoint=http://127.0.0.1:1/devstoreaccount1;"
        ),
        create_table=False,
    )
    for status in (501, 502, 505):
        translated = store._translate(
            "write of 'p'", "p", http_error(status), write=True, if_match='W/"x"'
        )
        assert type(translated) is AmbiguousWriteError
    store.close()


@pytest.mark.azurite
def test_a_queue_send_refused_is_a_store_error(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's Storage Queue sender raised the SDK's own exceptions."""
    wrong_key = "V3JvbmdLZXlXcm9uZ0tleQ=="
    monkeypatch.setenv(
        "DBT_TEST_QUEUE_CONNECTION", azurite.connection_string.replace(KEY, wrong_key)
    )
    send = storage_queue("DBT_TEST_QUEUE_CONNECTION", "work")
    with pytest.raises(StoreAuthError, match="queue work") as err:
        send('{"partition": "0"}')
    assert "Storage Queue Data" in str(err.value)
    assert wrong_key not in str(err.value)
