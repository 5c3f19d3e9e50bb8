"""A 409/412 that is not a lost race is an operator error, not contention.

Only "the document changed since it was read" and "it already exists" are
:class:`CasConflictError` (another instance won; the tick does nothing, quietly).
Anything else the store refuses - a lease someone took on the state blob, a
constraint on the state table - would be refused again on every tick, so it is
:class:`StoreRefusedError` (an ``OperatorError``): the tick raises it and the
Functions invocation fails loudly, instead of logging "another instance won" at
DEBUG forever.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.core.exceptions import (
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
)
from azure.storage.blob import BlobServiceClient

from dbtrigger import PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import CasConflictError, OperatorError, StoreRefusedError
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import decide_acquire
from dbtrigger.state.stores.blob import BlobCheckpointStore
from dbtrigger.state.stores.sql import SqlCheckpointStore
from dbtrigger.state.stores.table import TableCheckpointStore
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.test_store_files_safety import NOW, _doc_bytes


@pytest.fixture
def container(azurite: Azurite) -> Iterator[str]:
    name = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(name)
    try:
        yield name
    finally:
        service.delete_container(name)
        service.close()


def _events_source(db: TestDatabase) -> SqlAlchemySource:
    db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    db.execute("INSERT INTO events (id, seq) VALUES (1, 1), (2, 2)")
    return SqlAlchemySource(url=db.url, table="events", cursor_column="seq", pk_columns=["id"])


@pytest.mark.azurite
def test_someone_elses_blob_lease_is_an_operator_error_not_contention(
    azurite: Azurite,
    container: str,
    sqlite_db: TestDatabase,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = BlobCheckpointStore.from_connection_string(
        azurite.connection_string, app_name="app", container=container
    )
    etag = store.write("orders", _doc_bytes(), if_match=None)
    # Someone (a backup tool, a colleague in Storage Explorer) takes a blob lease.
    blob = store.container_client.get_blob_client(store.blob_name("orders"))
    lease = blob.acquire_lease(lease_duration=-1)

    with pytest.raises(StoreRefusedError, match="LeaseIdMissing") as refused:
        store.write("orders", _doc_bytes(), if_match=etag)
    assert not isinstance(refused.value, CasConflictError)
    assert isinstance(refused.value, OperatorError)
    assert "break" in str(refused.value)

    # The tick does not report it as "another instance holds the lease".
    trigger = PollTrigger(name="orders", source=_events_source(sqlite_db), checkpoint_store=store)
    trigger.source.fingerprint = lambda: "sha256:x"  # type: ignore[method-assign]
    seen: list[RowChange] = []
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreRefusedError):
        trigger.tick(seen.extend)
    assert seen == []
    refusals = [
        r
        for r in caplog.records
        if r.name.startswith("dbtrigger") and "LeaseIdMissing" in r.getMessage()
    ]
    assert refusals
    assert all(r.levelno == logging.ERROR for r in refusals)

    # A real lost race on the same blob is still plain contention.
    lease.break_lease(lease_break_period=0)
    current = store.read("orders")
    assert current is not None
    store.write("orders", current.data, if_match=current.etag)
    with pytest.raises(CasConflictError):
        store.write("orders", current.data, if_match=current.etag)
    with pytest.raises(CasConflictError):
        store.write("orders", current.data, if_match=None)
    store.close()


@pytest.mark.azurite
def test_a_lease_on_the_blob_makes_delete_an_operator_error(
    azurite: Azurite, container: str
) -> None:
    store = BlobCheckpointStore.from_connection_string(
        azurite.connection_string, app_name="app", container=container
    )
    etag = store.write("orders", _doc_bytes(), if_match=None)
    store.container_client.get_blob_client(store.blob_name("orders")).acquire_lease(-1)
    with pytest.raises(StoreRefusedError):
        store.delete("orders", if_match=etag)
    store.close()


# --- Table store: the translation table, with the SDK's own exception types ------------------


def _http_error(cls: type[HttpResponseError], status: int, code: str) -> HttpResponseError:
    exc = cls(message=f"{status} {code}")
    exc.status_code = status
    exc.error_code = code
    return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_http_error(ResourceExistsError, 409, "EntityAlreadyExists"), CasConflictError),
        (_http_error(ResourceModifiedError, 412, "UpdateConditionNotSatisfied"), CasConflictError),
        (_http_error(HttpResponseError, 412, "UpdateConditionNotSatisfied"), CasConflictError),
        (_http_error(ResourceExistsError, 409, "TableBeingDeleted"), StoreRefusedError),
        (_http_error(HttpResponseError, 409, "TableBeingDeleted"), StoreRefusedError),
        (_http_error(ResourceModifiedError, 412, "SomethingElse"), StoreRefusedError),
    ],
)
def test_table_store_tells_races_from_refusals(
    azurite: Azurite, exc: HttpResponseError, expected: type[Exception]
) -> None:
    store = TableCheckpointStore(connection_string=azurite.connection_string, create_table=False)
    translated = store._translate("write of 'p'", "p", exc, write=True, if_match='W/"x"')
    assert type(translated) is expected
    store.close()


@pytest.mark.azurite
def test_table_store_real_races_are_contention(azurite: Azurite) -> None:
    store = TableCheckpointStore(
        connection_string=azurite.connection_string, table=f"t{uuid.uuid4().hex[:12]}"
    )
    etag = store.write("orders", _doc_bytes(), if_match=None)
    with pytest.raises(CasConflictError):
        store.write("orders", _doc_bytes(), if_match=None)
    store.write("orders", _doc_bytes(), if_match=etag)
    with pytest.raises(CasConflictError):
        store.write("orders", _doc_bytes(), if_match=etag)
    store.table_client.delete_table()
    store.close()


# --- SQL store: a constraint that is not the key ----------------------------------------------


def _block_poller(db: TestDatabase, table: str) -> None:
    """A policy someone put on the state table: poller 'blocked' may not be written."""
    if db.kind == "sqlite":
        db.execute(
            f"CREATE TRIGGER block_it BEFORE INSERT ON {table} "
            "WHEN NEW.poller_name = 'blocked' BEGIN SELECT RAISE(ABORT, 'blocked by policy'); END"
        )
    else:
        db.execute(
            f"ALTER TABLE {db.qualified(table)} "
            "ADD CONSTRAINT block_it CHECK (poller_name <> 'blocked')"
        )


_PG = pytest.param("postgresql", marks=pytest.mark.postgresql)


@pytest.mark.parametrize("kind", ["sqlite", _PG])
def test_sql_store_constraint_violation_is_a_refusal_not_a_race(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db: TestDatabase = request.getfixturevalue("sqlite_db" if kind == "sqlite" else "pg")
    store = SqlCheckpointStore(url=db.url, schema=db.schema)
    store.create_table()
    _block_poller(db, "dbtrigger_state")
    with pytest.raises(StoreRefusedError, match="constraint") as refused:
        store.write("blocked", _doc_bytes("blocked"), if_match=None)
    assert not isinstance(refused.value, CasConflictError)
    # The key itself is still a race.
    store.write("orders", _doc_bytes(), if_match=None)
    with pytest.raises(CasConflictError):
        store.write("orders", _doc_bytes(), if_match=None)
    store.close()


def test_sql_duplicate_key_detection_needs_the_key(sqlite_db: TestDatabase) -> None:
    engine = sa.create_engine(sqlite_db.url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE u (k INTEGER PRIMARY KEY, v INTEGER NOT NULL)"))
        conn.execute(sa.text("INSERT INTO u VALUES (1, 1)"))
    from dbtrigger.state.stores.sql import is_duplicate_key  # noqa: PLC0415

    errors = []
    for stmt in ("INSERT INTO u VALUES (1, 2)", "INSERT INTO u (k) VALUES (2)"):
        with pytest.raises(sa.exc.IntegrityError) as info, engine.begin() as conn:
            conn.execute(sa.text(stmt))
        errors.append(is_duplicate_key(info.value))
    assert errors == [True, False]
    engine.dispose()


def test_decided_document_is_what_the_store_refuses() -> None:
    # Guard the helper the tests above share: a real document, written create-only.
    decided = decide_acquire(
        None, poller="p", fingerprint="sha256:x", owner="a", now=NOW, ttl=NOW - NOW
    )
    assert docmod.loads(_doc_bytes("p")) == decided.document
