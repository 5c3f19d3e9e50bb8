"""Passwordless database access: a SQLAlchemy engine that logs in with Microsoft Entra ID.

For a Function App with a managed identity, so that no database password is
kept in its settings. The engine is passed as ``engine=`` to a source, a
store, a claim queue or ``@db.output``.
"""

from __future__ import annotations

import struct
from typing import Any

from sqlalchemy.engine import Engine

from dbtrigger.errors import ConfigurationError

#: Token scopes of Microsoft Entra ID for the Azure database services.
ENTRA_SCOPES = {
    "postgresql": "https://ossrdbms-aad.database.windows.net/.default",
    "mysql": "https://ossrdbms-aad.database.windows.net/.default",
    "mariadb": "https://ossrdbms-aad.database.windows.net/.default",
    "mssql": "https://database.windows.net/.default",
}
#: pyodbc connection attribute that carries an access token (msodbcsql.h).
SQL_COPT_SS_ACCESS_TOKEN = 1256


def entra_id_engine(
    url: str, *, credential: Any = None, scope: str | None = None, **engine_kwargs: Any
) -> Engine:
    """A SQLAlchemy engine that logs in with a Microsoft Entra ID access token.

    Each new connection asks ``credential`` (default
    ``azure.identity.DefaultAzureCredential()``: the managed identity in Azure,
    ``az login`` locally) for a token: the password for PostgreSQL and MySQL,
    the ODBC access-token attribute for Azure SQL (``mssql+pyodbc``). Pass the
    engine as ``engine=`` to a source, a store or ``db.output``; the URL holds
    no secret. ``pool_recycle`` defaults to 1800 s so pooled connections are
    reopened with a fresh token well within its lifetime.

    Raises:
        ConfigurationError: the dialect has no known Entra ID login and no
            ``scope`` was given.
    """
    import sqlalchemy as sa  # noqa: PLC0415 - only this helper needs the event API

    from dbtrigger._engine import create_engine, parse_database_url  # noqa: PLC0415

    parsed = parse_database_url(url)
    dialect = parsed.get_backend_name()
    token_scope = scope or ENTRA_SCOPES.get(dialect)
    if token_scope is None:
        raise ConfigurationError(
            f"no Entra ID login is known for {dialect}; pass scope= and a do_connect listener"
        )
    if credential is None:
        from azure.identity import DefaultAzureCredential  # noqa: PLC0415 - optional extra

        credential = DefaultAzureCredential()
    engine = create_engine(parsed, **{"pool_pre_ping": True, "pool_recycle": 1800, **engine_kwargs})

    @sa.event.listens_for(engine, "do_connect")
    def _token_login(dialect_: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        del dialect_, record, cargs
        token = credential.get_token(token_scope).token
        if dialect == "mssql":
            raw = token.encode("utf-16-le")
            cparams["attrs_before"] = {
                SQL_COPT_SS_ACCESS_TOKEN: struct.pack(f"<I{len(raw)}s", len(raw), raw)
            }
        else:
            cparams["password"] = token

    return engine


__all__ = ["ENTRA_SCOPES", "SQL_COPT_SS_ACCESS_TOKEN", "entra_id_engine"]
