"""Writes that must be on disk before the caller goes on (internal).

A state file, a backup, a quarantined row or a dead letter's mark is written
to be relied on after a crash: Python's buffer is flushed and the kernel's
written through (``fsync``) before the write counts as done.
"""

from __future__ import annotations

import os
from typing import IO, AnyStr


def write_synced(fh: IO[AnyStr], data: AnyStr) -> None:
    """Write ``data`` to ``fh`` and wait until it is on disk."""
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())


__all__ = ["write_synced"]
