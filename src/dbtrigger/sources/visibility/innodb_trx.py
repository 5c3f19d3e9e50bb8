"""One observation of a MariaDB/MySQL server's writers, for the transaction horizon.

An observation reads the running statements (``PROCESSLIST``, live), then the
highest visible cursor value and the open write transactions
(``information_schema.INNODB_TRX``) in one snapshot transaction. It is usable
only with proof that ``INNODB_TRX``, a cache, was filled *after* the
process-list read (see ``docs/visibility.md``).

**Filled after.** InnoDB refills the cache when a read finds it unread for
more than 100 ms, server-wide (``trx_i_s.cc``: every reader's end of read
resets the clock). Each read of it carries a marker in its SQL,
``dbtrigger-trx:<stamp>:<nonce>``, whose stamp is a server clock reading
taken before the statement was sent. A cache row showing a marker was filled
while that statement ran, so after its stamp: a marker stamped later than a
clock reading this observation took after its process-list read returned
proves the cache fresh for it, whichever session's read refilled it (the
cache row of this session showing its own marker is the special case).

**Taking turns.** Several guards reading the cache more often than every
100 ms between them keep it stale for all of them. So the readers of one
server take turns (``GET_LOCK``, server-wide, across processes): a reader
holding the turn reads; a stale cache it waits out (no other guard reads in
the meantime) and reads again, so the next read refills it; one refill then
serves every guard that was waiting for the turn (their process-list reads
had returned before the marker's stamp). Readers that do not take turns (monitoring
tools, older versions) can still keep it stale: the guard then counts stale
reads and the horizon says so.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

#: InnoDB refreshes its ``INNODB_TRX`` cache only when it was last read more
#: than 100 ms ago; a re-read waits a little longer than that.
CACHE_SECONDS = 0.11

#: How long a guard waits for its turn before it reads without one (a turn
#: holder that hangs must not stop every guard of the server). Whole seconds
#: (MySQL's GET_LOCK).
TURN_WAIT_SECONDS = 2

#: How long a guard holding the turn keeps re-reading a stale cache (other
#: sessions that do not take turns are reading it) before it gives up.
TURN_BUDGET_SECONDS = 1.0

# GET_LOCK's name is server-wide. The statement is fixed text, so that the
# process-list read can recognise other guards waiting for their turn (a
# running statement would otherwise hold a timestamp horizon back to its start).
# NOW(6) is the statement's start: after the process-list read has returned.
TURN_SQL = (
    f"SELECT GET_LOCK('dbtrigger:innodb_trx', {TURN_WAIT_SECONDS}) AS turn, "
    "UNIX_TIMESTAMP(NOW(6)) AS listed"
)
_TURN = sa.text(TURN_SQL)
_TRY_TURN = sa.text("SELECT GET_LOCK('dbtrigger:innodb_trx', 0)")
_END_TURN = sa.text("SELECT RELEASE_LOCK('dbtrigger:innodb_trx')")
_CLOCK = sa.text("SELECT UNIX_TIMESTAMP(NOW(6))")
_NOT_SUPPORTED = 1235  # ER_NOT_SUPPORTED_YET

# Running statements of other sessions, with the server clock of this read.
# PROCESSLIST is live (not cached). Sleeping sessions run nothing; daemons and
# binlog dumps write no user rows; a guard waiting for its turn runs GET_LOCK.
# TIME_MS (MariaDB) is measured from the statement's start, the same instant
# NOW() returns inside it.
_STATEMENTS_SQL = """
    SELECT UNIX_TIMESTAMP(NOW(6)) AS now, p.ID AS thread_id, {running} AS running
      FROM (SELECT 1 AS one) AS d
      LEFT JOIN information_schema.PROCESSLIST AS p
        ON p.ID <> CONNECTION_ID()
       AND p.COMMAND NOT IN ('Sleep', 'Daemon', 'Binlog Dump', 'Binlog Dump GTID')
       AND NOT (p.INFO <=> :turn)
    """
_STATEMENTS_MARIADB = sa.text(_STATEMENTS_SQL.format(running="p.TIME_MS / 1000"))
# MySQL has no TIME_MS; TIME is whole seconds, so one more second is assumed.
_STATEMENTS_MYSQL = sa.text(_STATEMENTS_SQL.format(running="p.TIME + 1"))
_SNAPSHOT = sa.text("START TRANSACTION WITH CONSISTENT SNAPSHOT")
# Open transactions that have written, this session's own transaction, and
# the transactions of sessions whose statement shows a marker. The marker
# comes first: trx_query is cut at 1024 characters. trx_started is in the
# server's system time zone at one-second resolution; "started" is it as an
# epoch (used only where nothing better is known, and for reporting).
_MARK = "dbtrigger-trx:"  # (spelt out in the SQL below)
_TRANSACTIONS = sa.text(
    """
    SELECT :marker AS marker, UNIX_TIMESTAMP(NOW(6)) AS now, CONNECTION_ID() AS me,
           t.trx_id AS trx_id, t.trx_mysql_thread_id AS thread_id, t.trx_state AS state,
           t.trx_rows_modified AS modified,
           t.trx_mysql_thread_id = CONNECTION_ID() AND LOCATE(:marker, t.trx_query) > 0 AS own,
           SUBSTRING(t.trx_query, LOCATE('dbtrigger-trx:', t.trx_query), 80) AS seen,
           UNIX_TIMESTAMP(NOW(6)) - TIMESTAMPDIFF(
               MICROSECOND, t.trx_started, CONVERT_TZ(NOW(6), @@session.time_zone, 'SYSTEM')
           ) / 1000000 AS started
      FROM (SELECT 1 AS one) AS d
      LEFT JOIN information_schema.INNODB_TRX AS t
        ON t.trx_rows_modified > 0 OR t.trx_mysql_thread_id = CONNECTION_ID()
        OR LOCATE('dbtrigger-trx:', t.trx_query) > 0
    """
)
_STAMP = re.compile(re.escape(_MARK) + r"(\d{1,12}\.\d{1,6}):[0-9a-f]{32}")


@dataclass(frozen=True)
class Writer:
    trx_id: str
    thread_id: int
    started: Decimal | None  # trx_started as an epoch (second resolution)
    lower: Decimal | None  # no statement of it began before this (epoch); None: unknown
    state: str


@dataclass
class Observation:
    at: Decimal  # server clock before the process-list read (epoch)
    sampled_at: Decimal  # server clock after the snapshot the max was read in
    statements: dict[int, Decimal]  # thread -> start of its running statement (epoch)
    writers: dict[tuple[int, str], Writer]
    max_value: Any  # highest visible cursor (in the snapshot)
    max_epoch: Decimal | None  # the same as an epoch (timestamp cursors)

    def cutoff(self) -> tuple[Decimal | None, Any]:
        """The earliest time a pending value can carry, and what sets it.

        Returns ``(None, writer)`` when an open writer's earliest statement is
        unknown (it was already open when the guard started): nothing can be
        consumed until it has ended. The writer returned is the oldest such.
        """
        unknown = [w for w in self.writers.values() if w.lower is None]
        if unknown:
            return None, min(unknown, key=lambda w: (w.started is None, w.started or 0))
        cut: Decimal = self.at
        blocker: Any = None
        for thread, start in self.statements.items():
            if start < cut:
                cut, blocker = start, ("statement", thread, start)
        for writer in self.writers.values():
            if writer.lower is not None and writer.lower < cut:
                cut, blocker = writer.lower, writer
        return cut, blocker


@dataclass(frozen=True)
class Observed:
    """What one attempt gave: the observation (None: no proof of a fresh cache),
    and how many reads of ``INNODB_TRX`` found it stale on the way."""

    observation: Observation | None
    stale_reads: int
    turn: bool  # the read(s) were made holding the turn


MaxReader = Callable[[Connection], tuple[Any, Decimal | None]]


def observe(conn: Connection, previous: Observation | None, read_max: MaxReader) -> Observed:
    """One observation (see the module docstring); ends the connection's transaction."""
    mariadb = bool(getattr(conn.dialect, "is_mariadb", True))
    listing = conn.execute(
        _STATEMENTS_MARIADB if mariadb else _STATEMENTS_MYSQL, {"turn": TURN_SQL}
    ).all()
    conn.rollback()
    at = Decimal(listing[0].now)
    statements = {
        int(r.thread_id): at - Decimal(r.running)
        for r in listing
        if r.thread_id is not None and r.running is not None
    }
    turn, listed = _take_turn(conn)
    try:
        # Our own InnoDB transaction starts after the process-list read; the
        # max's snapshot precedes the list's clock reading ("sampled_at").
        conn.execute(_SNAPSHOT)
        max_value, max_epoch = read_max(conn)
        rows, stale = _read_fresh(conn, listed, patient=turn)
        conn.rollback()
    finally:
        if turn:
            end_turn(conn)
    if rows is None:
        return Observed(None, stale, turn)
    me = rows[0].me
    writers: dict[tuple[int, str], Writer] = {}
    for r in rows:
        if r.trx_id is None or r.thread_id == me or not r.modified:
            continue
        key = (int(r.thread_id), str(r.trx_id))
        writers[key] = Writer(
            trx_id=key[1],
            thread_id=key[0],
            started=None if r.started is None else Decimal(r.started),
            lower=lower_bound(key, previous),
            state=str(r.state),
        )
    observation = Observation(at, Decimal(rows[0].now), statements, writers, max_value, max_epoch)
    return Observed(observation, stale, turn)


def _read_fresh(conn: Connection, listed: Decimal, *, patient: bool) -> tuple[Any, int]:
    """Read ``INNODB_TRX`` until it shows a refill after ``listed`` (a clock
    reading taken after the process-list read returned): (rows or None, stale
    reads).

    Holding the turn (``patient``), a stale cache is waited out and read again,
    with growing, jittered pauses, for up to ``TURN_BUDGET_SECONDS``: no other
    guard reads meanwhile, so only sessions that do not take turns can keep it
    stale that long. Without the turn, one read.
    """
    deadline = time.monotonic() + TURN_BUDGET_SECONDS
    pause = CACHE_SECONDS
    stale = 0
    while True:
        stamp = Decimal(conn.execute(_CLOCK).scalar_one())
        marker = f"{_MARK}{stamp}:{uuid.uuid4().hex}"
        rows = conn.execute(_TRANSACTIONS, {"marker": marker}).all()
        if _fresh(rows, listed):
            return rows, stale
        stale += 1
        if not patient or time.monotonic() + pause > deadline:
            return None, stale
        time.sleep(pause * random.uniform(1.0, 1.3))  # noqa: S311 - jitter, not secrecy
        pause *= 1.6


def _fresh(rows: Any, listed: Decimal) -> bool:
    """The cache was filled after ``listed``: it shows this very read, or another
    reader's marker stamped after ``listed`` (and not after this read's clock).

    After the process-list read *returned*, not after it began: a writer whose
    first statement began before the read, had not modified a row when the
    cache was filled, and ended before the read looked at its session would be
    in neither list.
    """
    now = Decimal(rows[0].now)
    for r in rows:
        if r.own:
            return True
        found = _STAMP.search(r.seen or "")
        if found is not None and listed < Decimal(found.group(1)) <= now:
            return True
    return False


def _lock_refused(exc: DBAPIError) -> bool:
    """Is ``exc`` the server refusing GET_LOCK ("not supported yet", as Galera
    nodes do)? Then the reader goes on without the turn."""
    args: tuple[Any, ...] = getattr(exc.orig, "args", ())
    return bool(args) and args[0] == _NOT_SUPPORTED


def _take_turn(conn: Connection) -> tuple[bool, Decimal]:
    """Wait for the turn (up to ``TURN_WAIT_SECONDS``; False: read without it),
    and a server clock reading taken after the process-list read returned."""
    try:
        row = conn.execute(_TURN).one()
    except DBAPIError as exc:
        if not _lock_refused(exc):  # (refused: read as before)
            raise
        conn.rollback()
        return False, Decimal(conn.execute(_CLOCK).scalar_one())
    return bool(row.turn), Decimal(row.listed)


def try_turn(conn: Connection) -> bool | None:
    """Take the turn only if it is free now: True (taken: :func:`end_turn` it),
    False (another guard holds it), None (GET_LOCK refused: read without it).

    For readers that need no fresh cache (the safety window's overrun check):
    reading only holding the turn, they never read while a guard waits out a
    stale cache.
    """
    try:
        return bool(conn.execute(_TRY_TURN).scalar())
    except DBAPIError as exc:
        if not _lock_refused(exc):
            raise
        conn.rollback()
        return None


def end_turn(conn: Connection) -> None:
    try:
        conn.execute(_END_TURN)
        conn.rollback()
    except DBAPIError:
        # The connection is gone, and the lock with it; a connection that is
        # not gone must not go back to the pool holding the turn.
        conn.invalidate()
        raise


def lower_bound(key: tuple[int, str], previous: Observation | None) -> Decimal | None:
    """No statement of this writing transaction read the clock before the returned time.

    Seen writing last time: what was known then. New since the last
    observation: its writes began after that observation's clock reading, or
    in the statement its thread was running then (every write that ended
    before the process-list read would have put it in that observation's
    transaction list, which was filled after the read). Already open when the
    guard started (no previous observation): None, unknown. InnoDB's
    ``trx_started`` is no bound: a first statement that waited on a metadata
    lock (``LOCK TABLES``, ``FLUSH TABLES WITH READ LOCK``, an online
    ``ALTER``) read the clock, and allocated nothing in InnoDB, for as long as
    it waited, so its value can be any time before ``trx_started``. Such a
    writer holds the bound where it is until it ends.
    """
    if previous is None:
        return None
    known = previous.writers.get(key)
    if known is not None:
        return known.lower
    lower = previous.at
    running = previous.statements.get(key[0])
    if running is not None and running < lower:
        lower = running
    return lower


__all__ = [
    "CACHE_SECONDS",
    "MaxReader",
    "Observation",
    "Observed",
    "Writer",
    "end_turn",
    "lower_bound",
    "observe",
    "try_turn",
]
