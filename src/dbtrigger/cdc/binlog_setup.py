"""What a BinlogSource needs from a MariaDB/MySQL server, checked before it reads a byte.

A binary log is only useful for change capture when it carries every changed
row whole, with its column names:

* ``log_bin`` on (a restart with ``--log-bin``);
* ``binlog_format=ROW`` (``STATEMENT`` and ``MIXED`` log SQL text, not rows);
* ``binlog_row_image=FULL`` (``MINIMAL`` leaves unchanged columns out of
  updates and all but the key out of deletes);
* on MySQL 8 ``binlog_row_metadata=FULL``: without it the log has no column
  names and rows arrive as ``UNKNOWN_COL0``... (python-mysql-replication
  #612). MariaDB has the setting from 10.5; where it is not ``FULL`` the names
  are read from ``information_schema`` and every table map is checked against
  them (a column count or type that disagrees stops delivery, as a type change
  does).

Each missing setting is named in one :class:`~dbtrigger.errors.ServerSettingError`
with the statement that fixes it. Privileges are found by trying what the
source does (``SHOW BINARY LOGS``: ``REPLICATION CLIENT``; the binlog dump:
``REPLICATION SLAVE``; a ``SELECT`` of each table) and a refusal is a
:class:`~dbtrigger.errors.SourcePermissionError` with the ``GRANT`` to run.

A reader is a replica to the server and needs a ``server_id`` no other replica
(and not the server itself) uses: two readers with one id make the server drop
the older connection, each time the other one reads. :func:`default_server_id`
derives one from the poller's name.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pymysql
from sqlalchemy.engine import URL

from dbtrigger import options as opt
from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    FetchError,
    ServerSettingError,
    SourceDefinitionError,
    SourcePermissionError,
)
from dbtrigger.names import shortened
from dbtrigger.sources.errors_map import driver_mapped

#: MySQL/MariaDB error codes the setup translates itself.
ACCESS_DENIED = (1044, 1045, 1142, 1143, 1227, 1370)
#: Replica server ids are 32-bit; derived ones stay clear of the small ids people give servers.
SERVER_ID_FLOOR = 1 << 24
SERVER_ID_CEILING = (1 << 32) - 1
_NAME = re.compile(r"^[A-Za-z0-9_$]{1,64}$")


def translated(what: str) -> contextlib.AbstractContextManager[None]:
    """Map PyMySQL errors raised inside onto dbtrigger errors (cause chained)."""
    return driver_mapped(what, (pymysql.MySQLError, OSError), _socket_error)


def _socket_error(exc: BaseException, what: str) -> DbTriggerError | None:
    """A socket that failed outside PyMySQL's own errors: a retry."""
    return FetchError(f"{what} failed: {exc}") if isinstance(exc, OSError) else None


def connect_kwargs(url: URL) -> dict[str, Any]:
    """PyMySQL connection arguments of a ``mysql+pymysql://`` URL.

    Raises:
        ConfigurationError: not a MySQL/MariaDB URL.
    """
    if not url.drivername.startswith(("mysql", "mariadb")):
        raise ConfigurationError(
            f"BinlogSource needs a MariaDB/MySQL URL (mysql+pymysql://...), got {url.drivername}"
        )
    kwargs: dict[str, Any] = {
        "host": url.host or "127.0.0.1",
        "port": int(url.port or 3306),
        "user": url.username or "root",
        "password": url.password or "",
        "charset": "utf8mb4",
        "autocommit": True,
        "connect_timeout": 10,
        # A TIMESTAMP is read in the session's time zone; the log holds it in UTC (the
        # package's naive UTC). On a server whose time_zone is not UTC a snapshot chunk
        # (a query) otherwise gave another value for the row than its changes.
        "init_command": "SET time_zone = '+00:00'",
    }
    socket = url.query.get("unix_socket")
    if isinstance(socket, str):
        kwargs["unix_socket"] = socket
    return kwargs


class Connection(pymysql.connections.Connection):  # type: ignore[misc]
    """PyMySQL's connection, with its opportunistic TLS context built once per process.

    Given no TLS option, PyMySQL tries TLS if the server offers it (certificate
    not verified: no CA given) and builds a fresh ``ssl`` context for it on
    every connection, loading the system's CA store each time: tens of
    milliseconds of CPU, and a binlog read opens two connections (the dump and
    the library's catalog connection), so it was most of a quiet read's cost.
    The context is a pure function of those (empty) options, so one is kept.
    TLS options given in the URL build their own context as before.
    """

    def _create_ssl_ctx(self, sslp: Any) -> Any:
        if isinstance(sslp, dict) and not sslp:
            return _opportunistic_tls()
        return super()._create_ssl_ctx(sslp)


@functools.cache
def _opportunistic_tls() -> Any:
    return pymysql.connections.Connection._create_ssl_ctx(cast(Any, None), {})


def connect(url: URL, *, database: bool = True) -> pymysql.connections.Connection[Any]:
    """A short-lived autocommit session to the source's server."""
    kwargs = connect_kwargs(url)
    if database and url.database:
        kwargs["database"] = url.database
    with translated(f"connecting to {url.host}:{url.port or 3306}"):
        return Connection(**kwargs)


def replica_connect(**kwargs: Any) -> pymysql.connections.Connection[Any]:
    """The connect mysql-replication is given (it still passes the deprecated ``db=``)."""
    if "db" in kwargs:
        kwargs["database"] = kwargs.pop("db")
    return Connection(**kwargs)


def default_server_id(poller: str) -> int:
    """A replica ``server_id`` derived from a poller's name (stable, rarely shared).

    Two pollers on one server collide with a probability of about one in four
    billion per pair; pass ``server_id=`` to choose one yourself.
    """
    digest = int.from_bytes(hashlib.sha256(poller.encode()).digest()[:8], "big")
    return SERVER_ID_FLOOR + digest % (SERVER_ID_CEILING - SERVER_ID_FLOOR)


def validate_server_id(value: Any) -> int:
    return opt.whole("server_id", value, maximum=SERVER_ID_CEILING)


def default_reader_name(poller: str) -> str:
    """The reader's name in the control table: the poller's, made to fit 64 characters."""
    return shortened(poller, 64)


@dataclass(frozen=True, order=True)
class TableName:
    """A watched table: ``database.table``."""

    database: str
    name: str

    @property
    def qualified(self) -> str:
        return f"{self.database}.{self.name}"

    @property
    def quoted(self) -> str:
        return f"`{self.database}`.`{self.name}`"

    @classmethod
    def parse(cls, text: str, default_database: str | None) -> TableName:
        if not isinstance(text, str) or not text:
            raise ConfigurationError(f"a table name must be 'database.table' or 'table': {text!r}")
        database, _, name = text.rpartition(".")
        database = database or (default_database or "")
        if not database:
            raise ConfigurationError(
                f"table {text!r} names no database and the URL has none: write 'database.table'"
            )
        for part in (database, name):
            if not _NAME.match(part):
                raise ConfigurationError(
                    f"table {text!r}: {part!r} is not a plain identifier (letters, digits, _, $)"
                )
        return cls(database, name)


def parse_tables(tables: Sequence[str], default_database: str | None) -> list[TableName]:
    if isinstance(tables, str) or not tables:
        raise ConfigurationError("tables= must be a non-empty list of table names")
    return sorted({TableName.parse(t, default_database) for t in tables})


@dataclass
class TableInfo:
    """A watched table as ``information_schema`` describes it now."""

    table: TableName
    columns: list[tuple[str, str]]  # (name, DATA_TYPE) in ordinal order
    key_columns: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c[0] for c in self.columns)


def table_infos(
    conn: pymysql.connections.Connection[Any], tables: Sequence[TableName]
) -> dict[str, TableInfo]:
    """Columns and primary key of each table; a missing or unreadable table is refused.

    Raises:
        SourceDefinitionError: a table does not exist (create it, or correct ``tables=``).
        SourcePermissionError: a table cannot be read (with the GRANT to run).
    """
    out: dict[str, TableInfo] = {}
    with conn.cursor() as cur:
        for table in tables:
            with translated(f"reading the columns of {table.qualified}"):
                cur.execute(
                    "SELECT COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS "
                    "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
                    (table.database, table.name),
                )
                columns = [(str(r[0]), str(r[1]).lower()) for r in cur.fetchall()]
                cur.execute(
                    "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE "
                    "TABLE_SCHEMA = %s AND TABLE_NAME = %s AND CONSTRAINT_NAME = 'PRIMARY' "
                    "ORDER BY ORDINAL_POSITION",
                    (table.database, table.name),
                )
                keys = tuple(str(r[0]) for r in cur.fetchall())
            try:
                # Also what tells a table that is not there (1146) from one this
                # account may not see (1142), which information_schema hides alike.
                with translated(f"reading {table.qualified}"):
                    cur.execute(f"SELECT 1 FROM {table.quoted} LIMIT 0")  # noqa: S608 - validated
            except SourcePermissionError as exc:
                raise SourcePermissionError(
                    f"cannot read {table.qualified} (its initial snapshot and schema checks "
                    f"need SELECT): GRANT SELECT ON {table.quoted} TO {current_user(conn)}"
                ) from exc
            except SourceDefinitionError as exc:
                raise SourceDefinitionError(
                    f"table {table.qualified} does not exist: create it, or correct tables= "
                    "(DATABASE.TABLE, or a name in the URL's database)"
                ) from exc
            if not columns:  # readable, yet no column listed: not a base table's
                raise SourceDefinitionError(
                    f"{table.qualified} has no columns in information_schema (not a table?): "
                    "name a table in tables="
                )
            out[table.qualified] = TableInfo(table, columns, keys)
    return out


def current_user(conn: pymysql.connections.Connection[Any]) -> str:
    """``'user'@'host'`` as a GRANT names this session's account."""
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT CURRENT_USER()")
            row = cur.fetchone()
    except pymysql.MySQLError:
        return "'user'@'host'"
    user, _, host = str(row[0] if row else "user@host").rpartition("@")
    return f"'{user}'@'{host}'"


@dataclass
class ServerFacts:
    """The server settings that decide whether its binary log can be read for changes."""

    version: str
    log_bin: bool
    binlog_format: str
    binlog_row_image: str
    binlog_row_metadata: str | None
    server_id: int
    gtid_mode: str | None
    expire_seconds: float | None
    variables: dict[str, str] = field(default_factory=dict)

    @property
    def mariadb(self) -> bool:
        return "mariadb" in self.version.lower()

    @property
    def needs_row_metadata(self) -> bool:
        """MySQL 8 (which has the setting) cannot name columns without it."""
        return not self.mariadb and self.binlog_row_metadata is not None

    @property
    def names_from_log(self) -> bool:
        """Does the log carry column names (else ``information_schema`` is used)?"""
        return (self.binlog_row_metadata or "").upper() == "FULL"


def server_facts(conn: pymysql.connections.Connection[Any]) -> ServerFacts:
    names = (
        "version",
        "log_bin",
        "binlog_format",
        "binlog_row_image",
        "binlog_row_metadata",
        "server_id",
        "gtid_mode",
        "binlog_expire_logs_seconds",
        "expire_logs_days",
    )
    placeholders = ", ".join(["%s"] * len(names))
    with translated("reading the server's binary log settings"), conn.cursor() as cur:
        cur.execute(
            f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({placeholders})",
            names,
        )
        found = {str(k).lower(): str(v) for k, v in cur.fetchall()}
    expire: float | None = None
    seconds = float(found.get("binlog_expire_logs_seconds") or 0)
    days = float(found.get("expire_logs_days") or 0)
    if seconds > 0:
        expire = seconds
    elif days > 0:
        expire = days * 86400
    return ServerFacts(
        version=found.get("version", ""),
        log_bin=found.get("log_bin", "OFF").upper() in ("ON", "1"),
        binlog_format=found.get("binlog_format", "").upper(),
        binlog_row_image=found.get("binlog_row_image", "").upper(),
        binlog_row_metadata=found.get("binlog_row_metadata"),
        server_id=int(found.get("server_id") or 0),
        gtid_mode=found.get("gtid_mode"),
        expire_seconds=expire,
        variables=found,
    )


def setting_problems(facts: ServerFacts) -> list[str]:
    """Each setting that stops change capture, with how to set it."""
    out: list[str] = []
    if not facts.log_bin:
        out.append(
            "log_bin is OFF: the server writes no binary log. Start it with --log-bin "
            "(my.cnf [mysqld]: log_bin = mysql-bin); this needs a restart"
        )
    if facts.binlog_format != "ROW":
        out.append(
            f"binlog_format is {facts.binlog_format or 'unset'}, not ROW: the log holds SQL "
            "text, not rows. SET GLOBAL binlog_format = 'ROW'; and binlog_format = ROW in "
            "my.cnf [mysqld] (sessions started before keep the old format)"
        )
    if facts.binlog_row_image != "FULL":
        out.append(
            f"binlog_row_image is {facts.binlog_row_image or 'unset'}, not FULL: updates "
            "would miss unchanged columns and deletes all but the key. SET GLOBAL "
            "binlog_row_image = 'FULL'; and binlog_row_image = FULL in my.cnf [mysqld]"
        )
    if facts.needs_row_metadata and not facts.names_from_log:
        out.append(
            f"binlog_row_metadata is {facts.binlog_row_metadata}, not FULL: MySQL then writes "
            "no column names into the log. SET GLOBAL binlog_row_metadata = 'FULL'; and "
            "binlog_row_metadata = FULL in my.cnf [mysqld]"
        )
    if facts.server_id == 0:
        out.append(
            "server_id is 0: a server with server_id 0 refuses replicas. SET GLOBAL "
            "server_id = 1; (and server_id = 1 in my.cnf [mysqld])"
        )
    return out


def check_server(facts: ServerFacts) -> None:
    """Refuse a server whose binary log cannot carry changes (every problem at once).

    Raises:
        ServerSettingError: naming each setting and how to set it.
    """
    problems = setting_problems(facts)
    if problems:
        raise ServerSettingError(
            "the server is not set up for BinlogSource: " + "; ".join(problems)
        )


def binary_logs(conn: pymysql.connections.Connection[Any]) -> list[tuple[str, int]]:
    """``SHOW BINARY LOGS``: the files the server still has, oldest first, with sizes.

    Raises:
        SourcePermissionError: without ``REPLICATION CLIENT`` (``BINLOG MONITOR``), with the GRANT.
    """
    try:
        with translated("listing the binary logs (SHOW BINARY LOGS)"), conn.cursor() as cur:
            cur.execute("SHOW BINARY LOGS")
            rows = cur.fetchall()
    except SourcePermissionError as exc:
        raise SourcePermissionError(
            "this user may not list the binary logs, which BinlogSource needs to find its "
            f"position and check retention: GRANT REPLICATION CLIENT ON *.* TO "
            f"{current_user(conn)} (MariaDB 10.5+ also calls it BINLOG MONITOR)"
        ) from exc
    return [(str(r[0]), int(r[1])) for r in rows]


def current_position(
    conn: pymysql.connections.Connection[Any], files: Sequence[tuple[str, int]]
) -> tuple[str, int]:
    """Where the server writes its next transaction (``SHOW MASTER STATUS``)."""
    for statement in ("SHOW MASTER STATUS", "SHOW BINARY LOG STATUS"):
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
                row = cur.fetchone()
        except pymysql.MySQLError:
            continue
        if row:
            return str(row[0]), int(row[1])
    if files:
        return files[-1]
    raise ConfigurationError("the server reports no binary log position (is log_bin on?)")


def file_index(name: str) -> int:
    """The sequence number of a binlog file (``mysql-bin.000042`` -> 42)."""
    _, _, suffix = name.rpartition(".")
    if not suffix.isdigit():
        raise SourceDefinitionError(f"binary log file {name!r} has no numeric suffix")
    return int(suffix)


def replication_refused(conn_user: str) -> str:
    return (
        "the server refused to send its binary log to this user: GRANT REPLICATION SLAVE "
        f"ON *.* TO {conn_user} (MariaDB 10.5+ also calls it REPLICATION REPLICA)"
    )


# --- positions in the log ------------------------------------------------------------------


def beyond_end(files: list[tuple[str, int]], index: int, offset: int) -> bool:
    """Is file ``index`` offset ``offset`` past the end of the log ``files`` lists? Never
    in the log a position was read from: it was reset, or is another server's."""
    if not files:
        return False
    for name, size in files:
        if file_index(name) == index:
            return offset > size
    return index > file_index(files[-1][0])


def event_mark(event: Any) -> str:
    """A format description event's mark: ``server_id:created`` (epoch seconds)."""
    return f"{int(event.packet.server_id)}:{int(event.timestamp)}"


def mark_text(mark: str) -> str:
    server, _, seconds = mark.partition(":")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(seconds or 0)))
    return f"created {when} by server_id {server}"


__all__ = [
    "ServerFacts",
    "TableInfo",
    "TableName",
    "beyond_end",
    "binary_logs",
    "check_server",
    "connect",
    "connect_kwargs",
    "current_position",
    "current_user",
    "default_reader_name",
    "default_server_id",
    "event_mark",
    "file_index",
    "mark_text",
    "parse_tables",
    "replica_connect",
    "server_facts",
    "setting_problems",
    "table_infos",
    "translated",
    "validate_server_id",
]
