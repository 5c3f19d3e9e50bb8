"""Private database servers for the log-capture tests, started once per test session.

The shared PostgreSQL on 5432 runs with ``wal_level=replica`` and must never be
reconfigured, so the tests of :mod:`dbtrigger.cdc` start a server of their own
from the installed binaries (``scripts/cdc-servers.sh``, the same script the
docs give users) on a free port, in a temporary directory, and stop it when
the session ends. Each test gets a database of its own on it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cdc-servers.sh"
BASH = shutil.which("bash") or "/bin/bash"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LogicalPostgres:
    """A running private PostgreSQL with ``wal_level=logical``."""

    port: int
    directory: Path
    databases: list[str] = field(default_factory=list)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def conninfo(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def connect(self, database: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo(database), autocommit=True, **kwargs)

    def create_database(self) -> str:
        name = f"cdc_{uuid.uuid4().hex[:10]}"
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        return name

    def drop_database(self, name: str) -> None:
        with self.connect() as conn:
            # Slots are per database but named cluster-wide: drop this database's first.
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                drop_slot(conn, slot)
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def set_config(self, name: str, value: str | None) -> None:
        """Change a server setting of this private server (``None``: back to the default)."""
        with self.connect() as conn:
            if value is None:
                conn.execute(f"ALTER SYSTEM RESET {name}")
            else:
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
            conn.execute("SELECT pg_reload_conf()")


def drop_slot(conn: psycopg.Connection[Any], slot: str, timeout: float = 30.0) -> None:
    """Drop ``slot``, ending the session that holds it first.

    A walsender ends some time after ``pg_terminate_backend`` returns (or after a
    stream's client closed its connection), and until then the slot is active:
    the drop failed, and with the slot left DROP DATABASE failed too ("used by an
    active logical replication slot", a teardown error of the stream contract
    tests about one run in two). So the drop is retried until the slot is free.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE slot_name = %s AND active_pid IS NOT NULL",
                (slot,),
            )
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return
        except psycopg.errors.ObjectInUse:
            if time.monotonic() > deadline:
                return  # DROP DATABASE says so
            time.sleep(0.05)
        except psycopg.Error:
            return  # gone already (or DROP DATABASE says what it is)


def start_logical_postgres() -> Iterator[LogicalPostgres]:
    directory = Path(tempfile.mkdtemp(prefix="dbtrigger-cdc-pg-"))
    port = free_port()
    started = subprocess.run(
        [BASH, str(SCRIPT), "start", "postgres", str(directory), str(port)],
        capture_output=True,
        text=True,
        check=False,
    )
    if started.returncode != 0:
        log = directory / "server.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        shutil.rmtree(directory, ignore_errors=True)
        pytest.fail(
            f"could not start a private PostgreSQL (wal_level=logical) with {SCRIPT}: "
            f"{started.stderr.strip()} {tail}",
            pytrace=False,
        )
    server = LogicalPostgres(port, directory)
    try:
        yield server
    finally:
        subprocess.run(
            [BASH, str(SCRIPT), "stop", "postgres", str(directory)],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class CdcDatabase:
    """One test's database on the private server."""

    server: LogicalPostgres
    name: str

    @property
    def url(self) -> str:
        return self.server.url(self.name)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return self.server.connect(self.name, **kwargs)

    def execute(self, sql: str, params: Any = None) -> None:
        with self.connect() as conn:
            conn.execute(sql, params)

    def scalar(self, sql: str, params: Any = None) -> Any:
        with self.connect() as conn:
            row = conn.execute(sql, params).fetchone()
            return None if row is None else row[0]


def cdc_database(server: LogicalPostgres) -> Iterator[CdcDatabase]:
    name = server.create_database()
    try:
        yield CdcDatabase(server, name)
    finally:
        server.drop_database(name)


# --- MariaDB with a binary log (BinlogSource) ---------------------------------------------


@dataclass
class BinlogMariadb:
    """A running private MariaDB with ``--log-bin``, ``binlog_format=ROW``, full row images."""

    port: int
    directory: Path
    databases: list[str] = field(default_factory=list)

    def url(self, database: str = "mysql", user: str = "root", password: str = "") -> str:
        auth = f"{user}:{password}" if password else user
        return f"mysql+pymysql://{auth}@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str | None = None, **kwargs: Any) -> pymysql.Connection[Any]:
        options: dict[str, Any] = {"autocommit": True, "charset": "utf8mb4"}
        options.update(kwargs)
        return pymysql.connect(
            host="127.0.0.1", port=self.port, user="root", database=database, **options
        )

    def execute(self, sql: str, params: Any = None, database: str | None = None) -> None:
        conn = self.connect(database)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
        finally:
            conn.close()

    def scalar(self, sql: str, params: Any = None, database: str | None = None) -> Any:
        conn = self.connect(database)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                row = cur.fetchone()
                return None if row is None else row[0]
        finally:
            conn.close()

    def create_database(self) -> str:
        name = f"cdc_{uuid.uuid4().hex[:10]}"
        self.execute(f"CREATE DATABASE `{name}`")
        self.databases.append(name)
        return name

    def drop_database(self, name: str) -> None:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> "
                    "CONNECTION_ID()",
                    (name,),
                )
                for (pid,) in cur.fetchall():
                    with contextlib.suppress(pymysql.MySQLError):
                        cur.execute(f"KILL {int(pid)}")
                cur.execute("SET SESSION lock_wait_timeout = 10")
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        finally:
            conn.close()


def start_binlog_mariadb() -> Iterator[BinlogMariadb]:
    directory = Path(tempfile.mkdtemp(prefix="dbtrigger-cdc-mariadb-"))
    port = free_port()
    started = subprocess.run(
        [BASH, str(SCRIPT), "start", "mariadb", str(directory), str(port)],
        capture_output=True,
        text=True,
        check=False,
    )
    if started.returncode != 0:
        log = directory / "server.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        subprocess.run([BASH, str(SCRIPT), "stop", "mariadb", str(directory)], check=False)
        shutil.rmtree(directory, ignore_errors=True)
        pytest.fail(
            f"could not start a private MariaDB (--log-bin, ROW) with {SCRIPT}: "
            f"{started.stderr.strip()} {tail}",
            pytrace=False,
        )
    server = BinlogMariadb(port, directory)
    try:
        yield server
    finally:
        subprocess.run(
            [BASH, str(SCRIPT), "stop", "mariadb", str(directory)],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class BinlogDatabase:
    """One test's database on the private binlog server."""

    server: BinlogMariadb
    name: str

    @property
    def url(self) -> str:
        return self.server.url(self.name)

    def connect(self, **kwargs: Any) -> pymysql.Connection[Any]:
        return self.server.connect(self.name, **kwargs)

    def execute(self, sql: str, params: Any = None) -> None:
        self.server.execute(sql, params, self.name)

    def scalar(self, sql: str, params: Any = None) -> Any:
        return self.server.scalar(sql, params, self.name)


def binlog_database(server: BinlogMariadb) -> Iterator[BinlogDatabase]:
    name = server.create_database()
    try:
        yield BinlogDatabase(server, name)
    finally:
        server.drop_database(name)
