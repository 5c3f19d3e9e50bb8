"""Writes that must be on disk before the caller goes on (internal).

A state file, a backup, a quarantined row or a dead letter's mark is written
to be relied on after a crash: Python's buffer is flushed and the kernel's
written through (``fsync``) before the write counts as done.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, AnyStr


def write_synced(fh: IO[AnyStr], data: AnyStr) -> None:
    """Write ``data`` to ``fh`` and wait until it is on disk."""
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())


@contextlib.contextmanager
def locked_lines(path: Path, *, append: bool) -> Iterator[IO[str]]:
    """``path`` opened as text under ``flock``: to append (exclusive; created readable
    by its owner only, since records hold whole rows and error text) or to read
    (shared). Processes that share the file append whole lines, never interleaved."""
    if append:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        opened = os.fdopen(fd, "a", encoding="utf-8")
    else:
        opened = path.open("r", encoding="utf-8")
    with opened as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX if append else fcntl.LOCK_SH)
        yield fh


__all__ = ["locked_lines", "write_synced"]
