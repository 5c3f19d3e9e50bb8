"""The history beside a Blob or Table store, and the partition queue, name a refused
credential as the state stores do: the app setting it was read from and when its
SAS expired. They said only "check the credential", so a SAS that ran out on the
history (or the queue) of a Function App with several storage settings left a
person guessing which setting to renew. Against Azurite, which checks SAS expiry.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import pytest
from azure.core.credentials import AzureNamedKeyCredential
from azure.data.tables import TableSasPermissions, TableServiceClient, generate_table_sas
from azure.storage.queue import AccountSasPermissions, ResourceTypes, generate_account_sas

from dbtrigger.azure.partitions import storage_queue
from dbtrigger.errors import StoreAuthError
from dbtrigger.history.derive import history_for
from dbtrigger.state.stores import BlobCheckpointStore, TableCheckpointStore
from tests.azurite import ACCOUNT, KEY, Azurite
from tests.test_blob_credentials import _sas
from tests.test_blob_store import new_container

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
EXPIRED = NOW - dt.timedelta(hours=1)


@pytest.fixture
def container(azurite: Azurite) -> Iterator[str]:
    yield from new_container(azurite)


def _says_setting_and_expiry(error: StoreAuthError, setting: str, signature: str) -> None:
    text = str(error)
    assert f"app setting '{setting}'" in text
    assert f"the SAS expired at {EXPIRED:%Y-%m-%dT%H:%M:%SZ}" in text
    assert signature not in text
    assert signature not in repr(error)


def test_the_blob_history_names_the_setting_and_expiry_of_its_sas(
    azurite: Azurite, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sas = _sas(container, start=NOW - dt.timedelta(hours=3), expiry=EXPIRED)
    monkeypatch.setenv(
        "STATE_CONN", f"BlobEndpoint={azurite.blob_endpoint};SharedAccessSignature={sas}"
    )
    store = BlobCheckpointStore.from_connection_string(
        "STATE_CONN", app_name="app", container=container
    )
    history = history_for(store)
    assert history is not None
    signature = sas.split("sig=")[1].split("&")[0]
    for op in (
        lambda: history.tail("p", 5),
        lambda: history.append("p", [{"seq": 1, "at": NOW.isoformat()}], after_seq=0),
    ):
        with pytest.raises(StoreAuthError) as caught:
            op()
        _says_setting_and_expiry(caught.value, "STATE_CONN", signature)


def test_the_table_history_names_the_setting_and_expiry_of_its_sas(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = f"t{uuid.uuid4().hex[:20]}"
    with TableServiceClient.from_connection_string(azurite.connection_string) as service:
        service.create_table(table)
    sas = generate_table_sas(
        AzureNamedKeyCredential(ACCOUNT, KEY),
        table,
        permission=TableSasPermissions(read=True, add=True, update=True, delete=True),
        start=NOW - dt.timedelta(hours=3),
        expiry=EXPIRED,
    )
    monkeypatch.setenv(
        "TABLE_SAS", f"TableEndpoint={azurite.table_endpoint};SharedAccessSignature={sas}"
    )
    store = TableCheckpointStore(connection_setting="TABLE_SAS", app_name="app", table=table)
    history = history_for(store)
    assert history is not None
    with pytest.raises(StoreAuthError) as caught:
        history.tail("p", 5)
    _says_setting_and_expiry(caught.value, "TABLE_SAS", sas.split("sig=")[1].split("&")[0])


def test_the_partition_queue_names_the_setting_and_expiry_of_its_sas(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    sas = generate_account_sas(
        ACCOUNT,
        KEY,
        ResourceTypes(service=True, container=True, object=True),
        AccountSasPermissions(read=True, write=True, add=True, create=True, process=True),
        start=NOW - dt.timedelta(hours=3),
        expiry=EXPIRED,
    )
    queue_endpoint = f"http://127.0.0.1:{azurite.queue_port}/{ACCOUNT}"
    monkeypatch.setenv("QUEUE_SAS", f"QueueEndpoint={queue_endpoint};SharedAccessSignature={sas}")
    send = storage_queue("QUEUE_SAS", f"q{uuid.uuid4().hex[:20]}")
    with pytest.raises(StoreAuthError) as caught:
        send("{}")
    _says_setting_and_expiry(caught.value, "QUEUE_SAS", sas.split("sig=")[1].split("&")[0])
