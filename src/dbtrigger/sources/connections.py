"""Where a source's statements get their connections: a checkout with the one
driver failure outside the DB-API tree mapped, and the connection a catch-up keeps.

Every statement of a :class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource`
runs on a connection from :meth:`SourceConnections.open`, except the fetches
that keep theirs. A fetch in autocommit (every statement its own transaction with its own
snapshot) that returned a full batch keeps its pooled connection for the next
fetch: checking a connection out of the pool and back in costs about as much as
reading 30 narrow rows, and nothing but the socket outlives the fetch. A short
batch, any other statement of the source and its ``close()`` give it back; one
that sat idle as long as a pooled connection may go unpinged is pinged first
(:mod:`dbtrigger._engine`), and replaced if the server dropped it.

A statement that gave up waiting for a lock is told apart from other driver
errors (:mod:`dbtrigger.sources.lock_waits`): :meth:`SourceConnections.error`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from dbtrigger._driver_errors import encoding_problem
from dbtrigger._engine import PING_AFTER_IDLE_SECONDS, ping
from dbtrigger.errors import DbTriggerError, SourceDefinitionError
from dbtrigger.sources.errors_map import mapped_error

#: The error for a driver error raised while ``what`` that only the source can word
#: (a lock wait that ran out), or None.
SpecialError = Callable[[BaseException, str], DbTriggerError | None]


class SourceConnections:
    """A source's connections: ``engine`` and ``name`` are read when a statement
    runs (the URL may be an app setting resolved at first use), ``resolve``
    readies the table's shape on a connection before its first statement,
    ``special`` words the driver errors it knows better than :func:`mapped_error`.
    The kept connection is at most one, with when it was last used."""

    def __init__(
        self,
        engine: Callable[[], Engine],
        name: Callable[[], str],
        resolve: Callable[[Connection], None],
        special: SpecialError | None = None,
    ) -> None:
        self._engine = engine
        self._name = name
        self._resolve = resolve
        self._special = special
        self._held: tuple[Connection, float] | None = None
        self._lock = threading.Lock()
        #: How many times :meth:`close` ran: a connection checked out before the
        #: last close belongs to a disposed pool (see :meth:`give_back`).
        self.generation = 0
        #: Statements of :meth:`open` under way: while one is, a fetch ending on
        #: another thread (a read-ahead) gives its connection back instead of
        #: keeping it, since that statement may be waiting for it (a one-connection pool).
        self._opening = 0

    def checkout(self, engine: Engine | None = None) -> Connection:
        """``engine.connect()``, a driver failure outside the DB-API tree mapped.

        The one such failure known (a PostgreSQL database in ``SQL_ASCII``,
        where the dialect's first connection raises ``TypeError``) is an
        operator error naming the fix, never a raw exception out of a tick.
        """
        try:
            return (engine or self._engine()).connect()
        except TypeError as exc:
            problem = encoding_problem(exc)
            if problem is None:
                raise
            raise SourceDefinitionError(f"connecting to {self._name()} failed: {problem}") from exc

    @contextlib.contextmanager
    def open(
        self, what: str, *, engine: Engine | None = None, diagnose: bool = False
    ) -> Iterator[Connection]:
        """A connection with the shape resolved, driver errors of ``what`` mapped.
        The kept connection goes back to the pool first: every other statement
        runs on a connection of its own and never waits for the one kept."""
        with self._lock:
            self._opening += 1
        try:
            self.release()
            generation = self.generation
            try:
                conn = self.checkout(engine)
                try:
                    self._resolve(conn)
                    yield conn
                finally:
                    self.give_back(conn, generation)
            except sa.exc.SQLAlchemyError as exc:
                raise self.error(exc, what, diagnose=diagnose) from exc
        finally:
            with self._lock:
                self._opening -= 1

    def error(self, exc: BaseException, what: str, *, diagnose: bool = False) -> DbTriggerError:
        """The dbtrigger error for a driver error raised while ``what``: the source's
        own wording when it has one (``special``), else :func:`mapped_error`'s."""
        special = self._special(exc, what) if self._special is not None else None
        return special or mapped_error(exc, what, diagnose=diagnose)

    def take(self, engine: Engine) -> Connection | None:
        """The kept connection, if it is ``engine``'s and still usable (the caller
        owns it now: it keeps it again or closes it)."""
        with self._lock:
            held, self._held = self._held, None
        if held is None:
            return None
        conn, since = held
        if conn.engine is not engine or conn.invalidated:
            conn.close()
            return None
        if time.monotonic() - since >= PING_AFTER_IDLE_SECONDS:
            try:
                ping(engine, conn.connection.dbapi_connection)
            except sa.exc.DisconnectionError:
                conn.invalidate()
                conn.close()
                return None
        return conn

    def keep(self, conn: Connection, generation: int) -> None:
        """Hold ``conn`` (checked out in ``generation``) for the next fetch; given
        back instead if one is held already, the source was closed since, or
        another statement is getting a connection (it may be waiting for this one)."""
        if conn.in_transaction():
            conn.rollback()  # SQLAlchemy's own bookkeeping; autocommit left nothing open
        with self._lock:
            if self._held is None and generation == self.generation and not self._opening:
                self._held = (conn, time.monotonic())
                return
        self.give_back(conn, generation)

    def give_back(self, conn: Connection, generation: int) -> None:
        """Close ``conn`` (checked out in ``generation``): back to its pool, or, when
        the source was closed since (a read-ahead carried past its tick still
        running when the worker closed it), its database session closed too: the
        disposed pool would keep it open, checked in where nobody checks it out.

        The check and the return are one step under the lock :meth:`close`
        takes to count a generation: a ``close()`` (and the source's pool
        disposal after it) landing between them would leave the connection in
        the disposed pool with its session open."""
        with self._lock:
            if generation != self.generation:
                conn.invalidate()
            conn.close()

    def close(self) -> None:
        """The source is closing: give the kept connection back, and every
        connection checked out until now is closed when it comes back."""
        with self._lock:
            self.generation += 1
            self._release_held()

    def release(self) -> None:
        """Give the kept connection back to the pool; nothing when none is kept."""
        if self._held is None:
            return
        with self._lock:
            self._release_held()

    def _release_held(self) -> None:
        """(Under the lock, so a ``close()`` never lands between the kept
        connection's taking and its return: see :meth:`give_back`.)"""
        held, self._held = self._held, None
        if held is not None:
            held[0].close()


__all__ = ["SourceConnections"]
