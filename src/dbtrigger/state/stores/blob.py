"""Azure Blob Storage checkpoint store: one JSON blob per poller, etag CAS.

Layout: container ``db-state`` (configurable), blob
``state/{app_name}/{poller_name}.json``. ``app_name`` keeps two Function Apps
(or two deployment slots) sharing one storage account from sharing state.

Every write is conditional: a create carries ``If-None-Match: *`` and an update
``If-Match: <etag>``. Blob Storage evaluates the condition atomically with the
write, which is exactly the compare-and-swap the store contract asks for.

Two choices that matter when a network misbehaves:

* Writes are sent **once** (``retry_total=0``). The SDK's own retry would
  re-send a conditional PUT whose first attempt may already have landed; the
  retry then fails with 412 and turns "my write succeeded" into a false
  "someone else wrote". Reporting :class:`~dbtrigger.errors.AmbiguousWriteError`
  instead lets the tick re-read and recognise its own write (contract W5).
* azure-core tells us whether a failed request reached the service:
  ``ServiceRequestError`` means nothing was sent (the write certainly did not
  land: :class:`~dbtrigger.errors.StoreUnavailableError`), ``ServiceResponseError``
  means it was sent and the answer was lost (ambiguous).

Errors are translated in one place, :meth:`BlobCheckpointStore._translated`,
by the mapper the Table store and the Queue glue share
(:mod:`dbtrigger._azure_errors`), with the SDK exception chained as the cause.
Our messages carry the operation, blob path, HTTP status and storage error
code, never the SDK's unredacted text (which can echo request URLs, and with
SAS authentication those carry a signature).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from azure.core import MatchConditions
from azure.core.exceptions import (
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.storage.blob import ContainerClient, ContentSettings, LinearRetry

from dbtrigger import _azure_errors as azure_errors
from dbtrigger import options as opt
from dbtrigger.errors import (
    ConfigurationError,
    MissingSettingError,
    UnsafeIdentifierError,
)
from dbtrigger.names import validate_name
from dbtrigger.redaction import redact, remember_connection_string
from dbtrigger.settings import (
    Deferred,
    environment,
    peek,
    references_setting,
    resolve_setting,
    setting_name,
)
from dbtrigger.state.stores._sdk_client import SdkClientHolder
from dbtrigger.state.stores.base import StoredDocument

log = logging.getLogger(__name__)

DEFAULT_CONTAINER = "db-state"
DEFAULT_PREFIX = "state"

_CONTAINER_NAME = re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_:.-]*$")
_JSON = ContentSettings(content_type="application/json")

#: Client options used when this module builds the client: a tick should fail
#: fast and be retried by the next timer firing, not sit in the SDK's default
#: 15-second exponential backoff.
DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    "connection_timeout": 10,
    "read_timeout": 30,
}


def _client_options(client_options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the store's client is built with: a short linear retry and
    :data:`DEFAULT_CLIENT_OPTIONS`, each overridden by the caller's ``client_options``."""
    retry = LinearRetry(backoff=1, retry_total=2, random_jitter_range=1)
    return {"retry_policy": retry, **DEFAULT_CLIENT_OPTIONS, **client_options}


def validate_container_name(value: str) -> str:
    """Blob container rules: 3-63 lowercase letters, digits, single hyphens."""
    if not isinstance(value, str) or not _CONTAINER_NAME.match(value):
        raise UnsafeIdentifierError(
            f"container {value!r} is not a valid blob container name: use 3-63 lowercase "
            "letters, digits and single hyphens, starting and ending with a letter or digit",
            name="container",
        )
    return value


def _container_missing(exc: BaseException) -> bool:
    return azure_errors.error_code(exc) == "ContainerNotFound"


def _safe_url(url: str) -> str:
    """Scheme, host and path only: no query (SAS tokens), no user info."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))


def _resolve_now_or_later(value: str, env: Mapping[str, str]) -> str:
    """``value`` resolved from ``env``, or as it is when a setting is missing or
    not a safe name (the store then resolves it, and reports the setting, at
    first use)."""
    try:
        return validate_name(resolve_setting(value, env), "app name")
    except ConfigurationError:  # missing, or no safe name: the store names the setting
        return value


def _app_name(spec: str) -> str:
    """The app name ``spec`` gives (a ``%SETTING%`` read now), checked as a blob path
    segment; a bad one names the setting it came from."""
    setting = setting_name(spec)
    what = "app name" if setting is None else f"app name in app setting {setting!r}"
    return validate_name(resolve_setting(spec), what)


def _account_client(
    url: str, container: str, credential: Any, options: dict[str, Any]
) -> ContainerClient:
    if credential is None and "sig" not in parse_qs(urlsplit(url).query):
        # A SAS in the URL authenticates by itself; a second credential would be
        # sent beside it (and a token credential is refused over http).
        from azure.identity import DefaultAzureCredential  # noqa: PLC0415 - optional extra

        credential = DefaultAzureCredential()
    try:
        return ContainerClient(
            account_url=url, container_name=container, credential=credential, **options
        )
    except ValueError as exc:  # the SDK's own refusals: a bad URL, a token over http
        raise ConfigurationError(
            f"blob account URL {_safe_url(url)} cannot be used: {redact(str(exc))}"
        ) from None


class BlobCheckpointStore(SdkClientHolder[ContainerClient]):
    """State documents as blobs, every change an etag compare-and-swap.

    Args:
        container_client: an ``azure.storage.blob.ContainerClient``; the
            container it names holds the state blobs.
        app_name: the application's name, the middle segment of every blob path.
            ``%SETTING%`` references are resolved from the environment.
        prefix: the first path segment (default ``state``).
        create_container: create the container on first use when it is missing.
            Without it a missing container is a clear
            :class:`~dbtrigger.errors.StoreUnavailableError`, because with
            least-privilege RBAC the identity usually cannot create containers.
        read_timeout: seconds to wait for a response on each call (None: the
            client's setting). A timed-out write is reported as ambiguous.
    """

    def __init__(
        self,
        *,
        container_client: ContainerClient | Deferred[ContainerClient],
        app_name: str,
        prefix: str = DEFAULT_PREFIX,
        create_container: bool = False,
        read_timeout: float | None = None,
        container_name: str | None = None,
    ) -> None:
        # A client built from app settings is built at first use (Deferred):
        # in a Function App one missing setting must not stop every function
        # from indexing, only fail the functions that use this store.
        self._client_source = container_client
        self._container_name = container_name
        self._app_name_spec = app_name
        self._app_name: str | None = None
        if not references_setting(app_name):
            self._app_name = _app_name(app_name)
        else:  # missing or malformed, it fails the functions using the store, at first use
            with contextlib.suppress(ConfigurationError):
                self._app_name = _app_name(app_name)
        segments = prefix.strip("/").split("/")
        self.prefix = "/".join(validate_name(s, "blob prefix segment") for s in segments)
        self._create_container = create_container
        self._call_options: dict[str, Any] = {}
        read_timeout = opt.optional_seconds("read_timeout", read_timeout)
        if read_timeout is not None:
            self._call_options["read_timeout"] = read_timeout

    @property
    def app_name(self) -> str:
        """The application segment of the blob paths (``%SETTING%`` resolved at first use)."""
        if self._app_name is None:
            self._app_name = _app_name(self._app_name_spec)
        return self._app_name

    # --- construction -----------------------------------------------------------

    @classmethod
    def from_connection_string(
        cls,
        connection: str,
        *,
        app_name: str,
        container: str = DEFAULT_CONTAINER,
        prefix: str = DEFAULT_PREFIX,
        create_container: bool = False,
        read_timeout: float | None = None,
        environ: Mapping[str, str] | None = None,
        **client_options: Any,
    ) -> BlobCheckpointStore:
        """Build from a connection string, a ``%SETTING%`` reference or a setting name.

        ``connection`` may be a connection string itself, ``"%AzureWebJobsStorage%"``,
        or just ``"AzureWebJobsStorage"`` (a bare app-setting name, the way
        Functions bindings name connections). When a bare setting is unset but
        ``<name>__blobServiceUri`` or ``<name>__accountName`` is set, this is a
        Functions *identity-based connection*: the store authenticates with
        ``DefaultAzureCredential`` (honouring ``<name>__clientId`` for a
        user-assigned managed identity).

        An app setting is read when the store is first used, not here: a
        missing or malformed one fails that use (every use, until it is set)
        with a :class:`~dbtrigger.errors.ConfigurationError` naming the
        setting, never its value; the Function App importing this module still
        indexes. A literal connection string is checked here.
        """
        env = environment(environ)
        validate_container_name(container)
        options = _client_options(client_options)

        def build() -> ContainerClient:
            return cls._connect(connection, env, container, options)

        client: ContainerClient | Deferred[ContainerClient]
        if _SETTING_NAME.match(connection):
            client = Deferred(build, f"app setting {connection!r}")
        elif references_setting(connection):
            client = Deferred(build, f"app settings in {connection!r}")
        else:
            client = build()
        return cls(
            container_client=client,
            app_name=_resolve_now_or_later(app_name, env),
            prefix=prefix,
            create_container=create_container,
            read_timeout=read_timeout,
            container_name=container,
        )

    @classmethod
    def _connect(
        cls, connection: str, env: Mapping[str, str], container: str, options: dict[str, Any]
    ) -> ContainerClient:
        """The container client ``connection`` names, its app settings read now."""
        setting = _SETTING_NAME.match(connection) is not None
        if setting:
            if connection not in env:
                identity = cls._identity_client(connection, env, container, options)
                if identity is not None:
                    return identity
                raise MissingSettingError(
                    f"app setting {connection!r} is not set (nor {connection}__blobServiceUri "
                    f"or {connection}__accountName for an identity-based connection)"
                )
            conn_str = env[connection]
        else:
            conn_str = resolve_setting(connection, env)
        remember_connection_string(conn_str)  # its key or SAS is masked wherever echoed
        try:
            return ContainerClient.from_connection_string(conn_str, container, **options)
        except ValueError:
            # The SDK's message is harmless, but the string itself must not leak.
            where = f" in app setting {connection!r}" if setting else ""
            raise ConfigurationError(
                f"the storage connection string{where} is malformed (expected "
                "'AccountName=...;AccountKey=...' or 'BlobEndpoint=...;SharedAccessSignature=...')"
            ) from None

    @classmethod
    def from_account_url(
        cls,
        account_url: str,
        *,
        app_name: str,
        credential: Any = None,
        container: str = DEFAULT_CONTAINER,
        prefix: str = DEFAULT_PREFIX,
        create_container: bool = False,
        read_timeout: float | None = None,
        **client_options: Any,
    ) -> BlobCheckpointStore:
        """Build from ``https://<account>.blob.core.windows.net`` and a credential.

        ``credential=None`` means ``azure.identity.DefaultAzureCredential()``: a
        managed identity in Azure, your ``az login`` locally. The identity needs
        the "Storage Blob Data Contributor" role on the container. A
        ``%SETTING%`` in ``account_url`` is read at first use.
        """
        validate_container_name(container)
        options = _client_options(client_options)

        def build() -> ContainerClient:
            return _account_client(resolve_setting(account_url), container, credential, options)

        client: ContainerClient | Deferred[ContainerClient] = (
            Deferred(build, f"app settings in {account_url!r}")
            if references_setting(account_url)
            else build()
        )
        return cls(
            container_client=client,
            app_name=app_name,
            prefix=prefix,
            create_container=create_container,
            read_timeout=read_timeout,
            container_name=container,
        )

    @classmethod
    def _identity_client(
        cls, name: str, env: Mapping[str, str], container: str, options: dict[str, Any]
    ) -> ContainerClient | None:
        url = env.get(f"{name}__blobServiceUri") or env.get(f"{name}__serviceUri")
        account = env.get(f"{name}__accountName")
        if not url and account:
            url = f"https://{account}.blob.core.windows.net"
        if not url:
            return None
        from azure.identity import DefaultAzureCredential  # noqa: PLC0415 - optional extra

        client_id = env.get(f"{name}__clientId")
        credential = (
            DefaultAzureCredential(managed_identity_client_id=client_id)
            if client_id
            else DefaultAzureCredential()
        )
        return _account_client(url, container, credential, options)

    # --- helpers ----------------------------------------------------------------

    @property
    def container_client(self) -> ContainerClient:
        return self._client

    @property
    def container_name(self) -> str:
        if self._container_name is not None:
            return self._container_name
        return str(self._client.container_name)

    def blob_name(self, key: str) -> str:
        """The blob path of poller ``key``: ``{prefix}/{app_name}/{key}.json``."""
        return f"{self.prefix}/{self.app_name}/{validate_name(key, 'poller name')}.json"

    def _where(self, op: str, blob: str) -> str:
        if not blob:
            return f"{op} of container {self.container_name}"
        return f"{op} of blob {self.container_name}/{blob}"

    def _translated(self, op: str, blob: str) -> contextlib.AbstractContextManager[None]:
        """Map Azure SDK failures of ``op`` (read/write/delete/list) onto the store errors
        (:mod:`dbtrigger._azure_errors`: one policy for Blob, Table and Queue)."""
        missing = (
            f"container {self.container_name!r} does not exist in {self._account()}; create "
            "it, or pass create_container=True"
        )
        return azure_errors.mapped(
            azure_errors.BLOB,
            self._where(op, blob),
            write=op in ("write", "delete"),
            missing={"ContainerNotFound": missing},
            credential=self.credential_words,
        )

    def _account(self) -> str:
        name = getattr(peek(self._client_source), "account_name", None)
        return f"storage account {name!r}" if name else "the storage account"

    def _missing_container_is_empty(self, exc: ResourceNotFoundError) -> bool:
        """A 404 means "no document" unless it is a missing container we must report."""
        return not _container_missing(exc) or self._create_container

    def _ensure_container(self) -> None:
        with self._translated("create", ""), contextlib.suppress(ResourceExistsError):
            self._client.create_container()
            log.info(
                "created blob container %s",
                self.container_name,
                extra={"event": "container_created", "container": self.container_name},
            )

    # --- the port ---------------------------------------------------------------

    def read(self, key: str) -> StoredDocument | None:
        blob = self.blob_name(key)
        with self._translated("read", blob):
            try:
                downloader = self._client.get_blob_client(blob).download_blob(
                    max_concurrency=1, **self._call_options
                )
                data = downloader.readall()
            except ResourceNotFoundError as exc:
                if not self._missing_container_is_empty(exc):
                    raise
                return None
            return StoredDocument(bytes(data), str(downloader.properties.etag))

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        blob = self.blob_name(key)
        condition: dict[str, Any] = (
            {"match_condition": MatchConditions.IfMissing}
            if if_match is None
            else {"etag": if_match, "match_condition": MatchConditions.IfNotModified}
        )
        client = self._client.get_blob_client(blob)

        def put() -> dict[str, Any]:
            result: dict[str, Any] = client.upload_blob(
                bytes(data),
                overwrite=True,  # the match condition, not this flag, decides
                content_settings=_JSON,
                retry_total=0,
                **condition,
                **self._call_options,
            )
            return result

        with self._translated("write", blob):
            try:
                result = put()
            except ResourceNotFoundError as exc:
                if not (_container_missing(exc) and self._create_container):
                    raise
                self._ensure_container()
                result = put()
        return str(result["etag"])

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        blob = self.blob_name(key)
        condition: dict[str, Any] = (
            {}
            if if_match is None
            else {"etag": if_match, "match_condition": MatchConditions.IfNotModified}
        )
        with self._translated("delete", blob):
            try:
                self._client.delete_blob(blob, retry_total=0, **condition, **self._call_options)
            except ResourceNotFoundError as exc:
                if not self._missing_container_is_empty(exc):
                    raise

    def list_keys(self) -> list[str]:
        start = f"{self.prefix}/{self.app_name}/"
        with self._translated("list", start + "*"):
            try:
                names = [
                    b.name
                    for b in self._client.list_blobs(name_starts_with=start, **self._call_options)
                ]
            except ResourceNotFoundError as exc:
                if not self._missing_container_is_empty(exc):
                    raise
                return []
        keys = []
        for name in names:
            rest = name[len(start) :]
            if rest.endswith(".json") and "/" not in rest:
                keys.append(rest[: -len(".json")])
        return sorted(keys)

    def describe(self) -> str:
        """Where the state blobs are; never raises (settings not resolvable are named)."""
        try:
            where = _safe_url(str(self._client.url))
        except ConfigurationError:
            where = f"({self._unresolved()}, unresolved)/{self.container_name}"
        app = self._app_name or self._app_name_spec
        return f"azure-blob:{where}/{self.prefix}/{app}/"
