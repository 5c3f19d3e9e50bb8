"""TableCheckpointStore against Azurite's table service.

The shared store contract runs on it in test_store_contract.py; here, on a
fresh table per test, is what is specific to Azure Tables: documents split over
several string properties and the 1 MiB entity limit, the constructors, a whole
drain, and failures translated into the store error tree (wrong key,
unreachable endpoint, and an answer lost after the write reached the service).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.core.credentials import AzureNamedKeyCredential
from azure.data.tables import TableClient, UpdateMode
from hypothesis import given
from hypothesis import strategies as st

from dbtrigger import PollTrigger
from dbtrigger.cli.main import main
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    ConfigurationError,
    CorruptStateError,
    StoreAuthError,
    StoreUnavailableError,
    UnsafeIdentifierError,
    UnsupportedDocumentError,
)
from dbtrigger.state.stores import StoredDocument, TableCheckpointStore
from dbtrigger.state.stores.table import (
    MAX_ENTITY_BYTES,
    MAX_PROPERTY_UNITS,
    entity_size,
    split_text,
)
from dbtrigger.testing import MemorySource
from tests.azurite import ACCOUNT, KEY, Azurite
from tests.databases import TestDatabase
from tests.test_sql_store import drain_counting_store_calls

pytestmark = pytest.mark.azurite


def fresh_table() -> str:
    return f"t{uuid.uuid4().hex[:20]}"


@pytest.fixture
def table_name(azurite: Azurite) -> Iterator[str]:
    name = fresh_table()
    yield name
    with TableClient.from_connection_string(azurite.connection_string, name) as client:
        client.delete_table()


@pytest.fixture
def table_store(azurite: Azurite, table_name: str) -> Iterator[TableCheckpointStore]:
    store = TableCheckpointStore(connection_string=azurite.connection_string, table=table_name)
    yield store
    store.close()


# --- layout and size ------------------------------------------------------------------


def test_entity_layout_pk_app_rk_poller(table_store: TableCheckpointStore) -> None:
    etag = table_store.write("orders", b'{"poller_name": "orders"}', if_match=None)
    entity = table_store.table_client.get_entity("default", "orders")
    assert entity.metadata["etag"] == etag
    assert {k: v for k, v in entity.items() if k.startswith("doc")} == {
        "doc_parts": 1,
        "doc_bytes": 25,
        "doc_0": '{"poller_name": "orders"}',
    }


def test_long_document_is_split_and_a_shorter_one_replaces_every_part(
    table_store: TableCheckpointStore,
) -> None:
    data = ('{"journal": "' + "€😀ab" * 60_000 + '"}').encode()  # ~0.5 MB of UTF-8
    etag = table_store.write("orders", data, if_match=None)
    assert table_store.read("orders") == StoredDocument(data, etag)
    parts = table_store.table_client.get_entity("default", "orders")["doc_parts"]
    assert parts > 1
    etag2 = table_store.write("orders", b"{}", if_match=etag)
    entity = table_store.table_client.get_entity("default", "orders")
    assert sorted(k for k in entity if k.startswith("doc_")) == ["doc_0", "doc_bytes", "doc_parts"]
    assert table_store.read("orders") == StoredDocument(b"{}", etag2)


def _largest_ascii_document(store: TableCheckpointStore, key: str) -> int:
    """Bisect the largest ASCII document the size check lets through."""
    lo, hi = 1, MAX_ENTITY_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            store._entity(key, b"x" * mid)
            lo = mid
        except UnsupportedDocumentError:
            hi = mid - 1
    return lo


def test_size_limit_is_the_services_and_is_checked_before_sending(
    table_store: TableCheckpointStore,
) -> None:
    largest = _largest_ascii_document(table_store, "orders")
    # Strings count two bytes per character toward the 1 MiB entity.
    assert 510 * 1024 < largest < 512 * 1024
    etag = table_store.write("orders", b"x" * largest, if_match=None)
    stored = table_store.read("orders")
    assert stored == StoredDocument(b"x" * largest, etag)
    with pytest.raises(UnsupportedDocumentError, match=r"-byte entity.* the document is \d+ bytes"):
        table_store.write("orders", b"y" * (largest + 1), if_match=etag)
    assert table_store.read("orders") == stored  # refused before any request


def test_non_utf8_bytes_are_refused(table_store: TableCheckpointStore) -> None:
    with pytest.raises(UnsupportedDocumentError):
        table_store.write("orders", b"\xff\xfe", if_match=None)
    assert table_store.read("orders") is None


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=300), st.integers(2, 40))
def test_split_text_keeps_pairs_and_bounds(text: str, units: int) -> None:
    pieces = split_text(text, units)
    assert "".join(pieces) == text
    for piece in pieces:
        assert len(piece.encode("utf-16-le")) // 2 <= units
        assert piece or text == ""


def test_split_text_never_cuts_a_surrogate_pair() -> None:
    text = "a" * (MAX_PROPERTY_UNITS - 1) + "😀" + "b"
    pieces = split_text(text)
    assert pieces == ["a" * (MAX_PROPERTY_UNITS - 1), "😀b"]


def test_entity_size_formula() -> None:
    # 4 + keys (2 per char) + Timestamp (8 + 18 + 8) + per property 8 + 2*name + value.
    entity = {"PartitionKey": "ab", "RowKey": "c", "n": 5, "s": "xyz"}
    assert entity_size(entity) == 4 + 4 + 2 + 34 + (8 + 2 + 4) + (8 + 2 + 4 + 6)


def test_foreign_or_truncated_entities_are_corrupt(table_store: TableCheckpointStore) -> None:
    assert table_store.list_keys() == []  # no table yet: a read creates none
    client = table_store.table_client
    client.create_table()
    client.create_entity({"PartitionKey": "default", "RowKey": "foreign", "other": "x"})
    client.create_entity(
        {"PartitionKey": "default", "RowKey": "cut", "doc_parts": 1, "doc_bytes": 10, "doc_0": "ab"}
    )
    with pytest.raises(CorruptStateError, match="not a dbtrigger document"):
        table_store.read("foreign")
    with pytest.raises(CorruptStateError, match="records 10"):
        table_store.read("cut")


def test_apps_partition_one_table(azurite: Azurite, table_name: str) -> None:
    app_a = TableCheckpointStore(
        connection_string=azurite.connection_string, table=table_name, app_name="app-a"
    )
    app_b = TableCheckpointStore(
        connection_string=azurite.connection_string, table=table_name, app_name="app-b"
    )
    ea = app_a.write("orders", b"A", if_match=None)
    eb = app_b.write("orders", b"B", if_match=None)
    app_a.write("Orders", b"upper", if_match=None)  # keys are case-sensitive
    assert app_a.read("orders") == StoredDocument(b"A", ea)
    assert app_b.read("orders") == StoredDocument(b"B", eb)
    assert app_a.list_keys() == ["Orders", "orders"]
    assert app_b.list_keys() == ["orders"]


# --- constructors -------------------------------------------------------------------------


def _round_trip(store: TableCheckpointStore) -> None:
    try:
        etag = store.write("orders", b"{}", if_match=None)
        assert store.read("orders") == StoredDocument(b"{}", etag)
    finally:
        store.close()


def test_endpoint_with_a_sas_authenticates_by_itself(azurite: Azurite, table_name: str) -> None:
    import datetime as dt  # noqa: PLC0415

    from azure.data.tables import (  # noqa: PLC0415
        AccountSasPermissions,
        ResourceTypes,
        generate_account_sas,
    )

    sas = generate_account_sas(
        AzureNamedKeyCredential(ACCOUNT, KEY),
        resource_types=ResourceTypes(service=True, container=True, object=True),
        permission=AccountSasPermissions(
            read=True, write=True, delete=True, list=True, add=True, update=True, create=True
        ),
        expiry=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
    )
    store = TableCheckpointStore(
        endpoint=f"{azurite.table_endpoint}?{sas}", table=table_name, create_table=True
    )
    _round_trip(store)


def test_an_endpoint_the_sdk_refuses_is_a_configuration_error() -> None:
    class TokenOnly:
        def get_token(self, *scopes: str, **kwargs: object) -> object:
            raise AssertionError("never asked")

    with pytest.raises(ConfigurationError, match="table endpoint"):
        TableCheckpointStore(
            endpoint="http://127.0.0.1:1/devstoreaccount1", table="state", credential=TokenOnly()
        )


def test_from_connection_setting_name(
    azurite: Azurite, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AzureWebJobsStorage", azurite.connection_string)
    _round_trip(TableCheckpointStore(connection_setting="AzureWebJobsStorage", table=table_name))


def test_from_setting_reference(
    azurite: Azurite, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBT_TEST_STATE_STORAGE", azurite.connection_string)
    _round_trip(
        TableCheckpointStore(connection_string="%DBT_TEST_STATE_STORAGE%", table=table_name)
    )


def test_from_endpoint_and_credential(azurite: Azurite, table_name: str) -> None:
    credential = AzureNamedKeyCredential(ACCOUNT, KEY)
    store = TableCheckpointStore(
        endpoint=azurite.table_endpoint, credential=credential, table=table_name
    )
    assert store.describe() == f"table:{azurite.table_endpoint}/{table_name} partition=default"
    _round_trip(store)


def test_from_existing_table_client(azurite: Azurite, table_name: str) -> None:
    client = TableClient.from_connection_string(azurite.connection_string, table_name)
    _round_trip(TableCheckpointStore(table_client=client))


def test_configuration_is_validated(azurite: Azurite) -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        TableCheckpointStore()
    with pytest.raises(ConfigurationError, match="exactly one"):
        TableCheckpointStore(
            connection_string=azurite.connection_string, endpoint=azurite.table_endpoint
        )
    with pytest.raises(UnsafeIdentifierError):
        TableCheckpointStore(connection_string=azurite.connection_string, table="bad-name")
    with pytest.raises(UnsafeIdentifierError):
        TableCheckpointStore(connection_string=azurite.connection_string, app_name="a/b")
    unset = TableCheckpointStore(connection_setting="NOT_SET_ANYWHERE")  # read at first use
    assert "NOT_SET_ANYWHERE" in unset.describe()
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="NOT_SET_ANYWHERE"):
            unset.read("p")
    with pytest.raises(ConfigurationError) as info:
        TableCheckpointStore(connection_string="AccountKey=abc123secret;nonsense")
    assert "abc123secret" not in str(info.value)


def test_create_table_false_reports_a_missing_table(azurite: Azurite) -> None:
    store = TableCheckpointStore(
        connection_string=azurite.connection_string, table=fresh_table(), create_table=False
    )
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        store.read("orders")
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        store.write("orders", b"{}", if_match=None)


# --- a whole drain ---------------------------------------------------------------------------


def test_poll_trigger_drains_with_state_in_a_table(
    sqlite_db: TestDatabase, table_store: TableCheckpointStore
) -> None:
    drain = drain_counting_store_calls(sqlite_db, table_store)
    assert drain.delivered == list(range(250))
    assert drain.per_tick == [(120, 1, 4), (120, 1, 4), (10, 1, 2), (0, 1, 0)]
    state = drain.trigger.read_state()
    assert state is not None
    assert state.position.pk == {"id": 249}
    assert state.lease is not None
    assert state.lease.released
    with sqlite_db.engine.begin() as conn:  # new rows arrive, the next drain resumes
        conn.execute(sa.text("INSERT INTO events VALUES (1000, 1000, 'late')"))
    assert drain.trigger.drain(drain.handle) == 1
    assert drain.delivered[-1] == 1000


# --- failures ----------------------------------------------------------------------------------


def _messages(exc: BaseException) -> str:
    parts = []
    seen: BaseException | None = exc
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def test_wrong_key_is_an_auth_error_without_the_key(azurite: Azurite, table_name: str) -> None:
    good = TableCheckpointStore(connection_string=azurite.connection_string, table=table_name)
    good.write("orders", b"{}", if_match=None)
    wrong_key = "V3JvbmdLZXlXcm9uZ0tleQ=="
    bad_conn = azurite.connection_string.replace(KEY, wrong_key)
    bad = TableCheckpointStore(connection_string=bad_conn, table=table_name, retries=0)
    errors = []
    for op in (
        lambda: bad.read("orders"),
        lambda: bad.write("orders", b"{}", if_match=None),
        bad.list_keys,
    ):
        with pytest.raises(StoreAuthError) as info:
            op()
        errors.append(info.value)
    for err in errors:
        assert wrong_key not in _messages(err)
        assert KEY not in _messages(err)
    assert wrong_key not in bad.describe()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_endpoint_is_unavailable_not_ambiguous() -> None:
    endpoint = f"http://127.0.0.1:{_unused_port()}/{ACCOUNT}"
    store = TableCheckpointStore(
        endpoint=endpoint, credential=AzureNamedKeyCredential(ACCOUNT, KEY), retries=0
    )
    with pytest.raises(StoreUnavailableError) as read_error:
        store.read("orders")
    with pytest.raises(StoreUnavailableError) as write_error:
        store.write("orders", b"{}", if_match=None)
    assert not isinstance(write_error.value, AmbiguousWriteError)
    assert KEY not in _messages(read_error.value) + _messages(write_error.value)


class ResponseDroppingProxy:
    """A loopback TCP proxy to Azurite that, once armed, forwards requests but
    closes the client's connection instead of relaying the answer."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.armed = threading.Event()
        self.dropped = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), 5)
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, is_response: bool) -> None:
        src.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    chunk = src.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                if is_response and self.armed.is_set():
                    self.dropped += 1
                    break  # the write reached the service; its answer never arrives
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        for t in self._threads:
            t.join(5)


def test_answer_lost_after_the_write_landed_is_ambiguous(azurite: Azurite, table_name: str) -> None:
    proxy = ResponseDroppingProxy(azurite.table_port)
    endpoint = f"http://127.0.0.1:{proxy.port}/{ACCOUNT}"
    credential = AzureNamedKeyCredential(ACCOUNT, KEY)
    via_proxy = TableCheckpointStore(
        endpoint=endpoint, credential=credential, table=table_name, timeout_seconds=5
    )
    direct = TableCheckpointStore(connection_string=azurite.connection_string, table=table_name)
    try:
        etag = via_proxy.write("orders", b'{"v": 1}', if_match=None)
        proxy.armed.set()
        with pytest.raises(AmbiguousWriteError):
            via_proxy.write("orders", b'{"v": 2}', if_match=etag)
        assert proxy.dropped == 1  # sent once: a retry would have failed its own If-Match
        reader = TableCheckpointStore(
            endpoint=endpoint, credential=credential, table=table_name, retries=0
        )
        with pytest.raises(StoreUnavailableError) as read_error:
            reader.read("orders")  # a read with no answer is just unavailable
        assert not isinstance(read_error.value, AmbiguousWriteError)
        reader.close()
    finally:
        proxy.close()
        via_proxy.close()
    # Here the write did land: exactly why the poller re-reads instead of guessing.
    stored = direct.read("orders")
    assert stored is not None
    assert stored.data == b'{"v": 2}'
    with pytest.raises(CasConflictError):
        direct.write("orders", b'{"v": 3}', if_match=etag)


# --- an entity it cannot decode -------------------------------------------------------------


def test_a_malformed_entity_is_named_and_replaced_by_reset_from_file_force(
    azurite: Azurite,
    table_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = TableCheckpointStore(
        connection_string=azurite.connection_string, table=table_name, create_table=True
    )
    rows = [{"id": i, "seq": i} for i in range(1, 4)]
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(rows, cursor_column="seq", pk_columns=["id"]),
        checkpoint_store=store,
    )
    trigger.tick(lambda events: None)
    stored = store.read("orders")
    assert stored is not None
    saved = tmp_path / "orders.backup.json"
    saved.write_bytes(stored.data)
    with TableClient.from_connection_string(azurite.connection_string, table_name) as client:
        entity = client.get_entity("default", "orders")
        entity["doc_parts"] = "x"
        client.update_entity(entity, mode=UpdateMode.REPLACE)
    monkeypatch.setenv("DBTRIGGER_BACKUP_DIR", str(tmp_path / "backups"))
    where = ["--store", f"azure-table:{azurite.connection_string}", "--table", table_name]

    assert main(["history", "orders", *where]) == 2
    err = capsys.readouterr().err
    assert "poller 'orders'" in err
    assert "doc_parts" in err
    assert "--from-file BACKUP --force" in err
    restore = ["reset", "orders", "--from-file", str(saved), "--reason", "r", "--yes", "--force"]
    assert main([*restore, *where]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "replacing an unreadable state document" in out
    assert KEY not in out
    assert store.read("orders") is not None  # readable again
    (kept,) = (tmp_path / "backups").iterdir()
    assert b'"doc_parts": "x"' in kept.read_bytes()
    store.close()
