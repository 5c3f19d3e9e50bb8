"""One checkpoint store of each kind for a test, opened and removed again: the
stores the store-wide tests run on (tests/test_contract_every_store.py,
tests/test_fast_takeover.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.data.tables import TableClient
from azure.storage.blob import BlobServiceClient

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore
from dbtrigger.state.stores import BlobCheckpointStore, SqlCheckpointStore, TableCheckpointStore
from dbtrigger.state.stores.base import CheckpointStore
from tests.azurite import Azurite
from tests.databases import make_database


def open_store(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[CheckpointStore]:
    """``memory``, ``file``, ``sql-<database>``, ``blob`` or ``table``: yields the
    store and removes what it made once the test is done."""
    if kind == "memory":
        yield InMemoryCheckpointStore()
    elif kind == "file":
        yield FileCheckpointStore(tmp_path / "state")
    elif kind.startswith("sql-"):
        (tmp_path / "state-db").mkdir()
        for db in make_database(kind.removeprefix("sql-"), tmp_path / "state-db"):
            sql = SqlCheckpointStore(url=db.url, schema=db.schema)
            try:
                yield sql
            finally:
                sql.close()
    else:
        azurite: Azurite = request.getfixturevalue("azurite")
        yield from (blob_store(azurite) if kind == "blob" else table_store(azurite))


def blob_store(azurite: Azurite, app_name: str = "app") -> Iterator[BlobCheckpointStore]:
    container = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    store = BlobCheckpointStore.from_connection_string(
        azurite.connection_string, app_name=app_name, container=container
    )
    try:
        yield store
    finally:
        store.close()
        service.delete_container(container)
        service.close()


def table_store(azurite: Azurite) -> Iterator[TableCheckpointStore]:
    table = f"t{uuid.uuid4().hex[:20]}"
    store = TableCheckpointStore(connection_string=azurite.connection_string, table=table)
    try:
        yield store
    finally:
        store.close()
        with TableClient.from_connection_string(azurite.connection_string, table) as client:
            client.delete_table()
