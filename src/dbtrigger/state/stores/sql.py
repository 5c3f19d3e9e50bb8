"""SQL table checkpoint store: state documents as rows in your own database.

Useful when the database being polled is the only durable thing you run (no
storage account), or when operators want the checkpoint next to the data, under
the same backups and permissions.

One row per poller::

    namespace   VARCHAR(128)   -- several apps can share one table
    poller_name VARCHAR(128)   -- primary key is (namespace, poller_name)
    document    TEXT           -- the JSON state document, readable with SQL
    etag        VARCHAR(64)    -- random token, replaced by every write
    updated_at  TIMESTAMP      -- the database server's clock; informational only

Compare-and-swap is one statement, ``UPDATE ... WHERE namespace = :ns AND
poller_name = :p AND etag = :old``, inside an explicit transaction, and wins
only when it reports exactly one row. Every database here re-checks the
``WHERE`` clause against the latest committed row before updating it (row lock
plus re-evaluation in PostgreSQL READ COMMITTED and InnoDB's locking reads;
one writer at a time in SQLite), so of several writers presenting the same
etag exactly one matches. Create-only is a plain ``INSERT``; the primary key
turns a second creator into an ``IntegrityError``, which becomes
:class:`~dbtrigger.errors.CasConflictError`.

The new etag is a fresh random token on every write, never a hash of the
content: writing identical bytes must still invalidate older etags. That also
settles MySQL/MariaDB's "affected rows" semantics (which count only rows whose
values changed): the etag column always changes, so a matched row is always
counted, with or without the ``FOUND_ROWS`` client flag.

Why an explicit transaction around a single statement: it splits the outcome
of a failed write into two cases that are genuinely different. A failure while
executing leaves an uncommitted transaction that the server rolls back, so the
write certainly did not happen (:class:`~dbtrigger.errors.StoreUnavailableError`).
Only a connection lost *during COMMIT* leaves the outcome unknown, and only
that is reported as :class:`~dbtrigger.errors.AmbiguousWriteError`, which the
poller resolves by re-reading on the next tick.

Types are chosen so each backend holds a document of at least 1 MB and compares
keys byte for byte: ``TEXT`` on PostgreSQL and SQLite (up to 1 GB), ``LONGTEXT``
with ``utf8mb4_bin`` on MySQL/MariaDB (plain ``TEXT`` stops at 64 KB there, and
the default collations would make ``Orders`` and ``orders`` the same poller).
Documents must be UTF-8 text without NUL characters, which every state
document is (JSON escapes control characters); anything else is refused with
:class:`~dbtrigger.errors.UnsupportedDocumentError` before touching the database.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Engine

from dbtrigger._driver_errors import (
    MYSQL_CONFLICT_CODES,
    PG_CONFLICT_SQLSTATES,
    encoding_problem,
    names_a_missing_object,
    short_error,
    unencodable,
)
from dbtrigger._engine import LazyEngine, parse_database_url, strict_session
from dbtrigger._lock_wait import (
    DEFAULT_STORE_LOCK_TIMEOUT,
    check_lock_timeout,
    create_if_missing,
    gave_up_waiting,
    lock_timed_out,
    lock_wait_bounded,
    table_exists,
    write_connection,
)
from dbtrigger._once import Once
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    ConfigurationError,
    DbTriggerError,
    StoreAuthError,
    StoreRefusedError,
    StoreUnavailableError,
    UnsupportedDocumentError,
)
from dbtrigger.names import validate_name, validate_sql_identifier
from dbtrigger.redaction import safe_url_text
from dbtrigger.settings import references_setting
from dbtrigger.state import sizes
from dbtrigger.state.stores import _sql_words as _words
from dbtrigger.state.stores.base import StoredDocument, document_text

#: Bytes a state write's statement carries besides the document (key, etag, SQL text).
_STATEMENT_OVERHEAD = 4096

_KEY_TYPE = sa.String(128).with_variant(
    mysql.VARCHAR(128, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
)
_ETAG_TYPE = sa.String(64).with_variant(
    mysql.VARCHAR(64, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
)
_DOCUMENT_TYPE = sa.Text().with_variant(
    mysql.LONGTEXT(charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
)

# Driver signals that the credentials or the permissions were refused. PostgreSQL
# reports connection-time failures without a SQLSTATE, hence the message probes.
_PG_AUTH_SQLSTATES = frozenset({"28000", "28P01", "42501"})
_PG_AUTH_MESSAGES = re.compile(
    r"password authentication failed|authentication failed|no pg_hba\.conf entry"
    r"|role \".*\" does not exist|permission denied",
    re.IGNORECASE,
)
_MYSQL_AUTH_CODES = frozenset({1044, 1045, 1142, 1143, 1227, 1370, 1698})
# Another transaction won (deadlock victim, serialization failure): rolled back.
_PG_CONFLICT_SQLSTATES = PG_CONFLICT_SQLSTATES
_MYSQL_CONFLICT_CODES = MYSQL_CONFLICT_CODES
# A create that lost: the (namespace, poller_name) key exists already.
_MYSQL_DUPLICATE_CODES = frozenset({1062})
_SQLITE_DUPLICATE = re.compile(r"UNIQUE constraint failed|PRIMARY KEY must be unique")


def classify_driver_error(exc: sa.exc.DBAPIError) -> str:
    """``"auth"``, ``"conflict"``, ``"disconnect"`` or ``"other"`` for a driver error.

    Pure (looks only at the exception), so it is tested table by table with the
    drivers' own exception classes as well as live.
    """
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    text = str(orig)
    if sqlstate in _PG_AUTH_SQLSTATES or code in _MYSQL_AUTH_CODES:
        return "auth"
    if sqlstate is None and code is None and _PG_AUTH_MESSAGES.search(text):
        return "auth"
    if sqlstate in _PG_CONFLICT_SQLSTATES or code in _MYSQL_CONFLICT_CODES:
        return "conflict"
    if exc.connection_invalidated:
        return "disconnect"
    return "other"


def is_duplicate_key(exc: sa.exc.IntegrityError) -> bool:
    """True when the violated constraint is a unique/primary key (a lost create race)."""
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    if sqlstate is not None or code is not None:
        return sqlstate == "23505" or code in _MYSQL_DUPLICATE_CODES
    return bool(_SQLITE_DUPLICATE.search(str(orig)))


def table_name(table: sa.Table) -> str:
    """``schema.name``, or ``name`` for a table in the default schema."""
    return f"{table.schema}.{table.name}" if table.schema else table.name


def describe_table(
    engine: Callable[[], Engine], table: sa.Table, namespace: str, *, unresolved: str
) -> str:
    """Where documents kept in ``table`` (state or history) are, the URL without
    its password. Never raises: an engine that cannot be made yet (an app setting
    missing) is shown as ``unresolved``."""
    try:
        url = safe_url_text(engine().url)
    except DbTriggerError:
        url = unresolved
    return f"sql:{url} table={table_name(table)} namespace={namespace}"


def _state_table(name: str, schema: str | None) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("namespace", _KEY_TYPE, primary_key=True),
        sa.Column("poller_name", _KEY_TYPE, primary_key=True),
        sa.Column("document", _DOCUMENT_TYPE, nullable=False),
        sa.Column("etag", _ETAG_TYPE, nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.current_timestamp(),
        ),
        schema=schema,
    )


class _Attempt:
    """Where a write got to when it failed; decides whether the outcome is known."""

    def __init__(self) -> None:
        self.committing = False


def lock_timeout_error(
    where: str, engine: Engine, table: sa.Table, seconds: float, exc: BaseException, unchanged: str
) -> StoreUnavailableError:
    """A store write (the state row, the history's records) that gave up waiting for
    a lock: ``unchanged`` says what its rolled-back transaction left as it was; the
    next try runs it again. Names who holds locks on the table, if known."""
    text, holders = gave_up_waiting(
        engine,
        table.name,
        table.schema,
        seconds,
        exc,
        f"{unchanged}, the next try runs again. End the transaction left open there",
    )
    return StoreUnavailableError(f"{where} {text}", seconds=seconds, holders=holders or None)


class SqlCheckpointStore:
    """State documents as rows of one table, via SQLAlchemy Core.

    Args:
        url: SQLAlchemy URL of the database holding the table; ``%APP_SETTING%``
            references are resolved at first use (a missing setting fails that
            use with a ConfigurationError naming it). The password never
            appears in :meth:`describe` or in errors.
        engine: an existing engine instead of ``url`` (for example the
            source's, so state and data share a pool).
        table / schema: where the rows live (validated identifiers). On
            MySQL/MariaDB the schema is a database name.
        namespace: a partition of the table, so several applications can keep
            pollers of the same name apart (validated like a poller name).
        create_table: create the table at the first write if it is missing (a
            read of a missing table finds no state and creates nothing). Turn it
            off where the runtime identity may not run DDL, and create the table
            once with :meth:`create_table` (or from :meth:`ddl`).
        engine_kwargs: passed to :func:`sqlalchemy.create_engine` with ``url``.
        lock_timeout_seconds: how long a write (and the history's appends) waits
            for a lock another transaction holds on the table before it gives up
            as :class:`~dbtrigger.errors.StoreUnavailableError` (nothing changed).
            At the databases' defaults a lease renewal behind a transaction left
            open on the state row waited for ever on PostgreSQL.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        engine: Engine | None = None,
        table: str = "dbtrigger_state",
        schema: str | None = None,
        namespace: str = "default",
        create_table: bool = True,
        engine_kwargs: Mapping[str, Any] | None = None,
        lock_timeout_seconds: float = DEFAULT_STORE_LOCK_TIMEOUT,
    ) -> None:
        if (url is None) == (engine is None):
            raise ConfigurationError("SqlCheckpointStore needs exactly one of url= or engine=")
        #: How long a write waits for another transaction's lock (see the class doc).
        self.lock_timeout = check_lock_timeout(lock_timeout_seconds)
        self._table = _state_table(
            validate_sql_identifier(table, "state table"),
            validate_sql_identifier(schema, "state schema") if schema else None,
        )
        self._namespace = validate_name(namespace, "namespace")
        self._create = create_table
        self._creation = Once(self.create_table, done=not create_table)
        #: MariaDB/MySQL: the server's max_allowed_packet, read at the first write.
        self._max_packet: int | None = None
        #: Where the URL comes from while it is not resolved (describe()).
        self._url_spec = url
        # hide_parameters: a failing statement's bound values (the whole
        # document) must not be copied into exception text and logs.
        kwargs: dict[str, Any] = {"hide_parameters": True, **(engine_kwargs or {})}
        if engine is None and references_setting(url):
            # An app setting is read at first use: in a Function App a missing
            # one fails the functions using this store, not the app's indexing.
            self._engines = LazyEngine(lambda: parse_database_url(url or ""), kwargs)
        else:
            parsed = engine.url if engine is not None else parse_database_url(url or "")
            self._engines = LazyEngine(parsed, kwargs, engine)
            # Created now rather than on first use, so a URL naming a missing
            # driver fails in the constructor.
            self._engines.engine  # noqa: B018

    # --- identity -----------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def _engine(self) -> Engine:
        """The engine (created at first use when the URL is an app setting).

        Raises:
            ConfigurationError: the app setting is missing or not a database URL.
        """
        return self._engines.engine

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def creates_table(self) -> bool:
        """Does this store create its table(s) on first use (``create_table=``)?"""
        return self._create

    @property
    def table_name(self) -> str:
        return table_name(self._table)

    def describe(self) -> str:
        """Where the documents are; never raises (an unresolved URL shows its reference)."""
        unresolved = f"({self._url_spec}, unresolved)"
        return describe_table(
            lambda: self._engine, self._table, self._namespace, unresolved=unresolved
        )

    def ddl(self) -> str:
        """The ``CREATE TABLE`` statement for this engine's dialect, for DBAs."""
        return str(sa.schema.CreateTable(self._table).compile(dialect=self._engine.dialect))

    def close(self) -> None:
        """Dispose of the connection pool if this store created the engine."""
        self._engines.dispose()

    # --- error edge -----------------------------------------------------------------

    @contextlib.contextmanager
    def _edge(self, action: str, key: str, *, create: bool = False) -> Iterator[_Attempt]:
        """Translate SQLAlchemy/driver failures into the store error tree, cause chained."""
        attempt = _Attempt()
        where = f"{action} of {key!r} in {self.describe()}"
        try:
            yield attempt
        except DbTriggerError:
            raise
        except sa.exc.IntegrityError as exc:
            if create and is_duplicate_key(exc):
                raise CasConflictError(
                    f"{key!r} already exists in {self.table_name} (create-only write)"
                ) from exc
            # Any other constraint (a trigger, a CHECK, a NOT NULL someone added
            # to the state table) is not a race and will fail the same way again.
            raise StoreRefusedError(
                f"{where} violated a constraint of the state table: {short_error(exc)}"
            ) from exc
        except sa.exc.DataError as exc:  # a value the column refuses: the same again
            words = _words.not_encodable if unencodable(exc) else self._misfit
            raise StoreRefusedError(f"{where} was refused: {words(short_error(exc))}") from exc
        except UnicodeEncodeError as exc:  # psycopg encodes for the database's encoding
            raise StoreRefusedError(
                f"{where} was refused: {_words.not_encodable(str(exc))}"
            ) from exc
        except sa.exc.DBAPIError as exc:
            if lock_timed_out(exc):
                raise lock_timeout_error(
                    where, self._engine, self._table, self.lock_timeout, exc, "nothing was changed"
                ) from exc
            kind = classify_driver_error(exc)
            if self._create and self._creation.done and names_a_missing_object(exc):
                raise StoreRefusedError(
                    f"{where}: {_words.table_gone(self.table_name, short_error(exc))}"
                ) from exc
            if action in ("read", "listing") and self._missing_without_create():
                raise StoreRefusedError(
                    f"{where} failed: there is no table {self.table_name} there. No poller "
                    "has committed to this store yet (a poller's store creates it at the "
                    "first commit; with create_table=False, create it from the store's "
                    "ddl()), or the URL, schema or state_table names another place"
                ) from exc
            if kind == "auth":
                raise StoreAuthError(
                    f"{where} was refused: {short_error(exc)}; check the credentials "
                    "and the grants on the state table"
                ) from exc
            if kind == "conflict" and action != "read":
                raise CasConflictError(
                    f"{where} lost to a concurrent transaction: {short_error(exc)}"
                ) from exc
            if attempt.committing and kind == "disconnect":
                raise AmbiguousWriteError(
                    f"{where}: the connection was lost during COMMIT, so the write may or "
                    f"may not have landed ({short_error(exc)}); re-read before deciding"
                ) from exc
            raise StoreUnavailableError(f"{where} failed: {short_error(exc)}") from exc
        except sa.exc.SQLAlchemyError as exc:
            raise StoreUnavailableError(f"{where} failed: {short_error(exc)}") from exc
        except TypeError as exc:  # outside the DB-API tree: a SQL_ASCII database
            problem = encoding_problem(exc)
            if problem is None:
                raise
            raise StoreRefusedError(f"{where} failed: {problem}") from exc

    # --- table management -------------------------------------------------------------

    def create_table(self) -> None:
        """Create the state table if it does not exist (safe to race)."""
        with self._edge("create table", self.table_name):
            try:
                create_if_missing(self._engine, self._table, self.lock_timeout)
            except sa.exc.DBAPIError as exc:
                # Another process created it between our check and our CREATE.
                if (
                    lock_timed_out(exc)
                    or classify_driver_error(exc) == "auth"
                    or not self._table_exists()
                ):
                    raise
        self._creation.done = True

    def _table_exists(self) -> bool:
        return table_exists(self._engine, self._table, self.lock_timeout)

    def _missing_without_create(self) -> bool:
        """After a failed read of a store that does not create its table (the CLI's):
        is the table missing? The driver's own words for that ("relation ... does not
        exist", 1146) leave a person guessing. False when that cannot be told."""
        if self._create:
            return False
        try:
            return not self._table_exists()
        except sa.exc.SQLAlchemyError:
            return False

    def _ensure_table(self) -> None:
        self._creation.ensure()

    def _readable(self, key: str) -> bool:
        """For a read: is the table there? A missing one that the first write would
        create means no state yet: a read (``dbtrigger status`` on a mistyped URL or
        schema) must not leave an empty state table behind."""
        if self._creation.done:
            return True
        with self._edge("read", key):
            exists = self._table_exists()
        if exists:
            self._creation.done = True
        return exists

    def _check_packet(self, key: str, data: bytes) -> None:
        """MariaDB/MySQL drop the connection on a statement larger than
        ``max_allowed_packet`` ("server has gone away"), which would pass for an
        outage and be retried for ever: refuse such a document up front, naming
        what makes it large."""
        if self._engine.dialect.name not in ("mysql", "mariadb"):
            return
        if self._max_packet is None:
            with self._edge("read max_allowed_packet", key), self._engine.connect() as conn:
                self._max_packet = int(
                    conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one()
                )
        # The statement carries the document and a few short values besides.
        if len(data) + _STATEMENT_OVERHEAD > self._max_packet:
            raise UnsupportedDocumentError(
                f"document for {key!r} ({len(data)} bytes) does not fit the server's "
                f"max_allowed_packet ({self._max_packet} bytes), so {self._engine.dialect.name} "
                f"would drop the connection: {sizes.explain(data)}; or raise max_allowed_packet"
            )

    def _misfit(self, what: str) -> str:
        t = self._table
        return _words.column_misfit(
            self._engine.dialect.name, self.table_name, str(t.c.document.type), what
        )

    def _check_kept(self, conn: Connection, key: str, etag: str, size: int) -> None:
        """MariaDB/MySQL without a strict ``sql_mode`` cut a value too long for its
        column and only warn: read back the length written, in the same transaction,
        so a document cut short is rolled back and refused, never committed."""
        if strict_session(conn):  # the server refuses it (a DataError): nothing to read
            return
        t = self._table
        kept = conn.execute(
            sa.select(sa.func.length(t.c.document)).where(self._where_key(key), t.c.etag == etag)
        ).scalar()
        if kept != size:
            raise StoreRefusedError(self._misfit(f"{size} bytes, {kept} kept"))

    def _where_key(self, key: str) -> sa.ColumnElement[bool]:
        t = self._table
        return sa.and_(t.c.namespace == self._namespace, t.c.poller_name == key)

    @staticmethod
    def _text(key: str, data: bytes) -> str:
        text = document_text(key, data, "SQL")
        if "\x00" in text:
            raise UnsupportedDocumentError(
                f"document for {key!r} contains a NUL character, which SQL text columns refuse"
            )
        return text

    # --- the port ---------------------------------------------------------------------

    def read(self, key: str) -> StoredDocument | None:
        validate_name(key, "poller name")
        if not self._readable(key):
            return None
        t = self._table
        stmt = sa.select(t.c.document, t.c.etag).where(self._where_key(key))
        with self._edge("read", key), self._engine.connect() as conn:
            row = conn.execute(stmt).first()
        if row is None:
            return None
        return StoredDocument(str(row.document).encode("utf-8"), str(row.etag))

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        validate_name(key, "poller name")
        text = self._text(key, data)
        self._ensure_table()
        self._check_packet(key, data)
        t = self._table
        etag = f'"{uuid.uuid4().hex}"'
        stmt: sa.Executable
        if if_match is None:
            stmt = sa.insert(t).values(
                namespace=self._namespace,
                poller_name=key,
                document=text,
                etag=etag,
                updated_at=sa.func.current_timestamp(),
            )
        else:
            stmt = (
                sa.update(t)
                .where(self._where_key(key), t.c.etag == if_match)
                .values(document=text, etag=etag, updated_at=sa.func.current_timestamp())
            )
        with (
            self._edge("write", key, create=if_match is None) as attempt,
            write_connection(self._engine) as conn,
        ):
            self._execute_one(conn, stmt, key, attempt, (etag, len(data)))
        return etag

    def _execute_one(
        self,
        conn: Connection,
        stmt: sa.Executable,
        key: str,
        attempt: _Attempt,
        written: tuple[str, int],
    ) -> None:
        trans = conn.begin()
        try:
            with lock_wait_bounded(conn, self.lock_timeout):
                result = conn.execute(stmt)
            # An INSERT either adds its row or raises IntegrityError (drivers
            # may report -1 for its rowcount); an UPDATE must match exactly one.
            if isinstance(stmt, sa.Update) and result.rowcount != 1:
                raise CasConflictError(
                    f"{key!r} in {self.table_name} changed since it was read (etag mismatch)"
                )
            if self._engine.dialect.name in ("mysql", "mariadb"):
                self._check_kept(conn, key, *written)
        except BaseException:
            trans.rollback()
            raise
        attempt.committing = True
        trans.commit()

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        validate_name(key, "poller name")
        if not self._readable(key):
            return  # no table: nothing to delete
        t = self._table
        condition = self._where_key(key)
        if if_match is not None:
            condition = sa.and_(condition, t.c.etag == if_match)
        with self._edge("delete", key) as attempt, write_connection(self._engine) as conn:
            trans = conn.begin()
            try:
                with lock_wait_bounded(conn, self.lock_timeout):
                    deleted = conn.execute(sa.delete(t).where(condition)).rowcount
                if deleted == 0 and if_match is not None:
                    still = conn.execute(sa.select(t.c.etag).where(self._where_key(key))).first()
                    if still is not None:
                        raise CasConflictError(
                            f"{key!r} in {self.table_name} changed since it was read "
                            "(etag mismatch)"
                        )
            except BaseException:
                trans.rollback()
                raise
            attempt.committing = True
            trans.commit()

    def list_keys(self) -> list[str]:
        if not self._readable("*"):
            return []
        t = self._table
        stmt = sa.select(t.c.poller_name).where(t.c.namespace == self._namespace)
        with self._edge("listing", "*"), self._engine.connect() as conn:
            names = [str(n) for n in conn.execute(stmt).scalars()]
        # Sorted here, not by ORDER BY: database collations disagree on case order.
        return sorted(names)
