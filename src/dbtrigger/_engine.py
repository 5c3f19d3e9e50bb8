"""One SQLAlchemy engine per adapter: created once on first use, or shared by the caller.

The source, the output binding and the SQL-backed stores all take either a URL
(they then own a connection pool) or an existing engine (the caller's pool,
e.g. so state and data share one). :class:`LazyEngine` holds that choice in one
place, with two invariants:

* an engine made from the URL is created at most once, even when several
  threads ask for it at the same time, and a pooled connection that sat idle
  for more than :data:`PING_AFTER_IDLE_SECONDS` is pinged when checked out, so
  a connection the database (or a firewall) dropped while idle is replaced
  instead of failing a tick. SQLAlchemy's ``pool_pre_ping`` pings on *every*
  checkout: one extra round trip per fetch, which during a catch-up at small
  batches was a third of the time. A connection used moments ago is used as
  it is; if the server went away in that moment the statement fails, the pool
  discards its connections, and the caller's retry gets a fresh one;
* :meth:`LazyEngine.dispose` closes only a pool this object created. A shared
  engine belongs to whoever passed it in and may still be serving others;
* with ``lock_wait``, an engine made from the URL bounds every statement's wait
  for a lock at connect time (:func:`~dbtrigger._lock_wait.bounded_connect_args`):
  a source's read queues behind DDL on its table that waits for an open
  transaction, for ever on PostgreSQL and a day on MariaDB at their defaults. A
  shared engine keeps the settings its owner gave it. A connection pooler in
  front of PostgreSQL (PgBouncer, Azure's built-in one, Neon's) may refuse the
  bound's startup ``options``: the engine then connects without it, and says so
  once (:func:`unbounded_if_refused`), rather than fail every connection.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

from dbtrigger._lock_wait import (
    DEFAULT_STORE_LOCK_TIMEOUT,
    bound_after_init_command,
    bounded_connect_args,
    create_if_missing,
    lock_timed_out,
    sets_own_lock_bound,
    table_exists,
    user_driver_arg,
)
from dbtrigger._once import Once
from dbtrigger._sqlite_file import follow_file
from dbtrigger.errors import ConfigurationError
from dbtrigger.redaction import remember_url_secrets
from dbtrigger.settings import DeferredSettingError, resolve_setting, setting_name

#: (The package's logger: the connection a source or a queue makes is not a part of either.)
log = logging.getLogger("dbtrigger")

#: Drivers a URL's dialect commonly names, and how to install them.
_DRIVER_HINTS = {
    "psycopg": 'pip install "psycopg[binary]" (or dbtrigger[postgres])',
    "psycopg2": "pip install psycopg2-binary, or use postgresql+psycopg:// (dbtrigger[postgres])",
    "pymysql": "pip install pymysql (or dbtrigger[mysql])",
    "mysqldb": "pip install mysqlclient, or use mysql+pymysql:// with dbtrigger[mysql]",
    "pyodbc": "pip install pyodbc (and the ODBC driver for SQL Server)",
    "pymssql": "pip install pymssql",
    "asyncpg": "dbtrigger is synchronous: use postgresql+psycopg://",
}


def create_engine(url: URL | str, **kwargs: Any) -> Engine:
    """:func:`sqlalchemy.create_engine`, with a missing driver or dialect as a clear error.

    Neither can fix itself by retrying, so both are
    :class:`~dbtrigger.errors.ConfigurationError` naming what to install,
    instead of an ``ImportError`` traceback or a fetch retried every tick.

    ``hide_parameters`` is on unless the caller says otherwise: a failing
    statement's bound values (an application row being written, a claimed
    row's key, a cursor position) would otherwise ride in SQLAlchemy's error
    text into every traceback a worker logs, where no pattern can tell a
    password column from a name.
    """
    kwargs.setdefault("hide_parameters", True)
    try:
        return sa.create_engine(url, **kwargs)
    except TypeError as exc:  # an option create_engine or the dialect does not take
        raise ConfigurationError(f"engine_kwargs: {str(exc).splitlines()[0][:300]}") from exc
    except sa.exc.NoSuchModuleError as exc:
        name = make_url(url).drivername if isinstance(url, str) else url.drivername
        raise ConfigurationError(
            f"SQLAlchemy has no dialect {name!r} (is the URL scheme right, e.g. "
            "postgresql+psycopg://, mysql+pymysql://, sqlite:///, mssql+pyodbc://?)"
        ) from exc
    except ImportError as exc:
        parsed = make_url(url) if isinstance(url, str) else url
        module = (getattr(exc, "name", None) or "").split(".")[0]
        hint = _DRIVER_HINTS.get(module) or _DRIVER_HINTS.get(parsed.get_driver_name(), "")
        raise ConfigurationError(
            f"the database driver for {parsed.drivername}:// is not installed "
            f"(no module {module or parsed.get_driver_name()!r})" + (f": {hint}" if hint else "")
        ) from exc


#: A pooled connection idle for longer than this is pinged before it is used.
PING_AFTER_IDLE_SECONDS = 10.0

_IDLE_SINCE = "dbtrigger_idle_since"


def ping_when_idle(engine: Engine, idle_seconds: float = PING_AFTER_IDLE_SECONDS) -> None:
    """Ping a pooled connection at checkout only when it was idle for ``idle_seconds``.

    A failed ping raises :class:`sqlalchemy.exc.DisconnectionError`, which
    makes the pool discard that connection and check out (or open) another,
    as ``pool_pre_ping`` does.
    """

    def checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = (id(dbapi_connection), time.monotonic())

    def checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        del proxy
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or since[0] != id(dbapi_connection):
            return  # a connection just opened (or reopened) needs no ping
        if time.monotonic() - since[1] < idle_seconds:
            return
        ping(engine, dbapi_connection)

    sa.event.listen(engine, "checkin", checked_in)
    sa.event.listen(engine, "checkout", checked_out)


def ping(engine: Engine, dbapi_connection: Any) -> None:
    """Ping a connection that sat idle; :class:`sqlalchemy.exc.DisconnectionError` if it
    does not answer (the pool then discards it)."""
    try:
        alive = engine.dialect.do_ping(dbapi_connection)
    except Exception as exc:
        raise sa.exc.DisconnectionError(f"idle connection failed its ping: {exc}") from exc
    if not alive:
        raise sa.exc.DisconnectionError("idle connection failed its ping")


#: What the DDL helpers (change log, wake-up trigger) run on: the caller's engine,
#: or a connection whose transaction is the caller's.
Bind = Engine | Connection


@contextmanager
def connected(bind: Bind, *, begin: bool = False) -> Iterator[Connection]:
    """The caller's connection as it is (a transaction on it is the caller's), or a
    new one from the engine, in a transaction of its own with ``begin``."""
    if isinstance(bind, Connection):
        yield bind
        return
    with bind.begin() if begin else bind.connect() as conn:
        yield conn


def parse_database_url(url: str, what: str = "database URL") -> URL:
    """``url`` with ``%SETTING%`` references resolved, as a SQLAlchemy URL.

    A malformed URL is a :class:`ConfigurationError` that does not repeat the
    text (it may hold a password); SQLAlchemy raises ``ValueError`` for a port
    that is not a number, which must not escape as a bare exception either.
    """
    if not isinstance(url, str):
        raise ConfigurationError(
            f"{what}: expected a URL or a %SETTING% reference, got {type(url).__name__}"
        )
    text = resolve_setting(url)  # a MissingSettingError names the setting
    form = "dialect+driver://user:password@host:port/database"
    parsed: URL | None = None
    try:
        parsed = make_url(text)
    except (sa.exc.ArgumentError, ValueError) as exc:
        problem = "the port is not a number" if isinstance(exc, ValueError) else "unparsable"
    else:
        # A password holding an '@' that is not percent-encoded ends at that '@': the
        # rest of it is read as the host, which every "cannot resolve host" error
        # then quotes (and no mask knows). No host name holds an '@'.
        problem = (
            "an '@' in the password (or the user name) is not percent-encoded; write it "
            "as %40 (urllib.parse.quote_plus(password))"
            if "@" in (parsed.host or "")
            else ""
        )
    if parsed is None or problem:
        setting = setting_name(url)
        if setting is not None:  # the person must know which of the app's settings to fix
            raise DeferredSettingError(
                f"{what}: app setting {setting!r} is not a valid database URL ({problem}); "
                f"set it to SQLAlchemy's form {form}"
            ) from None
        raise ConfigurationError(
            f"{what}: not a valid database URL ({problem}); SQLAlchemy expects {form}"
        ) from None
    # A driver's error, or a repr of the engine, may quote them: masked wherever seen.
    remember_url_secrets(parsed)
    return parsed


def given_connect_args(engine_kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """The driver arguments the user's ``engine_kwargs`` carry (``connect_args``;
    none: empty), the mapping a lock bound is merged into (this module's engines
    and a queue's own, :mod:`dbtrigger.queue.engines`).

    Raises:
        ConfigurationError: ``connect_args`` is not a mapping.
    """
    given = engine_kwargs.get("connect_args") or {}
    if not isinstance(given, Mapping):
        raise ConfigurationError(
            f"engine_kwargs connect_args must be a dict of driver arguments, not "
            f"{type(given).__name__}"
        )
    return given


class LazyEngine:
    """An engine created from ``url`` when first asked for, unless ``engine`` is shared.

    Args:
        url: where to connect when no engine is shared (ignored otherwise); a
            callable is asked at the first connection (a URL from an app setting
            resolved at first use).
        engine_kwargs: passed to :func:`sqlalchemy.create_engine`. Setting
            ``pool_pre_ping`` here (either way) replaces the ping-when-idle
            default with SQLAlchemy's own behaviour.
        engine: an existing engine to use as it is; never disposed here.
        lock_wait: seconds a statement on an engine made here waits for a lock
            before it fails (None: the database's own wait), unless the user's
            driver arguments (``connect_args``, the URL's query) set their own.
    """

    def __init__(
        self,
        url: URL | str | Callable[[], URL],
        engine_kwargs: Mapping[str, Any] | None = None,
        engine: Engine | None = None,
        lock_wait: float | None = None,
    ) -> None:
        self._url = url
        if engine_kwargs is not None and not isinstance(engine_kwargs, Mapping):
            raise ConfigurationError(
                f"engine_kwargs must be a dict of create_engine() options, not "
                f"{type(engine_kwargs).__name__}"
            )
        self._kwargs: dict[str, Any] = dict(engine_kwargs or {})
        self._engine = engine
        self._owned = False
        self._lock = threading.Lock()
        self._lock_wait = lock_wait
        #: The bound in force on the engine's connections once made here (None: not
        #: ours; a shared engine, no ``lock_wait``, or the user's own bound).
        self.lock_wait: float | None = None

    @property
    def engine(self) -> Engine:
        """The engine, creating it on the first call if none was shared."""
        engine = self._engine
        if engine is None:
            with self._lock:
                if self._engine is None:
                    url = self._url() if callable(self._url) else self._url
                    created = create_engine(url, **self._bounded(url))
                    if "pool_pre_ping" not in self._kwargs:
                        ping_when_idle(created)
                    renew_stale_plans(created)
                    follow_file(created)
                    if self._lock_wait is not None:
                        given = self._kwargs.get("connect_args") or {}
                        bound_after_init_command(created, given, self._lock_wait)
                        theirs = user_driver_arg(given, created.url.query, "options")
                        unbounded_if_refused(created, theirs, self._unbounded)
                    self._engine = created
                    self._owned = True
                engine = self._engine
        return engine

    def _bounded(self, url: URL | str) -> dict[str, Any]:
        """``engine_kwargs`` with the lock bound merged into their ``connect_args``."""
        seconds = self._lock_wait
        if seconds is None:
            return self._kwargs
        given = given_connect_args(self._kwargs)
        parsed = make_url(url) if isinstance(url, str) else url
        dialect = parsed.get_backend_name()
        if not sets_own_lock_bound(dialect, given, parsed.query):
            self.lock_wait = seconds
        args = bounded_connect_args(dialect, given, parsed.query, seconds)
        return {**self._kwargs, "connect_args": args}

    def _unbounded(self) -> None:
        self.lock_wait = None

    @property
    def holds_connections(self) -> bool:
        """May a caller keep one of this pool's connections between statements of its
        own (see ``SqlAlchemySource.fetch``)? Only a pool created here with the default
        pooling and ping: a shared engine's pool serves others, and ``poolclass`` or
        ``pool_pre_ping`` in ``engine_kwargs`` ask for a checkout per use."""
        return self._owned and not {"poolclass", "pool_pre_ping"} & self._kwargs.keys()

    def dispose(self) -> None:
        """Close the pooled connections of an engine created here (it stays usable).

        Does nothing for a shared engine, or when no engine was created yet.
        """
        with self._lock:
            engine = self._engine if self._owned else None
        if engine is not None:
            engine.dispose()


#: PostgreSQL's refusal of a prepared statement whose result columns changed type.
STALE_PLAN = "cached plan must not change result type"


def renew_stale_plans(engine: Engine) -> None:
    """Drop the pool's connections when PostgreSQL refuses a prepared statement
    because its table's columns changed type under it (``ALTER COLUMN ... TYPE`` in
    another session). psycopg prepares a statement on the server once a connection
    has run it five times, and forgets it only when that connection runs DDL
    itself: every later run of a claim or a fetch on such a connection failed the
    same way, for good, whatever the source read of the table again. Taken as a
    disconnect, the failing connection and the pool's others (which may hold the
    same statement) are replaced, and the statement prepares afresh. Other
    dialects and errors pass untouched."""

    @sa.event.listens_for(engine, "handle_error")
    def _stale_plan(context: sa.engine.ExceptionContext) -> None:
        failure = context.original_exception
        if getattr(failure, "sqlstate", None) == "0A000" and STALE_PLAN in str(failure):
            context.is_disconnect = True


def unbounded_if_refused(
    engine: Engine, theirs: str | None, refused: Callable[[], None], *, waits: str = "reads"
) -> None:
    """On PostgreSQL: when the server (a pooler in front of it) refuses the lock bound
    in the startup ``options`` ("unsupported startup parameter"), connect with the
    user's own ``options`` (``theirs``, None: none) instead, this time and from then
    on; ``refused`` is called and a WARNING says what is lost, once. A session
    ``SET`` instead would leak into other clients' sessions of a pooler in
    transaction mode. Costs nothing until a connection is refused. ``waits``: what
    waits unbounded from then on, for the warning (a source's reads, a queue's
    claims and settlements)."""
    if engine.dialect.name != "postgresql":
        return
    gave_up: list[bool] = []

    def without_bound(cparams: dict[str, Any]) -> None:
        if theirs is None:
            cparams.pop("options", None)
        else:
            cparams["options"] = theirs

    def connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        del record
        if gave_up:
            without_bound(cparams)
            return None  # the dialect connects with what is left
        try:
            return dialect.connect(*cargs, **cparams)
        except dialect.loaded_dbapi.OperationalError as exc:
            if "unsupported startup parameter" not in str(exc):
                raise
        gave_up.append(True)
        refused()
        log.warning(
            "%s refused the lock bound in the connection's startup options (a connection "
            "pooler such as PgBouncer?): %s now wait for locks as long as the server "
            "lets them; set one for the login role instead (ALTER ROLE ... SET "
            "lock_timeout), or connect to the server directly",
            engine.url.render_as_string(hide_password=True),
            waits,
            extra={"event": "lock_bound_refused"},
        )
        without_bound(cparams)
        return dialect.connect(*cargs, **cparams)

    sa.event.listen(engine, "do_connect", connect)


def reflect_table(
    conn: Connection,
    name: str,
    schema: str | None,
    *,
    shown: str | None = None,
    noun: str = "table",
    keys_only: bool = False,
) -> sa.Table:
    """The table ``name`` (in ``schema``) as the database describes it now.

    ``keys_only``: its columns, primary key, unique constraints and indexes, and
    nothing else (no foreign keys, check constraints, table comment or dialect
    options): what a source reads of it (:func:`_keys_only`).

    A table that is not there, or that this user cannot see, is a
    :class:`ConfigurationError` naming it (``noun`` and ``shown``, e.g. ``table
    sqlite:jobs``, or ``schema.name``) and saying what to do: a person must
    create it, correct the name or grant access; retrying cannot help.
    """
    try:
        if keys_only:
            found = _keys_only(conn, name, schema)
            if found is not None:
                return found
        return sa.Table(name, sa.MetaData(), schema=schema, autoload_with=conn)
    except sa.exc.NoSuchTableError:
        where = shown or (f"{schema}.{name}" if schema else name)
        raise ConfigurationError(
            f"{noun} {where} does not exist (or is not visible to this user); create it, or "
            "correct the name given (table=, schema=, the URL's database), or grant this user "
            "SELECT on it" + _relative_sqlite(conn)
        ) from None


def _keys_only(conn: Connection, name: str, schema: str | None) -> sa.Table | None:
    """The table reflected from four of SQLAlchemy's eight catalogue reads: columns,
    primary key, indexes, unique constraints (None: reflect it in full).

    A full reflection also reads foreign keys, check constraints, the table's
    comment and its dialect options, which a source never looks at. On
    PostgreSQL each read is a query SQLAlchemy compiles anew for every new
    engine (a process's first): the four skipped cost a cold start about half
    of its reflection, 35-45 ms of CPU and as many round trips (benchmarks/README.md,
    #26). The columns (types, nullability, comments), key, constraints and
    indexes are SQLAlchemy's own, built by its ``Inspector.reflect_table`` from
    what was read. That takes the read through a private argument
    (``_reflect_info``, SQLAlchemy 2.0 and 2.1): a SQLAlchemy without it, a
    table not found or one the dialect cannot reflect goes the full way, which
    also raises as it always did.
    """
    try:
        from sqlalchemy.engine.reflection import (  # noqa: PLC0415 - private, checked here
            ObjectKind,
            ObjectScope,
            _ReflectionInfo,
        )
    except ImportError:  # pragma: no cover - a SQLAlchemy without it
        return None
    inspector = sa.inspect(conn)
    unreflectable: dict[Any, Any] = {}
    kw: dict[str, Any] = {
        "schema": schema,
        "filter_names": [name],
        "kind": ObjectKind.ANY,
        "scope": ObjectScope.ANY,
        "unreflectable": unreflectable,
    }
    columns = inspector.get_multi_columns(**kw)
    if (schema, name) not in columns or unreflectable:
        return None
    try:
        unique = inspector.get_multi_unique_constraints(**kw)
    except NotImplementedError:  # (optional for a dialect, as in the full reflection)
        unique = {}
    info = _ReflectionInfo(
        columns=columns,
        pk_constraint=dict(inspector.get_multi_pk_constraint(**kw)),
        foreign_keys={},
        indexes=inspector.get_multi_indexes(**kw),
        unique_constraints=unique,
        table_comment={},
        check_constraints={},
        table_options={},
        unreflectable=unreflectable,
    )
    if unreflectable:
        return None
    table = sa.Table(name, sa.MetaData(), schema=schema)
    try:
        inspector.reflect_table(table, None, resolve_fks=False, _reflect_info=info)
    except TypeError:  # pragma: no cover - a SQLAlchemy whose reflect_table lacks it
        return None
    return table


def _relative_sqlite(conn: Connection) -> str:
    """What to add when the database is a SQLite file named relative to the working
    directory: run from another directory, ``sqlite:///shop.db`` is another file,
    which SQLite created empty (the usual cause of a missing table on a first run)."""
    url = conn.engine.url
    path = url.database or ""
    if url.get_backend_name() != "sqlite" or path in ("", ":memory:") or os.path.isabs(path):
        return ""
    if path.startswith("file:"):
        return ""
    return (
        f"; {path} is relative to the working directory, so this is "
        f"{os.path.abspath(path)}: run from the directory that holds the database, "
        "or give an absolute path (sqlite:////abs/path.db)"
    )


class TableOnce(Once):
    """A table created, when missing, at its first use and once per process.

    ``ensure`` is safe from several threads, and another process creating the
    table between our check and our ``CREATE`` is no error (the table is there).
    The ``CREATE`` waits at most ``lock_timeout`` seconds for a lock another session
    holds (:func:`~dbtrigger._lock_wait.create_if_missing`); the driver's error is raised.
    """

    def __init__(
        self,
        table: sa.Table,
        engine: Callable[[], Engine],
        lock_timeout: float = DEFAULT_STORE_LOCK_TIMEOUT,
    ) -> None:
        super().__init__(self._create)
        self.table = table
        self._engine = engine
        self.lock_timeout = lock_timeout

    def _create(self) -> None:
        engine = self._engine()
        try:
            create_if_missing(engine, self.table, self.lock_timeout)
        except sa.exc.SQLAlchemyError as exc:
            if lock_timed_out(exc) or not table_exists(engine, self.table, self.lock_timeout):
                raise


def strict_session(conn: Connection) -> bool:
    """Does this MariaDB/MySQL session refuse a value too long for its column (a strict
    ``sql_mode``, the servers' default) rather than cut it and warn? Read once per
    database connection (its session's mode is set at connect: ``init_command``, the
    server's default), so a write that must not be cut short asks the server only
    when the session is not strict."""
    info = conn.connection.info
    mode = info.get("dbtrigger_sql_mode")
    if mode is None:
        mode = info["dbtrigger_sql_mode"] = str(
            conn.exec_driver_sql("SELECT @@SESSION.sql_mode").scalar() or ""
        )
    return "STRICT_TRANS_TABLES" in mode or "STRICT_ALL_TABLES" in mode


__all__ = [
    "PING_AFTER_IDLE_SECONDS",
    "LazyEngine",
    "TableOnce",
    "create_engine",
    "given_connect_args",
    "ping",
    "ping_when_idle",
    "reflect_table",
    "renew_stale_plans",
    "strict_session",
    "unbounded_if_refused",
]
