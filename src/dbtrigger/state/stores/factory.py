"""Open a checkpoint store from one URL-like string, and keep secrets out of output.

The CLI (and anything else configured by a single string, such as an
environment variable) names a store like this:

========================================  ==============================================
``./state``, ``/var/lib/x``, ``file:DIR`` :class:`FileCheckpointStore` in that directory
``memory:`` / ``memory:NAME``             a process-wide named in-memory store (tests)
``DefaultEndpointsProtocol=...;...``      BlobCheckpointStore from a connection string
``BlobEndpoint=...;SharedAccess...``      the same, from the portal's SAS form
``UseDevelopmentStorage=true``            the same, against the local emulator
``%SETTING%`` (the whole value)           the app setting's value, read once, as above
``azure-blob://ACCOUNT-HOST/CONTAINER``   BlobCheckpointStore with DefaultAzureCredential
``azure-table://ACCOUNT-HOST/TABLE``      TableCheckpointStore with DefaultAzureCredential
``azure-table:CONNECTION-STRING``         TableCheckpointStore from a connection string
``postgresql+psycopg://...`` (any SQL)    SqlCheckpointStore in that database
========================================  ==============================================

``?app=NAME`` on the ``azure-*`` forms (and ``?namespace=NAME`` on SQL URLs) picks
the application; the ``app`` argument gives the default. SQL URLs also take
``state_table`` and ``state_schema``; these options are removed before the URL
reaches the driver.

The Azure and SQL adapters are imported only when such a store is asked for, so
the file store works with none of their SDKs installed.

Redaction: every secret met while parsing (a URL password, an account key, a
SAS signature) is remembered, and :func:`~dbtrigger.redaction.redact` (re-exported
here) removes both those exact values and anything that looks like a credential
from text before it is shown.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

from dbtrigger.errors import ConfigurationError
from dbtrigger.redaction import redact, remember_connection_string, remember_secret
from dbtrigger.settings import environment, resolve_setting, setting_name
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.file import FileCheckpointStore
from dbtrigger.state.stores.memory import InMemoryCheckpointStore

DEFAULT_CONTAINER = "db-state"
DEFAULT_APP = "default"

_MEMORY: dict[str, InMemoryCheckpointStore] = {}
_LOCK = threading.Lock()

_CONNECTION_STRING = re.compile(
    r"(?i)\b(DefaultEndpointsProtocol|AccountName|AccountKey|BlobEndpoint|TableEndpoint"
    r"|SharedAccessSignature|UseDevelopmentStorage)\s*="
)
_CONNECTION_KEY = re.compile(
    r"(?i)DefaultEndpointsProtocol|AccountName|AccountKey|SharedAccessSignature"
    r"|UseDevelopmentStorage|EndpointSuffix|(?:Blob|Queue|File|Table|Dfs)Endpoint"
    r"|(?:Blob|Queue|File|Table)SecondaryEndpoint"
)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SQL_DIALECTS = frozenset(
    {"postgresql", "postgres", "mysql", "mariadb", "sqlite", "mssql", "oracle", "cockroachdb"}
)
_SQL_OPTIONS = ("state_table", "state_schema", "namespace", "app")

# Kept importable from here (their home used to be this module).
_remember_connection_string = remember_connection_string


def is_connection_string(value: str) -> bool:
    """True for ``Key=value;Key=value`` storage connection strings.

    Decided by the first field's *name*, not by the absence of ``://``: the
    portal's SAS form starts ``BlobEndpoint=https://...;`` and must not be taken
    for a directory or a URL.
    """
    first = value.split(";", 1)[0]
    name, sep, _ = first.partition("=")
    if sep and _CONNECTION_KEY.fullmatch(name.strip()):
        return True
    return bool(_CONNECTION_STRING.search(value)) and "://" not in first


def _lazy(module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigurationError(
            f"{what} is not available: {exc.msg} (install dbtrigger[azure] or the SQL driver)"
        ) from None


def memory_store(name: str = "") -> InMemoryCheckpointStore:
    """The process-wide in-memory store called ``name`` (created on first use)."""
    with _LOCK:
        store = _MEMORY.get(name)
        if store is None:
            store = _MEMORY[name] = InMemoryCheckpointStore()
        return store


def _query(url: str) -> tuple[str, dict[str, str]]:
    parts = urlsplit(url)
    return parts.netloc + parts.path, dict(parse_qsl(parts.query))


def _open_blob_connection_string(value: str, *, container: str, app: str) -> CheckpointStore:
    _remember_connection_string(value)
    module = _lazy("dbtrigger.state.stores.blob", "the Azure Blob checkpoint store")
    return cast(
        "CheckpointStore",
        module.BlobCheckpointStore.from_connection_string(
            value, container=container, app_name=app, create_container=False
        ),
    )


def _open_blob_url(spec: str, *, container: str, app: str) -> CheckpointStore:
    location, options = _query(spec)
    host, _, path = location.partition("/")
    if not host:
        raise ConfigurationError(
            "azure-blob:// needs an account host: azure-blob://ACCOUNT.blob.core.windows.net/"
            "CONTAINER?app=APP"
        )
    module = _lazy("dbtrigger.state.stores.blob", "the Azure Blob checkpoint store")
    return cast(
        "CheckpointStore",
        module.BlobCheckpointStore.from_account_url(
            f"https://{host}",
            container=path.strip("/") or container,
            app_name=options.get("app", app),
            create_container=False,
        ),
    )


def _open_table(spec: str, *, app: str, table: str | None) -> CheckpointStore:
    rest = spec[len("azure-table:") :]
    module = _lazy("dbtrigger.state.stores.table", "the Azure Table checkpoint store")
    kwargs: dict[str, Any] = {"app_name": app, "create_table": False}
    if table:
        kwargs["table"] = table
    if rest.startswith("//"):
        location, options = _query("azure-table:" + rest)
        host, _, path = location.partition("/")
        if not host:
            raise ConfigurationError("azure-table:// needs an account host")
        kwargs["app_name"] = options.get("app", app)
        if path.strip("/"):
            kwargs["table"] = path.strip("/")
        return cast(
            "CheckpointStore", module.TableCheckpointStore(endpoint=f"https://{host}", **kwargs)
        )
    value = resolve_setting(rest)
    _remember_connection_string(value)
    return cast("CheckpointStore", module.TableCheckpointStore(connection_string=value, **kwargs))


def _open_sql(spec: str, *, app: str) -> CheckpointStore:
    from dbtrigger._engine import parse_database_url  # noqa: PLC0415 - SQL stores only

    url = parse_database_url(spec, "state store URL")
    options = {k: url.query[k] for k in _SQL_OPTIONS if k in url.query}
    url = url.difference_update_query(_SQL_OPTIONS)
    database = url.database or ""
    if (
        url.get_backend_name() == "sqlite"
        and database not in ("", ":memory:")
        and not database.startswith("file:")
        and not Path(database).exists()
    ):
        # SQLite would create an empty file on connect; the CLI never creates stores.
        raise ConfigurationError(f"no SQLite state database at {database}")
    module = _lazy("dbtrigger.state.stores.sql", "the SQL checkpoint store")
    kwargs: dict[str, Any] = {
        "namespace": options.get("namespace") or options.get("app") or app,
        "create_table": False,
    }
    if "state_table" in options:
        kwargs["table"] = options["state_table"]
    if "state_schema" in options:
        kwargs["schema"] = options["state_schema"]
    store: CheckpointStore = module.SqlCheckpointStore(
        url=url.render_as_string(hide_password=False), **kwargs
    )
    return store


#: ``<setting>__<suffix>``: a Functions identity-based connection.
_IDENTITY_SUFFIXES = ("blobServiceUri", "serviceUri", "accountName")


def open_store(
    spec: str,
    *,
    app: str | None = None,
    container: str | None = None,
    table: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> CheckpointStore:
    """The checkpoint store ``spec`` names (see the module docstring for forms).

    Raises:
        ConfigurationError: the form is not recognised or its adapter is not
            installed; the message never contains the secret parts of ``spec``.
    """
    app = app or DEFAULT_APP
    container = container or DEFAULT_CONTAINER
    spec = spec.strip()
    if not spec:
        raise ConfigurationError("empty store location")
    name = setting_name(spec)
    if name is not None:
        env = environment(environ)
        if name not in env and any(f"{name}__{suffix}" in env for suffix in _IDENTITY_SUFFIXES):
            # A Functions identity-based connection: the blob store resolves it.
            return _open_blob_connection_string(name, container=container, app=app)
        value = resolve_setting(spec, environ).strip()
        _remember_connection_string(value)
        if not value:
            raise ConfigurationError(f"app setting {name!r} is empty: it names no store")
        # The setting's value is the location, read once: it is not resolved again.
        return _open_location(value, app=app, container=container, table=table)
    env = environment(environ)
    if (
        any(key in env for key in (spec, *(f"{spec}__{s}" for s in _IDENTITY_SUFFIXES)))
        and not Path(spec).exists()
    ):
        # `--store AzureWebJobsStorage` would be a directory of that name, empty.
        raise ConfigurationError(
            f"store {spec!r} is read as a directory, and there is none; to use the app "
            f"setting {spec}, write it as %{spec}%"
        )
    return _open_location(spec, app=app, container=container, table=table)


def _open_location(spec: str, *, app: str, container: str, table: str | None) -> CheckpointStore:
    """The store at a concrete location (no app setting left to read)."""
    if spec.startswith("memory:"):
        return memory_store(spec[len("memory:") :])
    if spec.startswith("file:") and not spec.startswith("file://"):
        return FileCheckpointStore(spec[len("file:") :], create=False)
    if spec.startswith("file://"):
        return FileCheckpointStore(urlsplit(spec).path, create=False)
    if spec.startswith("azure-table:"):
        return _open_table(spec, app=app, table=table)
    if spec.startswith("azure-blob://"):
        return _open_blob_url(spec, container=container, app=app)
    if is_connection_string(spec):
        return _open_blob_connection_string(spec, container=container, app=app)
    scheme = _SCHEME.match(spec)
    if scheme:
        dialect = scheme.group(1).split("+", 1)[0].lower()
        if dialect in _SQL_DIALECTS:
            return _open_sql(spec, app=app)
        raise ConfigurationError(
            f"unknown store scheme {scheme.group(1)!r}: use a directory, file:DIR, memory:, "
            "an Azure connection string, azure-blob://, azure-table:// or a SQL URL"
        )
    return FileCheckpointStore(spec, create=False)


def describe_store(store: CheckpointStore) -> str:
    """The store's own description, redacted once more for good measure."""
    return redact(store.describe())


__all__ = [
    "DEFAULT_APP",
    "DEFAULT_CONTAINER",
    "describe_store",
    "is_connection_string",
    "memory_store",
    "open_store",
    "redact",
    "remember_secret",
]
