"""BlobCheckpointStore against a real Azurite: layout and failure mapping.

The shared store contract runs against it in test_store_contract.py.

Each test gets its own container. Network failures are produced for real: a
small TCP proxy in front of Azurite forwards a PUT and throws the answer away
(the write lands, the client times out), and a closed local port stands in for
an unreachable account.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import HttpResponseError
from azure.storage.blob import (
    AccountSasPermissions,
    BlobServiceClient,
    LinearRetry,
    ResourceTypes,
    generate_account_sas,
)

from dbtrigger import LostLeaseError, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    ConfigurationError,
    StoreAuthError,
    StoreUnavailableError,
    UnsafeIdentifierError,
)
from dbtrigger.state import document as docmod
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.blob import BlobCheckpointStore
from dbtrigger.testing import CountingStore, StoreCall
from tests.azurite import ACCOUNT, KEY, Azurite
from tests.databases import TestDatabase

pytestmark = pytest.mark.azurite


def new_container(azurite: Azurite) -> Iterator[str]:
    name = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(name)
    try:
        yield name
    finally:
        service.delete_container(name)
        service.close()


@pytest.fixture
def container(azurite: Azurite) -> Iterator[str]:
    yield from new_container(azurite)


def make_store(
    azurite: Azurite, container: str, *, app: str = "app", **kwargs: Any
) -> BlobCheckpointStore:
    return BlobCheckpointStore.from_connection_string(
        azurite.connection_string, app_name=app, container=container, **kwargs
    )


# --- layout and construction -----------------------------------------------------


def test_blob_path_and_list_keys_are_scoped_to_the_app(azurite: Azurite, container: str) -> None:
    one = make_store(azurite, container, app="app-one")
    two = make_store(azurite, container, app="app-two", prefix="custom/prefix")
    one.write("orders", b"{}", if_match=None)
    two.write("orders", b"[]", if_match=None)
    two.write("refunds", b"[]", if_match=None)
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    names = sorted(b.name for b in service.get_container_client(container).list_blobs())
    assert names == [
        "custom/prefix/app-two/orders.json",
        "custom/prefix/app-two/refunds.json",
        "state/app-one/orders.json",
    ]
    props = service.get_blob_client(container, "state/app-one/orders.json").get_blob_properties()
    assert props.content_settings.content_type == "application/json"
    assert one.list_keys() == ["orders"]
    assert two.list_keys() == ["orders", "refunds"]
    got = one.read("orders")
    assert got is not None
    assert got.data == b"{}"


def test_unsafe_names_are_refused_before_any_request(azurite: Azurite, container: str) -> None:
    store = make_store(azurite, container)
    for bad in ("../escape", "a/b", "", "x" * 200, "sp ace"):
        with pytest.raises(UnsafeIdentifierError):
            store.read(bad)
        with pytest.raises(UnsafeIdentifierError):
            store.write(bad, b"x", if_match=None)
    with pytest.raises(UnsafeIdentifierError):
        make_store(azurite, container, app="../other")
    with pytest.raises(UnsafeIdentifierError):
        make_store(azurite, "Bad_Container")
    assert store.list_keys() == []


def test_connection_from_setting_name_and_reference(
    azurite: Azurite, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AzureWebJobsStorage", azurite.connection_string)
    monkeypatch.setenv("DBT_TEST_APP", "from-setting")
    by_name = BlobCheckpointStore.from_connection_string(
        "AzureWebJobsStorage", app_name="%DBT_TEST_APP%", container=container
    )
    by_ref = BlobCheckpointStore.from_connection_string(
        "%AzureWebJobsStorage%", app_name="from-setting", container=container
    )
    assert by_name.app_name == "from-setting"
    etag = by_name.write("p", b"1", if_match=None)
    assert by_ref.read("p") == (b"1", etag)
    # A missing setting fails the store's first use (each one), not its construction.
    unset = BlobCheckpointStore.from_connection_string(
        "NotSetAnywhere", app_name="a", container=container
    )
    assert "NotSetAnywhere" in unset.describe()
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="NotSetAnywhere") as err:
            unset.read("p")
    assert "__blobServiceUri" in str(err.value)
    monkeypatch.setenv("NotSetAnywhere", azurite.connection_string)
    assert unset.read("p") is None  # another app name: no such blob
    unset.close()
    with pytest.raises(ConfigurationError, match="malformed") as err:
        BlobCheckpointStore.from_connection_string(
            f"AccountKey={KEY};nonsense", app_name="a", container=container
        )
    assert KEY not in str(err.value)


def test_identity_based_connection_settings_build_an_account_url_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``<name>__accountName`` / ``__blobServiceUri`` select DefaultAzureCredential."""
    monkeypatch.delenv("IdentityStorage", raising=False)
    monkeypatch.setenv("IdentityStorage__accountName", "myaccount")
    store = BlobCheckpointStore.from_connection_string("IdentityStorage", app_name="app")
    assert (
        store.describe() == "azure-blob:https://myaccount.blob.core.windows.net/db-state/state/app/"
    )
    assert type(store.container_client.credential).__name__ == "DefaultAzureCredential"
    monkeypatch.setenv("IdentityStorage__blobServiceUri", "https://other.blob.core.windows.net")
    monkeypatch.setenv("IdentityStorage__clientId", "00000000-0000-0000-0000-000000000001")
    store = BlobCheckpointStore.from_connection_string(
        "IdentityStorage", app_name="app", container="states"
    )
    assert store.describe() == "azure-blob:https://other.blob.core.windows.net/states/state/app/"


def test_from_account_url_with_a_key_credential(azurite: Azurite, container: str) -> None:
    store = BlobCheckpointStore.from_account_url(
        f"http://127.0.0.1:{azurite.blob_port}/{ACCOUNT}",
        app_name="app",
        credential=AzureNamedKeyCredential(ACCOUNT, KEY),
        container=container,
    )
    etag = store.write("p", b"x", if_match=None)
    assert store.read("p") == (b"x", etag)
    assert KEY not in store.describe()


def test_from_account_url_with_a_sas_in_the_url(azurite: Azurite, container: str) -> None:
    """A SAS URL authenticates by itself: no DefaultAzureCredential is added to it
    (which the SDK refuses over http, and which would send a second credential),
    and the signature reaches no message."""
    from azure.storage.blob import (  # noqa: PLC0415
        AccountSasPermissions,
        ResourceTypes,
        generate_account_sas,
    )

    sas = generate_account_sas(
        ACCOUNT,
        KEY,
        ResourceTypes(container=True, object=True),
        AccountSasPermissions(read=True, write=True, delete=True, list=True),
        expiry=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
    )
    store = BlobCheckpointStore.from_account_url(
        f"http://127.0.0.1:{azurite.blob_port}/{ACCOUNT}?{sas}", app_name="app", container=container
    )
    etag = store.write("p", b"x", if_match=None)
    assert store.read("p") == (b"x", etag)
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    assert signature not in store.describe()


def test_an_account_url_the_sdk_refuses_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="account URL"):
        BlobCheckpointStore.from_account_url(
            "http://127.0.0.1:1/devstoreaccount1", app_name="app", credential=_TokenOnly()
        )


class _TokenOnly:
    """A token credential (the SDK refuses one over http)."""

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        raise AssertionError("never asked")


# --- missing container -----------------------------------------------------------


def test_missing_container_is_a_clear_unavailable_error(azurite: Azurite) -> None:
    store = make_store(azurite, "never-created-container")
    for op in (
        lambda: store.read("p"),
        lambda: store.write("p", b"x", if_match=None),
        store.list_keys,
    ):
        with pytest.raises(StoreUnavailableError, match="does not exist") as err:
            op()
        assert "create_container=True" in str(err.value)
        assert isinstance(err.value.__cause__, HttpResponseError)


def test_create_container_on_first_write(azurite: Azurite) -> None:
    name = f"t{uuid.uuid4().hex[:20]}"
    store = make_store(azurite, name, create_container=True)
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    try:
        assert store.read("p") is None
        assert store.list_keys() == []
        store.delete("p")
        with pytest.raises(CasConflictError):
            # an update cannot succeed on a container that had nothing in it
            store.write("p", b"x", if_match='"0x1"')
        etag = store.write("p", b"x", if_match=None)
        assert store.read("p") == (b"x", etag)
        assert store.list_keys() == ["p"]
    finally:
        service.delete_container(name)


# --- compare-and-swap mapping ----------------------------------------------------


def _http_status(exc: BaseException) -> int | None:
    cause = exc.__cause__
    return cause.status_code if isinstance(cause, HttpResponseError) else None


def test_create_conflict_is_cas_conflict_from_409_or_412(azurite: Azurite, container: str) -> None:
    store = make_store(azurite, container)
    store.write("p", b"one", if_match=None)
    with pytest.raises(CasConflictError) as err:
        store.write("p", b"two", if_match=None)
    assert _http_status(err.value) in (409, 412)
    assert err.value.fields["status"] in (409, 412)


def test_stale_etag_is_cas_conflict_from_412(azurite: Azurite, container: str) -> None:
    store = make_store(azurite, container)
    e1 = store.write("p", b"one", if_match=None)
    store.write("p", b"two", if_match=e1)
    with pytest.raises(CasConflictError) as err:
        store.write("p", b"three", if_match=e1)
    assert _http_status(err.value) == 412
    with pytest.raises(CasConflictError) as err:
        store.delete("p", if_match=e1)
    assert _http_status(err.value) == 412


# --- lease takeover on a real blob -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 4, 7, 1, 0, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now


def test_stale_owner_commit_after_takeover_is_rejected(
    azurite: Azurite, container: str, sqlite_db: TestDatabase
) -> None:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT NOT NULL)")
    sqlite_db.execute(
        "INSERT INTO orders VALUES (:id, :ts)",
        [{"id": i, "ts": f"2026-01-01 00:00:{i:02d}"} for i in range(1, 6)],
    )
    store = make_store(azurite, container)
    clock = Clock()

    def trigger(owner: str, store: CheckpointStore) -> PollTrigger:
        source = SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
        )
        return PollTrigger(
            name="orders",
            source=source,
            checkpoint_store=store,
            batch_size=10,
            lease_ttl_seconds=30,
            owner_id=owner,
            clock=clock,
        )

    slow_store = CountingStore(store)
    slow, fast = trigger("instance-a", slow_store), trigger("instance-b", store)
    delivered: dict[str, list[int]] = {"a": [], "b": []}

    def fast_handler(events: list[RowChange]) -> None:
        delivered["b"].extend(e.pk["id"] for e in events)

    def slow_handler(events: list[RowChange]) -> None:
        delivered["a"].extend(e.pk["id"] for e in events)
        # The handler outlives its lease and the grace window; B takes over.
        clock.now += dt.timedelta(seconds=60)
        assert fast.tick(fast_handler) == 5

    with pytest.raises(LostLeaseError) as err:
        slow.tick(slow_handler)
    assert delivered == {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 5]}
    # The rejection came from the blob's etag check (412), then a re-read showed
    # the lease had moved on: A's commit was never applied.
    assert slow_store.calls == [
        StoreCall("read", "orders"),
        StoreCall("write", "orders"),  # lease acquired, token 1
        StoreCall("write", "orders", "CasConflictError"),  # commit on a stale etag
        StoreCall("read", "orders"),  # B holds token 2: LostLeaseError
    ]
    assert err.value.fencing_token == 1

    stored = store.read("orders")
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.lease is not None
    assert doc.lease.owner_id == "instance-b"
    assert doc.lease.fencing_token == 2
    assert doc.checkpoint is not None
    assert doc.checkpoint.position.pk == {"id": 5}
    assert [e.get("owner_id") for e in doc.journal if e.get("type") == "commit"] == ["instance-b"]


# --- ambiguous writes through a proxy that drops answers --------------------------


class DroppingProxy:
    """A TCP proxy to Azurite that can swallow the answer to chosen PUT requests.

    Requests on a keep-alive connection are sequential, so a new request always
    starts a fresh ``recv``; a chunk starting with ``PUT `` is a PUT request.
    ``drop_put(after=n)`` lets ``n`` PUTs through and then, for the next one,
    forwards the request but discards the response: the write lands, the
    client hears nothing and times out.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._skip: int | None = None
        self.dropped = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_put(self, after: int = 0) -> None:
        with self._lock:
            self._skip = after

    def _should_drop(self, chunk: bytes) -> bool:
        if not chunk.startswith(b"PUT "):
            return False
        with self._lock:
            if self._skip is None:
                return False
            if self._skip > 0:
                self._skip -= 1
                return False
            self._skip = None
            self.dropped += 1
            return True

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            muted = threading.Event()
            threading.Thread(
                target=self._pump_up, args=(client, upstream, muted), daemon=True
            ).start()
            threading.Thread(
                target=self._pump_down, args=(upstream, client, muted), daemon=True
            ).start()

    def _pump_up(self, src: socket.socket, dst: socket.socket, muted: threading.Event) -> None:
        try:
            while chunk := src.recv(65536):
                if self._should_drop(chunk):
                    muted.set()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(dst)

    def _pump_down(self, src: socket.socket, dst: socket.socket, muted: threading.Event) -> None:
        try:
            while chunk := src.recv(65536):
                if not muted.is_set():
                    dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(dst)

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        for s in self._sockets:
            _close(s)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


@pytest.fixture
def proxy(azurite: Azurite) -> Iterator[DroppingProxy]:
    p = DroppingProxy(azurite.blob_port)
    yield p
    p.close()


def proxied_store(proxy: DroppingProxy, container: str, **kwargs: Any) -> BlobCheckpointStore:
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint=http://127.0.0.1:{proxy.port}/{ACCOUNT};"
    )
    return BlobCheckpointStore.from_connection_string(
        conn, app_name="app", container=container, read_timeout=1, **kwargs
    )


def test_write_whose_answer_is_lost_is_ambiguous_and_did_land(
    proxy: DroppingProxy, azurite: Azurite, container: str
) -> None:
    store = proxied_store(proxy, container)
    direct = make_store(azurite, container)
    e1 = store.write("p", b"one", if_match=None)
    proxy.drop_put()
    with pytest.raises(AmbiguousWriteError) as err:
        store.write("p", b"two", if_match=e1)
    assert proxy.dropped == 1
    assert "may or may not" in str(err.value)
    got = direct.read("p")
    assert got is not None
    assert got.data == b"two"  # it landed, and only a re-read can tell
    # A create whose answer is lost is just as ambiguous.
    proxy.drop_put()
    with pytest.raises(AmbiguousWriteError):
        store.write("q", b"new", if_match=None)
    assert direct.read("q") is not None


def test_commit_whose_answer_is_lost_is_resolved_by_rereading(
    proxy: DroppingProxy, container: str, sqlite_db: TestDatabase
) -> None:
    """W5 end to end: the tick recognises its own landed commit; no redelivery."""
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT NOT NULL)")
    sqlite_db.execute(
        "INSERT INTO orders VALUES (:id, :ts)",
        [{"id": i, "ts": f"2026-01-01 00:00:{i:02d}"} for i in range(1, 4)],
    )
    store = proxied_store(proxy, container)
    trigger = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
        ),
        checkpoint_store=store,
    )
    seen: list[int] = []
    proxy.drop_put(after=1)  # the lease write passes, the commit's answer is lost
    assert trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 3
    assert proxy.dropped == 1
    assert trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events)) == 0
    assert seen == [1, 2, 3]
    state = trigger.read_state()
    assert state is not None
    assert state.checkpoint is not None
    assert state.checkpoint.position.pk == {"id": 3}


def test_request_without_answer_is_unavailable_for_reads_ambiguous_for_writes(
    container: str,
) -> None:
    blackhole = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        port = blackhole.getsockname()[1]
        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
        )
        silent = BlobCheckpointStore.from_connection_string(
            conn,
            app_name="app",
            container=container,
            read_timeout=0.5,
            retry_policy=_no_retry(),
        )
        with pytest.raises(StoreUnavailableError, match="no answer"):
            silent.read("p")
        with pytest.raises(StoreUnavailableError, match="no answer"):
            silent.list_keys()
        with pytest.raises(AmbiguousWriteError):
            silent.write("p", b"two", if_match=None)
        with pytest.raises(AmbiguousWriteError):
            silent.delete("p")
    finally:
        blackhole.close()


def _no_retry() -> LinearRetry:
    return LinearRetry(backoff=0, retry_total=0, random_jitter_range=0)


# --- unreachable and unauthorised -------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_endpoint_is_unavailable_for_reads_and_writes(container: str) -> None:
    port = _closed_port()
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
    )
    store = BlobCheckpointStore.from_connection_string(
        conn, app_name="app", container=container, retry_policy=_no_retry()
    )
    for op in (
        lambda: store.read("p"),
        lambda: store.write("p", b"x", if_match=None),  # never sent: certainly not applied
        store.list_keys,
    ):
        with pytest.raises(StoreUnavailableError, match="unreachable") as err:
            op()
        assert not isinstance(err.value, AmbiguousWriteError)
        assert KEY not in str(err.value)


def _wrong_key() -> str:
    return base64.b64encode(os.urandom(64)).decode()


def test_wrong_account_key_is_an_auth_error(
    azurite: Azurite, container: str, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = _wrong_key()
    conn = azurite.connection_string.replace(KEY, wrong)
    store = BlobCheckpointStore.from_connection_string(conn, app_name="app", container=container)
    caplog.set_level(logging.DEBUG)
    errors: list[BaseException] = []
    for op in (
        lambda: store.read("p"),
        lambda: store.write("p", b"x", if_match=None),
        lambda: store.delete("p"),
        store.list_keys,
    ):
        with pytest.raises(StoreAuthError, match="Storage Blob Data Contributor") as err:
            op()
        errors.append(err.value)
        assert err.value.fields["status"] == 403
    for e in errors:
        assert wrong not in str(e)
        assert wrong not in repr(e)
        assert wrong not in str(e.__cause__)
    assert wrong not in store.describe()
    assert wrong not in caplog.text  # shared-key auth never puts the key on the wire


def test_no_secret_in_describe_errors_or_logs(
    azurite: Azurite, container: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    keyed = make_store(azurite, container)
    sas = generate_account_sas(
        account_name=ACCOUNT,
        account_key=KEY,
        resource_types=ResourceTypes(object=True, container=True),
        permission=AccountSasPermissions(read=True, write=True, list=True, delete=True),
        expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
    )
    signature = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
    sas_store = BlobCheckpointStore.from_connection_string(
        f"BlobEndpoint={azurite.blob_endpoint};SharedAccessSignature={sas}",
        app_name="app",
        container=container,
    )
    etag = sas_store.write("p", b"x", if_match=None)
    assert keyed.read("p") == (b"x", etag)
    with pytest.raises(CasConflictError) as conflict:
        sas_store.write("p", b"y", if_match=None)
    # urllib3's own DEBUG lines print raw request URLs (SAS included); that is the
    # transport's logger, documented in docs/azure.md. Ours and azure-core's redact.
    ours = [
        r.getMessage() + repr(getattr(r, "__dict__", {}))
        for r in caplog.records
        if r.name.startswith(("dbtrigger", "azure"))
    ]
    assert ours  # azure-core's request logging did run
    texts = [
        keyed.describe(),
        sas_store.describe(),
        str(conflict.value),
        repr(conflict.value),
        *ours,
    ]
    for text in texts:
        assert KEY not in text
        assert signature not in text
        assert "sig=" not in text.replace("sig=REDACTED", "")
    assert sas_store.describe() == f"azure-blob:{azurite.blob_endpoint}/{container}/state/app/"


def test_tick_with_unusable_credentials_propagates_as_operator_error(
    azurite: Azurite, container: str, sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT NOT NULL)")
    conn = azurite.connection_string.replace(KEY, _wrong_key())
    store = BlobCheckpointStore.from_connection_string(conn, app_name="app", container=container)
    trigger = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
        ),
        checkpoint_store=store,
    )
    handler: Callable[[list[RowChange]], None] = lambda events: None  # noqa: E731
    with pytest.raises(StoreAuthError):
        trigger.tick(handler)
