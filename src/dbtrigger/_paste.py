"""Commands printed for a person to paste: they must work wherever they are pasted.

A ``--source MODULE:ATTR`` is imported from the current directory (as ``dbtrigger
run`` imports it), and a trigger's relative paths (``FileCheckpointStore("./state")``,
``sqlite:///shop.db``) resolve against it too. A worker started in ``/srv/app``
that printed ``dbtrigger status orders --source app:orders`` gave a command that
fails when pasted into a shell elsewhere (``cannot import 'app'``) or, worse, opens
another directory's empty ``./state``. :func:`pasteable` puts ``cd /srv/app &&``
in front of such a command: when the module it names was imported from the
current directory. A module installed in site-packages needs none.
"""

from __future__ import annotations

import itertools
import os
import shlex
import sys
from pathlib import Path

__all__ = ["absolute_sqlite_url", "pasteable"]


def _module_dir(spec: str) -> str | None:
    """The current directory, when ``spec``'s module was imported from under it."""
    module = sys.modules.get(spec.partition(":")[0])
    file = getattr(module, "__file__", None)
    if not file:
        return None
    try:
        cwd = os.getcwd()
        Path(file).resolve().relative_to(Path(cwd).resolve())
    except (OSError, ValueError):
        return None
    return cwd


def pasteable(command: str) -> str:
    """``command``, preceded by ``cd DIR &&`` when its ``--source`` (or
    ``--accept-source``, ``--trigger``) module was imported from the current
    directory ``DIR``; unchanged otherwise."""
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    for flag, value in itertools.pairwise(words):
        if flag in ("--source", "--accept-source", "--trigger") and ":" in value:
            where = _module_dir(value)
            if where is not None:
                return f"cd {shlex.quote(where)} && {command}"
    return command


def absolute_sqlite_url(url: str) -> str:
    """``sqlite:///shop.db`` as ``sqlite:////srv/app/shop.db``: a relative SQLite file
    names another (empty) database in another directory. Other URLs unchanged (a
    password already masked stays masked)."""
    if not url.startswith("sqlite"):
        return url
    from sqlalchemy.engine import make_url  # noqa: PLC0415 - SQLite URLs only

    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: print it as given
        return url
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return url
    if os.path.isabs(database):
        return url
    return parsed.set(database=os.path.abspath(database)).render_as_string(hide_password=False)
