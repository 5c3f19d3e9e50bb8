"""A read of a checkpoint store whose table does not exist creates nothing.

``SqlCheckpointStore`` and ``TableCheckpointStore`` created their table on any
first use, a read included: ``dbtrigger status`` or ``state`` against a mistyped
URL, schema or table name left an empty state table behind in somebody's
database or storage account. A read now says "no state yet" (None, no keys) and
leaves the table missing; the first write creates it, as before.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from azure.data.tables import TableServiceClient

from dbtrigger import SqlCheckpointStore, TableCheckpointStore
from dbtrigger.cli import main
from tests.azurite import Azurite
from tests.databases import TestDatabase


def has_table(db: TestDatabase, name: str) -> bool:
    with db.engine.connect() as conn:
        return sa.inspect(conn).has_table(name, schema=db.schema)


def test_a_sql_store_read_creates_no_table(db: TestDatabase) -> None:
    store = SqlCheckpointStore(url=db.url, table="never_made", schema=db.schema)
    try:
        assert store.read("orders") is None
        assert store.list_keys() == []
        store.delete("orders")
        assert not has_table(db, "never_made"), "a read created the state table"
        etag = store.write("orders", b'{"v": 1}', if_match=None)  # the first write creates it
        assert has_table(db, "never_made")
        got = store.read("orders")
        assert got is not None
        assert (got.data, got.etag) == (b'{"v": 1}', etag)
        assert store.list_keys() == ["orders"]
    finally:
        store.close()


def test_the_cli_on_a_store_with_no_table_says_so(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI opens SQL stores without creating tables: ``dbtrigger status`` against a
    URL or schema with no state table printed the driver's words ('relation ... does
    not exist', 1146, 'no such table') and nothing about why."""
    assert not has_table(db, "never_made")  # (and SQLite's database file exists)
    url = db.url + ("?" if "?" not in db.url else "&") + "state_table=never_made"
    if db.schema:
        url += f"&state_schema={db.schema}"
    for argv in (["status", "--store", url], ["status", "orders", "--store", url]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "there is no table " in err, err
        assert "never_made there" in err, err
        assert "No poller has committed to this store yet" in err, err
    assert not has_table(db, "never_made")


@pytest.mark.azurite
def test_a_table_store_read_creates_no_table(azurite: Azurite) -> None:
    name = f"t{uuid.uuid4().hex[:20]}"
    service = TableServiceClient.from_connection_string(azurite.connection_string)
    store = TableCheckpointStore(connection_string=azurite.connection_string, table=name)
    try:
        assert store.read("orders") is None
        assert store.list_keys() == []
        store.delete("orders")
        tables = [t.name for t in service.query_tables(f"TableName eq '{name}'")]
        assert tables == [], "a read created the state table"
        store.write("orders", b'{"v": 1}', if_match=None)
        got = store.read("orders")
        assert got is not None
        assert got.data == b'{"v": 1}'
    finally:
        store.close()
        service.delete_table(name)
        service.close()
