"""Azure Table Storage checkpoint store: one entity per poller.

For deployments that already have a storage account and prefer a table of
small entities to a container of blobs (one ``query`` lists every poller of an
app, and Storage Explorer shows the checkpoints as rows).

Layout: table ``dbtriggerstate`` (configurable), PartitionKey = app name,
RowKey = poller name. The state document is kept as text in string properties
``doc_0`` ... ``doc_{n-1}``, with ``doc_parts`` (n) and ``doc_bytes`` (its UTF-8
length, checked on every read so a truncated entity is reported as corrupt,
never parsed as a shorter document).

Why several properties: a string property holds at most 64 KiB, counted in
UTF-16 (32,768 code units), while one entity may hold up to 1 MiB in total. So
a document is split every 32,768 UTF-16 units (never inside a surrogate pair)
and the whole entity is measured before sending with the service's own size
formula. Every character of a string costs two bytes there, which makes the
practical ceiling about **511 KiB of ASCII JSON per poller**
(:data:`MAX_ENTITY_BYTES` minus per-property overhead). The state document
with its default journal is a few kilobytes. A larger document is refused with
:class:`~dbtrigger.errors.UnsupportedDocumentError` before any request, instead
of surfacing as a 400 from the service. Documents must be UTF-8 text, as every
state document is.

Compare-and-swap uses the service's etag: create with ``create_entity`` (409
``EntityAlreadyExists`` means another creator won), update with
``update_entity(mode=REPLACE, etag=..., match_condition=IfNotModified)`` (412
means the etag is stale). REPLACE, not MERGE, so the ``doc_k`` properties of a
previously longer document disappear. The service issues a new etag on every
write, including a write of identical content.

Writes are sent with read and status retries turned off: a conditional write
that landed but whose answer was lost would, if retried, fail its own
precondition and be misreported as a lost race. Instead a lost answer (or a
5xx other than 503, which may have been processed) is
:class:`~dbtrigger.errors.AmbiguousWriteError`, which the poller resolves by
re-reading. Connection errors, raised before the request was sent, are still
retried. Errors are sorted by the mapper the Blob store and the Queue glue
share (:mod:`dbtrigger._azure_errors`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.data.tables import TableClient, UpdateMode

from dbtrigger import _azure_errors as azure_errors
from dbtrigger import options as opt
from dbtrigger._once import Once
from dbtrigger.errors import (
    CasConflictError,
    ConfigurationError,
    CorruptStateError,
    DbTriggerError,
    StoreError,
    UnsafeIdentifierError,
    UnsupportedDocumentError,
)
from dbtrigger.names import validate_name
from dbtrigger.redaction import redact, remember_connection_string
from dbtrigger.settings import Deferred, references_setting, resolve_setting
from dbtrigger.state import sizes
from dbtrigger.state.stores._sdk_client import SdkClientHolder
from dbtrigger.state.stores.base import StoredDocument, document_text

#: The service's limit for one entity, all properties and keys included.
MAX_ENTITY_BYTES = 1024 * 1024
#: About the largest (ASCII) document an entity holds: strings count 2 bytes a character.
MAX_DOCUMENT_BYTES = MAX_ENTITY_BYTES // 2 - 4 * 1024
#: The service's limit for one string property, in UTF-16 code units (64 KiB).
MAX_PROPERTY_UNITS = 32 * 1024

_TABLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]{2,62}$")
_SERVICE_ETAG = re.compile(r"^W/\"datetime'[^']+'\"$")
_WRITE_RETRIES = {"retry_read": 0, "retry_status": 0}


def _utf16_units(text: str) -> int:
    if text.isascii():
        return len(text)
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)


def split_text(text: str, units: int = MAX_PROPERTY_UNITS) -> list[str]:
    """Split ``text`` into pieces of at most ``units`` UTF-16 code units each.

    Pieces never end between the two halves of a surrogate pair (characters
    outside the Basic Multilingual Plane count as two units). Always returns at
    least one piece, so an empty document is one empty property.
    """
    if text.isascii():
        return [text[i : i + units] for i in range(0, len(text), units)] or [""]
    pieces: list[str] = []
    start = 0
    used = 0
    for i, ch in enumerate(text):
        width = 2 if ord(ch) > 0xFFFF else 1
        if used + width > units:
            pieces.append(text[start:i])
            start, used = i, 0
        used += width
    pieces.append(text[start:])
    return pieces


def entity_size(entity: Mapping[str, Any]) -> int:
    """An entity's size as the service counts it toward :data:`MAX_ENTITY_BYTES`.

    4 bytes, plus 2 per character of PartitionKey and RowKey, plus for every
    other property 8 bytes + 2 per character of its name + the value's size
    (strings: 4 + 2 per UTF-16 unit; 32-bit ints 4; 64-bit ints, doubles and
    times 8). The service-maintained ``Timestamp`` is included.
    """
    size = 4 + 2 * _utf16_units(entity["PartitionKey"]) + 2 * _utf16_units(entity["RowKey"])
    size += 8 + 2 * len("Timestamp") + 8
    for name, value in entity.items():
        if name in ("PartitionKey", "RowKey"):
            continue
        size += 8 + 2 * _utf16_units(name)
        if isinstance(value, str):
            size += 4 + 2 * _utf16_units(value)
        elif isinstance(value, bool):
            size += 1
        elif isinstance(value, int):
            size += 4 if -(2**31) <= value < 2**31 else 8
        else:
            size += 8
    return size


class TableCheckpointStore(SdkClientHolder[TableClient]):
    """State documents as entities of one Azure Storage table.

    Give exactly one of:

    * ``connection_string``: a storage connection string, or a ``%APP_SETTING%``
      reference to one;
    * ``connection_setting``: the *name* of an app setting holding a connection
      string (``"AzureWebJobsStorage"``), the Functions binding convention;
    * ``endpoint`` (``https://<account>.table.core.windows.net``) with an
      optional ``credential`` (an ``AzureNamedKeyCredential``,
      ``AzureSasCredential`` or token credential; by default
      ``azure.identity.DefaultAzureCredential``, i.e. managed identity);
    * ``table_client``: an existing :class:`azure.data.tables.TableClient`.

    Args:
        table: table name (3-63 letters and digits, starting with a letter).
        app_name: the partition; pollers of different apps can share a table.
        create_table: create the table at the first write if it is missing (a
            read of a missing table finds no state and creates nothing).
        timeout_seconds: per-request read timeout (connecting gets at most 10 s).
        retries: retries of reads and of writes that never reached the service.
    """

    def __init__(
        self,
        *,
        connection_string: str | None = None,
        connection_setting: str | None = None,
        endpoint: str | None = None,
        credential: Any = None,
        table_client: TableClient | None = None,
        table: str = "dbtriggerstate",
        app_name: str = "default",
        create_table: bool = True,
        timeout_seconds: float = 30,
        retries: int = 3,
    ) -> None:
        given = [
            n
            for n, v in (
                ("connection_string", connection_string),
                ("connection_setting", connection_setting),
                ("endpoint", endpoint),
                ("table_client", table_client),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ConfigurationError(
                "TableCheckpointStore needs exactly one of connection_string=, "
                f"connection_setting=, endpoint= or table_client= (got {given or 'none'})"
            )
        if not _TABLE_NAME.match(table):
            raise UnsafeIdentifierError(
                f"table {table!r} is not a valid Azure table name: 3-63 letters and digits, "
                "starting with a letter",
                name="table",
            )
        self._app = validate_name(app_name, "app name")
        self._create = create_table
        self._creation = Once(self._create_table, done=not create_table)
        timeout_seconds = opt.seconds("timeout_seconds", timeout_seconds)
        retries = opt.whole("retries", retries, minimum=0)
        transport: dict[str, Any] = {
            "connection_timeout": min(10.0, timeout_seconds),
            "read_timeout": timeout_seconds,
            "retry_total": retries,
        }
        self._table_name = table

        def from_endpoint() -> TableClient:
            url = resolve_setting(endpoint or "")
            cred = credential
            if cred is None and "sig" not in parse_qs(urlsplit(url).query):
                # A SAS in the endpoint authenticates by itself (see the blob store).
                from azure.identity import DefaultAzureCredential  # noqa: PLC0415 - optional

                cred = DefaultAzureCredential()
            try:
                return TableClient(endpoint=url, table_name=table, credential=cred, **transport)
            except ValueError as exc:  # the SDK's own refusals: a bad URL, a token over http
                parts = urlsplit(url)
                shown = f"{parts.scheme}://{parts.hostname or ''}"
                raise ConfigurationError(
                    f"table endpoint {shown} cannot be used: {redact(str(exc))}"
                ) from None

        def from_string() -> TableClient:
            if connection_setting is not None:
                conn = resolve_setting(f"%{connection_setting}%")
            else:
                conn = resolve_setting(connection_string or "")
            remember_connection_string(conn)  # its key or SAS is masked wherever echoed
            try:
                return TableClient.from_connection_string(conn, table_name=table, **transport)
            except ValueError:
                # The SDK's message may quote the connection string: never repeat it.
                where = f" in app setting {connection_setting!r}" if connection_setting else ""
                raise ConfigurationError(
                    f"the storage connection string{where} is malformed (its value is not shown)"
                ) from None

        # App settings are read at first use: in a Function App a missing one
        # fails the functions using this store, not the indexing of the app.
        if table_client is not None:
            self._client_source = table_client
        elif endpoint is not None:
            self._client_source = (
                Deferred(from_endpoint, f"app settings in {endpoint!r}")
                if references_setting(endpoint)
                else from_endpoint()
            )
        elif connection_setting is not None:
            self._client_source = Deferred(from_string, f"app setting {connection_setting!r}")
        elif references_setting(connection_string):
            self._client_source = Deferred(from_string, "app settings in the connection string")
        else:
            self._client_source = from_string()

    # --- identity ---------------------------------------------------------------------

    @property
    def table_client(self) -> TableClient:
        return self._client

    @property
    def app_name(self) -> str:
        return self._app

    def describe(self) -> str:
        """Where the documents are; never raises (unresolved settings are named)."""
        try:
            url = str(self._client.url).split("?", 1)[0]  # drop a SAS token, if any
        except ConfigurationError:
            url = f"({self._unresolved()}, unresolved)"
        return f"table:{url.rstrip('/')}/{self._table_name} partition={self._app}"

    # --- error edge ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _edge(
        self, action: str, key: str, *, write: bool = False, if_match: str | None = None
    ) -> Iterator[None]:
        """Translate azure-core failures into the store error tree, cause chained."""
        try:
            yield
        except DbTriggerError:
            raise
        except AzureError as exc:
            where = f"{action} of {key!r} in {self.describe()}"
            raise self._translate(where, key, exc, write=write, if_match=if_match) from exc

    def _translate(
        self, where: str, key: str, exc: AzureError, *, write: bool, if_match: str | None
    ) -> DbTriggerError:
        """The store error for an SDK error: the Table service's own two 400s here, the
        rest by the mapper Blob and Queue share (:mod:`dbtrigger._azure_errors`)."""
        status, code = azure_errors.status_of(exc), azure_errors.error_code(exc)
        # The service rejects an If-Match it could never have issued with 400
        # InvalidInput; such an etag cannot be current, so that is a lost CAS.
        # Only for etags of a foreign shape: a 400 on a service-shaped etag
        # is a genuine error and must not pass for contention.
        if (
            status == 400
            and code == "InvalidInput"
            and if_match is not None
            and not _SERVICE_ETAG.match(if_match)
        ):
            return CasConflictError(
                f"{key!r}: etag {if_match!r} was not issued by this table (etag mismatch)"
            )
        if status == 400 and code in ("EntityTooLarge", "PropertyValueTooLarge"):
            return UnsupportedDocumentError(f"{where}: {azure_errors.short(exc)}")
        missing = {"TableNotFound": f"table {self._table_name!r} does not exist"}
        return azure_errors.translate(
            exc,
            service=azure_errors.TABLE,
            where=where,
            write=write,
            missing=missing,
            credential=self.credential_words(),
        )

    def _ensure_table(self) -> None:
        self._creation.ensure()

    def _no_table_yet(self, exc: ResourceNotFoundError) -> bool:
        """Is ``exc`` the table missing, a table the first write will create? A read
        then finds no state (and creates nothing: ``dbtrigger status`` on a mistyped
        account or table must not leave an empty table behind)."""
        return (
            self._create
            and not self._creation.done
            and azure_errors.error_code(exc) == "TableNotFound"
        )

    def _create_table(self) -> None:
        # ResourceExistsError: someone (maybe another instance) created it first.
        with (
            self._edge("create table", self._table_name),
            contextlib.suppress(ResourceExistsError),
        ):
            self._client.create_table()

    # --- encoding -----------------------------------------------------------------------

    def _entity(self, key: str, data: bytes) -> dict[str, Any]:
        pieces = split_text(document_text(key, data, "table"))
        entity: dict[str, Any] = {
            "PartitionKey": self._app,
            "RowKey": key,
            "doc_parts": len(pieces),
            "doc_bytes": len(data),
        }
        entity.update((f"doc_{i}", piece) for i, piece in enumerate(pieces))
        size = entity_size(entity)
        if size > MAX_ENTITY_BYTES:
            raise UnsupportedDocumentError(
                f"document for {key!r} ({len(data)} bytes) would make a {size}-byte entity; "
                f"Azure Table entities hold at most {MAX_ENTITY_BYTES} bytes (strings count "
                f"2 bytes per character, so about {MAX_DOCUMENT_BYTES} bytes of document): "
                f"{sizes.explain(data)}"
            )
        return entity

    def _document(self, key: str, entity: Mapping[str, Any]) -> bytes:
        try:
            parts = int(entity["doc_parts"])
            text = "".join(str(entity[f"doc_{i}"]) for i in range(parts))
            expected = int(entity["doc_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptStateError(
                f"entity {self._app}/{key} in {self.describe()} is not a dbtrigger document "
                f"(a missing or malformed doc_parts, doc_bytes or doc_N property: {exc})"
            ) from None
        data = text.encode("utf-8")
        if len(data) != expected:
            raise CorruptStateError(
                f"entity {self._app}/{key} holds {len(data)} bytes but records {expected}"
            )
        return data

    # --- the port -----------------------------------------------------------------------

    def read(self, key: str) -> StoredDocument | None:
        validate_name(key, "poller name")
        with self._edge("read", key):
            try:
                entity = self._client.get_entity(self._app, key)
            except ResourceNotFoundError as exc:
                if azure_errors.error_code(exc) == "TableNotFound" and not self._no_table_yet(exc):
                    raise
                return None
        etag = str(entity.metadata["etag"])
        try:
            return StoredDocument(self._document(key, entity), etag)
        except CorruptStateError as exc:
            # What a `reset --from-file --force` needs to replace it: the etag, and
            # the entity's properties as the bytes it backs up.
            raw = json.dumps(dict(entity), default=str, sort_keys=True).encode()
            exc.stored = StoredDocument(raw, etag)  # type: ignore[attr-defined]
            raise

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        validate_name(key, "poller name")
        entity = self._entity(key, data)
        self._ensure_table()
        with self._edge("write", key, write=True, if_match=if_match):
            if if_match is None:
                meta = self._client.create_entity(entity, **_WRITE_RETRIES)
            else:
                meta = self._client.update_entity(
                    entity,
                    mode=UpdateMode.REPLACE,
                    etag=if_match,
                    match_condition=MatchConditions.IfNotModified,
                    **_WRITE_RETRIES,
                )
        etag = meta.get("etag")
        if not etag:
            raise StoreError(f"the service accepted the write of {key!r} but returned no etag")
        return str(etag)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        validate_name(key, "poller name")
        condition = (
            MatchConditions.Unconditionally if if_match is None else MatchConditions.IfNotModified
        )
        with self._edge("delete", key, write=True, if_match=if_match):
            # The SDK treats 404 (already absent) as success; no table: nothing to delete.
            try:
                self._client.delete_entity(
                    self._app, key, etag=if_match, match_condition=condition, **_WRITE_RETRIES
                )
            except ResourceNotFoundError as exc:
                if not self._no_table_yet(exc):
                    raise

    def list_keys(self) -> list[str]:
        with self._edge("listing", "*"):
            entities = self._client.query_entities(
                "PartitionKey eq @app", parameters={"app": self._app}, select=["RowKey"]
            )
            try:
                return sorted(str(e["RowKey"]) for e in entities)
            except ResourceNotFoundError as exc:
                if not self._no_table_yet(exc):
                    raise
                return []
