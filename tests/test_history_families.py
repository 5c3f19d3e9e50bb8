"""A poller's history lives beside its state in every store family, and the CLI
reads it there: rows of ``<state table>_history`` next to a SQL state table
(SQLite, PostgreSQL, MariaDB), append blobs next to the state blob and entities
in the state's Table storage table (Azurite). Commits by the runtime and a
manual operation by the CLI land in the same history.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.data.tables import TableServiceClient
from azure.storage.blob import BlobServiceClient

from dbtrigger import PollTrigger
from dbtrigger.cli import main
from dbtrigger.history import BlobHistory, SqlHistory, TableHistory, history_for
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.testing import MemorySource
from tests.azurite import Azurite
from tests.databases import make_database

FAMILIES = [
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.postgresql),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("blob", marks=pytest.mark.azurite),
    pytest.param("table", marks=pytest.mark.azurite),
]


@pytest.fixture(params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[CheckpointStore, list[str], type]]:
    """A checkpoint store, the CLI options that name the same store, and the
    history adapter expected beside it."""
    kind = request.param
    if kind in ("sqlite", "postgresql", "mariadb"):
        from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415

        for db in make_database(kind, tmp_path):
            store = SqlCheckpointStore(url=db.url, schema=db.schema)
            url = db.url
            if db.schema:
                url += ("&" if "?" in url else "?") + f"state_schema={db.schema}"
            yield store, ["--store", url], SqlHistory
            store.close()
        return
    azurite: Azurite = request.getfixturevalue("azurite")
    name = f"h{uuid.uuid4().hex[:16]}"
    if kind == "blob":
        from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        service.create_container(name)
        blob_store = BlobCheckpointStore.from_connection_string(
            azurite.connection_string, app_name="shop", container=name
        )
        try:
            yield (
                blob_store,
                ["--store", azurite.connection_string, "--container", name, "--app", "shop"],
                BlobHistory,
            )
        finally:
            blob_store.close()
            service.delete_container(name)
            service.close()
        return
    from dbtrigger.state.stores.table import TableCheckpointStore  # noqa: PLC0415

    table_store = TableCheckpointStore(
        connection_string=azurite.connection_string, table=name, app_name="shop"
    )
    tables = TableServiceClient.from_connection_string(azurite.connection_string)
    try:
        yield (
            table_store,
            [
                "--store",
                f"azure-table:{azurite.connection_string}",
                "--table",
                name,
                "--app",
                "shop",
            ],
            TableHistory,
        )
    finally:
        table_store.close()
        tables.delete_table(name)
        tables.close()


def test_the_history_is_kept_beside_the_state_and_read_by_the_cli(
    family: tuple[CheckpointStore, list[str], type],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, options, adapter = family
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DBTRIGGER_BACKUP_DIR", str(tmp_path / "bk"))
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i} for i in range(1, 26)], cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=store,
        batch_size=10,
    )
    trigger.drain(lambda events: None)
    history = history_for(store)
    assert isinstance(history, adapter)
    assert isinstance(trigger.history, adapter)
    assert main(["bookmark", "create", "orders", "v1", "--reason", "before v2", *options]) == 0
    capsys.readouterr()
    assert main(["history", "orders", "--json", *options]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["seq"], r["type"], r.get("rows")) for r in records] == [
        (1, "commit", 10),
        (2, "commit", 10),
        (3, "commit", 5),
        (4, "manual", None),
    ]
    assert records[3]["operation"] == "bookmark"
    assert [r["seq"] for r in history.read("orders")] == [1, 2, 3, 4]
    assert main(["history", "orders", *options]) == 0
    out = capsys.readouterr().out
    assert f"kept in {history.describe()}" in out
