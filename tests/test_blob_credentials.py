"""A refused credential names where it came from: the app setting, and a SAS that expired.

In a Function App with several storage settings, "check the credential" leaves
a person guessing which one; a SAS that simply ran out (the commonest refusal
of a working deployment) looks exactly like a wrong key. The refusal says which
app setting holds the credential and when its SAS expired (its ``se`` field, no
secret), never the signature itself. Against Azurite, which checks SAS expiry.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import pytest
from azure.core.credentials import AzureNamedKeyCredential
from azure.data.tables import TableSasPermissions, TableServiceClient, generate_table_sas
from azure.storage.blob import ContainerSasPermissions, generate_container_sas

from dbtrigger.errors import StoreAuthError
from dbtrigger.state.stores import BlobCheckpointStore, TableCheckpointStore
from tests.azurite import ACCOUNT, KEY, Azurite
from tests.test_blob_store import new_container

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


@pytest.fixture
def container(azurite: Azurite) -> Iterator[str]:
    yield from new_container(azurite)


def _sas(container: str, *, start: dt.datetime, expiry: dt.datetime) -> str:
    rights = ContainerSasPermissions(read=True, write=True, delete=True, list=True)
    return generate_container_sas(
        ACCOUNT, container, account_key=KEY, permission=rights, start=start, expiry=expiry
    )


def _refusals(store: BlobCheckpointStore) -> list[StoreAuthError]:
    errors = []
    for op in (lambda: store.read("p"), lambda: store.write("p", b"{}", if_match=None)):
        with pytest.raises(StoreAuthError) as caught:
            op()
        errors.append(caught.value)
    return errors


def test_an_expired_sas_is_named_with_its_setting_and_expiry(
    azurite: Azurite, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expired = NOW - dt.timedelta(hours=1)
    sas = _sas(container, start=NOW - dt.timedelta(hours=3), expiry=expired)
    monkeypatch.setenv(
        "STATE_CONN", f"BlobEndpoint={azurite.blob_endpoint};SharedAccessSignature={sas}"
    )
    store = BlobCheckpointStore.from_connection_string(
        "STATE_CONN", app_name="app", container=container
    )
    signature = sas.split("sig=")[1].split("&")[0]
    for error in _refusals(store):
        text = str(error)
        assert "app setting 'STATE_CONN'" in text
        assert f"the SAS expired at {expired:%Y-%m-%dT%H:%M:%SZ}" in text
        assert signature not in text
        assert signature not in repr(error)


def test_a_sas_not_valid_yet_says_so_and_a_wrong_key_names_its_setting(
    azurite: Azurite, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    later = NOW + dt.timedelta(hours=1)
    sas = _sas(container, start=later, expiry=later + dt.timedelta(hours=1))
    monkeypatch.setenv(
        "STATE_CONN", f"BlobEndpoint={azurite.blob_endpoint};SharedAccessSignature={sas}"
    )
    store = BlobCheckpointStore.from_connection_string(
        "%STATE_CONN%", app_name="app", container=container
    )
    for error in _refusals(store):
        assert f"the SAS is valid only from {later:%Y-%m-%dT%H:%M:%SZ}" in str(error)
        assert "STATE_CONN" in str(error)
    wrong = azurite.connection_string.replace(KEY, KEY[::-1])
    monkeypatch.setenv("KEYED_CONN", wrong)
    keyed = BlobCheckpointStore.from_connection_string(
        "KEYED_CONN", app_name="app", container=container
    )
    for error in _refusals(keyed):
        assert "app setting 'KEYED_CONN'" in str(error)
        assert KEY[::-1] not in str(error)


def test_the_table_store_names_the_setting_of_a_refused_key(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TABLE_CONN", azurite.connection_string.replace(KEY, KEY[::-1]))
    store = TableCheckpointStore(connection_setting="TABLE_CONN", app_name="app")
    with pytest.raises(StoreAuthError, match="app setting 'TABLE_CONN'"):
        store.read("p")


def test_the_table_store_names_an_expired_sas(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = f"t{uuid.uuid4().hex[:20]}"
    with TableServiceClient.from_connection_string(azurite.connection_string) as service:
        service.create_table(table)
    expired = NOW - dt.timedelta(hours=1)
    sas = generate_table_sas(
        AzureNamedKeyCredential(ACCOUNT, KEY),
        table,
        permission=TableSasPermissions(read=True, add=True, update=True, delete=True),
        start=NOW - dt.timedelta(hours=3),
        expiry=expired,
    )
    conn = f"TableEndpoint={azurite.table_endpoint};SharedAccessSignature={sas}"
    monkeypatch.setenv("TABLE_SAS", conn)
    store = TableCheckpointStore(connection_setting="TABLE_SAS", app_name="app", table=table)
    with pytest.raises(StoreAuthError) as caught:
        store.read("p")
    assert f"the SAS expired at {expired:%Y-%m-%dT%H:%M:%SZ}" in str(caught.value)
    assert "app setting 'TABLE_SAS'" in str(caught.value)
