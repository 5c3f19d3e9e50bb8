"""An SQLite database file replaced or deleted under a running worker.

A pooled SQLite connection holds the file it opened, not its name. When the
file is replaced (a restore from backup, a deploy that copies a fresh
database, ``mv new.db shop.db``) or deleted, the pool's connections go on
reading the old, unlinked file: every tick finds nothing new, and the rows
written to the file the name now names are never delivered, without a word.

:func:`follow_file` makes an engine made from a URL follow the name: each
connection remembers which file (device, inode) it opened, and a checkout of
one whose file is no longer the one at that path is discarded, so the pool
opens the file the name names now. A file that is gone is a
:class:`~dbtrigger.errors.FetchError` naming it, raised before SQLite would
create an empty file in its place: the tick fails, the checkpoint stays, and
the worker resumes once the file is back.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger.errors import FetchError

log = logging.getLogger("dbtrigger.sources")

_OPENED = "dbtrigger_sqlite_file"


def _database_path(engine: Engine) -> str | None:
    """The file an SQLite engine opens (absolute), or None (in memory, a URI, not SQLite)."""
    url = engine.url
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or url.query.get("uri"):
        return None
    return os.path.abspath(database)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return (stat.st_dev, stat.st_ino)


def _gone(path: str) -> FetchError:
    return FetchError(
        f"the SQLite database file {path} is gone: it was deleted or moved while the "
        "worker ran. Put the database back at that path (the worker resumes from its "
        "checkpoint), or stop the worker; nothing was read and the checkpoint is unchanged"
    )


def follow_file(engine: Engine) -> None:
    """Make ``engine``'s connections follow the file its URL names (see the module)."""
    path = _database_path(engine)
    if path is None:
        return
    seen = [False]  # whether the file existed once: only then is a missing file news

    def before_connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> None:
        del dialect, record, cargs, cparams
        if seen[0] and _identity(path) is None:
            raise _gone(path)

    def connected(dbapi_connection: Any, record: Any) -> None:
        del dbapi_connection
        opened = _identity(path)
        record.info[_OPENED] = opened
        if opened is not None:
            seen[0] = True

    def checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        del dbapi_connection, proxy
        opened = record.info.get(_OPENED)
        now = _identity(path)
        if opened is None or now == opened:
            return
        if now is None:
            raise _gone(path)
        log.warning(
            "the SQLite database file %s was replaced while the worker ran; reading the "
            "new file from the checkpoint",
            path,
            extra={"event": "sqlite_file_replaced", "path": path},
        )
        raise sa.exc.DisconnectionError(f"{path} was replaced")

    sa.event.listen(engine, "do_connect", before_connect)
    sa.event.listen(engine, "connect", connected)
    sa.event.listen(engine, "checkout", checked_out)


__all__ = ["follow_file"]
