"""What a stored position means, as a hash: the source fingerprint.

A checkpoint is only meaningful for the rows it was taken over: the same
database, table (or query), cursor, keys and filter. The fingerprint hashes
exactly that, and nothing about *how we connect*: the driver
(``postgresql://`` vs ``postgresql+psycopg://``), TLS and timeout options,
an explicitly written default port, ``localhost`` vs ``127.0.0.1``, the
password, and the default schema spelled out (``schema="public"``). Counting
those as a different source stopped pollers after harmless configuration edits
(a password rotation, adding ``?sslmode=require``), with no safe way forward.

Query options not known to be connection-only stay in: an unknown option might
change what is read (``options=-c search_path=...`` does), and a fingerprint
that changes needlessly costs an explicit ``reset``, while one that fails to
change would silently resume from a checkpoint that means something else.

:func:`legacy_fingerprint` is the algorithm before this normalisation. State
documents written by it stay valid: :meth:`SqlAlchemySource.accepted_fingerprints`
lists both, and the next commit rewrites the document with the current one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import URL

from dbtrigger.cursor import canonical_json, encode_value
from dbtrigger.redaction import is_secret_option, without_secret_fields

#: Ports a URL may spell out without naming a different server.
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306, "mssql": 1433, "oracle": 1521}

#: Hosts that all mean "this machine" (a TCP loopback connection).
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})

#: Schemas a table lands in when none is named, per dialect.
DEFAULT_SCHEMAS = {"postgresql": "public", "mssql": "dbo"}

#: Query options that only change how the connection is made, never what is read.
CONNECTION_ONLY_OPTIONS = frozenset(
    {
        "application_name",
        "channel_binding",
        "charset",
        "client_encoding",
        "connect_timeout",
        "fallback_application_name",
        "gssencmode",
        "keepalives",
        "keepalives_count",
        "keepalives_idle",
        "keepalives_interval",
        "load_balance_hosts",
        "read_timeout",
        "ssl",
        "ssl_ca",
        "ssl_cert",
        "ssl_check_hostname",
        "ssl_disabled",
        "ssl_key",
        "ssl_verify_cert",
        "ssl_verify_identity",
        "sslcert",
        "sslcompression",
        "sslcrl",
        "sslkey",
        "sslmode",
        "sslnegotiation",
        "sslrootcert",
        "sslsni",
        "target_session_attrs",
        "tcp_user_timeout",
        "timeout",
        "write_timeout",
        "encrypt",
        "trustservercertificate",
        "login_timeout",
        "driver",
    }
)


def _without_secrets(value: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """An option's value less the credential fields of a connection string in it."""
    if isinstance(value, str):
        return without_secret_fields(value, None)[0]
    return tuple(without_secret_fields(v, None)[0] for v in value)


def identity_url(url: URL, *, _fields_kept: bool = False) -> dict[str, Any]:
    """The parts of a URL that say *which data* it reaches, normalised.

    No credential is part of it: not the password, not an option named like
    one, not a credential field of a connection string held by an option
    (``PWD=`` in ``odbc_connect``). ``_fields_kept`` gives the identity as it
    was before those fields were removed (see :func:`previous_fingerprints`).
    """
    backend = url.get_backend_name()
    host = (url.host or "").lower() or None
    if host in LOOPBACK:
        host = "localhost"
    port = url.port
    if port is not None and DEFAULT_PORTS.get(backend) == port:
        port = None
    query = {
        k.lower(): v if _fields_kept else _without_secrets(v)
        for k, v in url.query.items()
        if k.lower() not in CONNECTION_ONLY_OPTIONS and not is_secret_option(k)
    }
    return {
        "backend": backend,
        "host": host,
        "port": port,
        "user": url.username,
        "database": url.database,
        "query": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(query.items())},
    }


def identity_schema(backend: str, schema: str | None, database: str | None) -> str | None:
    """``None`` for the schema a table lands in anyway (``public``, ``dbo``, MySQL's database)."""
    if schema is None:
        return None
    if DEFAULT_SCHEMAS.get(backend) == schema:
        return None
    if backend in ("mysql", "mariadb") and schema == database:
        return None
    return schema


def _parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(encode_value(v)) for k, v in sorted(parameters.items())}


def _digest(definition: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(definition).encode()).hexdigest()


@dataclass(frozen=True)
class Definition:
    """What a keyset source reads: the part of its configuration a fingerprint hashes.

    ``deleted`` is the soft-delete marking (column and encoded value), present
    only when configured so that other sources' fingerprints do not depend on it.
    """

    schema: str | None
    table: str | None
    query: str | None
    cursor_column: str
    pk_columns: Sequence[str]
    where: str | None
    parameters: Mapping[str, Any]
    deleted: Any = None

    def keyset(self) -> dict[str, Any]:
        """The fields every version of the fingerprint hashes as they are."""
        fields: dict[str, Any] = {
            "table": self.table,
            "query": self.query,
            "cursor_column": self.cursor_column,
            "pk_columns": list(self.pk_columns),
            "where": self.where,
            "parameters": _parameters(self.parameters),
        }
        if self.deleted is not None:
            fields["deleted"] = self.deleted
        return fields


def source_fingerprint(url: URL, definition: Definition) -> str:
    """The fingerprint of a definition (version 2: connection details normalised away)."""
    target = identity_url(url)
    schema = identity_schema(target["backend"], definition.schema, url.database)
    return _digest(
        {"fingerprint_version": 2, "source": target, "schema": schema, **definition.keyset()}
    )


def legacy_fingerprint(safe_url: str, definition: Definition) -> str:
    """The fingerprint as written before version 2 (the password-free URL text, verbatim)."""
    return _digest({"url": safe_url, "schema": definition.schema, **definition.keyset()})


def previous_fingerprints(url: URL, definition: Definition) -> tuple[str, ...]:
    """What earlier versions gave this definition, to recognise documents they wrote.

    Version 1 hashed the URL as it was shown then (verbatim); and until the
    credential fields of an option holding a connection string
    (``odbc_connect=...;PWD=...``) were removed, both versions hashed those
    fields. Only ever compared with a stored fingerprint, never written: the
    next commit writes :func:`source_fingerprint`.
    """
    query = {k: v for k, v in url.query.items() if not is_secret_option(k)}
    shown_then = url.set(password=None, query=query).render_as_string(hide_password=True)
    found = [legacy_fingerprint(shown_then, definition)]
    kept = identity_url(url, _fields_kept=True)
    if kept != identity_url(url):
        schema = identity_schema(kept["backend"], definition.schema, url.database)
        found.append(
            _digest(
                {"fingerprint_version": 2, "source": kept, "schema": schema, **definition.keyset()}
            )
        )
    return tuple(found)


#: Texts (a query, a filter) longer than this are kept as a start and a digest.
_TEXT_LIMIT = 300


def _digest_short(value: Any) -> str:
    """A value that may be sensitive (a bind parameter, a URL option), as a short digest."""
    return "sha256:" + hashlib.sha256(canonical_json(value).encode()).hexdigest()[:16]


def _readable_text(text: str | None) -> str | None:
    if text is None or len(text) <= _TEXT_LIMIT:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[:120]}... ({len(text)} characters, sha256:{digest})"


def readable_definition(url: URL, definition: Definition) -> dict[str, Any]:
    """What :func:`source_fingerprint` hashes, readable and secret-free, with the hash.

    Kept in the state document (``source_definition``) so that a changed
    definition can be *shown* (``reset --accept-source`` dry run, the mismatch
    error), not only detected. No secret goes in: the URL is the fingerprint's
    normalised identity (no password, no secret-looking or connection-only
    option), parameter and URL option values are replaced by digests (their
    names stay readable), and a long query or
    filter by its start and a digest. ``fingerprint`` says which definition
    this is: a document whose fingerprint was changed by a dbtrigger that did
    not know this field keeps a stale copy, which readers must ignore.
    """
    d = definition
    target = identity_url(url)
    out: dict[str, Any] = {
        "fingerprint": source_fingerprint(url, d),
        "dialect": target["backend"],
        "host": target["host"],
        # (The fingerprint leaves a default port out; shown, it is the number.)
        "port": target["port"] or DEFAULT_PORTS.get(target["backend"]),
        "user": target["user"],
        "database": target["database"],
        "url_options": {name: _digest_short(value) for name, value in target["query"].items()},
        "schema": identity_schema(target["backend"], d.schema, url.database),
        "table": d.table,
        "query": _readable_text(d.query),
        "cursor_column": d.cursor_column,
        "pk_columns": list(d.pk_columns),
        "where": _readable_text(d.where),
        "parameters": {
            name: _digest_short(value) for name, value in _parameters(d.parameters).items()
        },
    }
    if d.deleted is not None:
        out["deleted"] = d.deleted
    return out


__all__ = [
    "CONNECTION_ONLY_OPTIONS",
    "Definition",
    "identity_schema",
    "identity_url",
    "legacy_fingerprint",
    "previous_fingerprints",
    "readable_definition",
    "source_fingerprint",
]
