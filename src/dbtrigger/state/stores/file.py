"""Local file checkpoint store: the embedded default, safe across processes.

Layout under ``directory``::

    orders.json        the state document (compact JSON; `dbtrigger status` shows it)
    .orders.etag       the document's current etag (a random token) and its digest
    .orders.lock       flock target; never replaced, so locks stay meaningful

Why an etag file rather than a hash or the file's mtime: the etag must change
on every write, including a write of identical bytes, and mtimes are too coarse
(and inodes are reused) to guarantee that between two quick writes. The etag file
also records the SHA-256 of the document written with it: a document replaced
outside the store (``cp backup.json orders.json``) no longer matches it, and is
given an etag of its own, so a writer holding the old etag loses its
compare-and-swap instead of overwriting the copy unseen. Writers hold
an exclusive ``flock`` on the lock file across compare-and-replace; readers
hold a shared one, so a read never pairs a new document with an old etag.

Every lock wait is bounded (``lock_timeout``, 10 s by default): a process
frozen inside a write (stopped, swapped out, stuck on a dead NFS server) makes
the others fail with :class:`~dbtrigger.errors.StoreUnavailableError` and try
again on their next tick, instead of hanging every instance and ``dbtrigger
status`` behind it. Reads also work in a directory this process may not write
(a read-only mount, another user's files): the lock file is then opened read
only, or, when it does not exist and cannot be created, the read goes without
it. A write killed between creating its temporary file and renaming it leaves
that file behind; the next write of the same key, holding the lock, removes it.

Write order is etag first, then document, both by atomic ``os.replace`` with
fsync: a crash in between leaves the old document under a new etag, which is a
state a reader could legitimately have seen (a write of equal bytes), and makes
every writer holding the old etag fail safely rather than overwrite.

POSIX only (Linux and macOS; Azure Functions for Python runs on Linux).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from dbtrigger import options as opt
from dbtrigger._files import write_synced
from dbtrigger.errors import (
    ConfigurationError,
    StoreAuthError,
    StoreUnavailableError,
)
from dbtrigger.names import validate_name
from dbtrigger.state.stores.base import StoredDocument, check_match

#: Seconds a read or write waits for another process's lock before giving up.
DEFAULT_LOCK_TIMEOUT = 10.0

_NO_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _digest(data: bytes) -> str:
    """What the etag file records of the document written with it (a document
    found not matching it was replaced by someone else than this store)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def _os_errors(doing: str, path: Path) -> Iterator[None]:
    """The OS errors of reading, writing or deleting a document as the store's: a
    refusal is :class:`~dbtrigger.errors.StoreAuthError` (permissions to fix); out of
    space, a read-only remount, an I/O error or the directory removed under us is
    :class:`~dbtrigger.errors.StoreUnavailableError`, which the next attempt may retry."""
    try:
        yield
    except PermissionError as exc:
        raise StoreAuthError(f"no permission to {doing} {path}") from exc
    except OSError as exc:
        raise StoreUnavailableError(f"cannot {doing} {path}: {exc.strerror}") from exc


class FileCheckpointStore:
    """State documents as JSON files in one directory.

    Args:
        directory: where the documents live.
        create: create the directory if it is missing.
        lock_timeout: seconds to wait for another process's lock before a
            read or write fails with ``StoreUnavailableError`` (default
            :data:`DEFAULT_LOCK_TIMEOUT`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        create: bool = True,
        lock_timeout: float | None = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigurationError(
                f"FileCheckpointStore takes a directory path, got {type(directory).__name__}"
            )
        self._dir = Path(directory)
        checked = opt.optional_seconds("lock_timeout", lock_timeout)
        self._lock_timeout = DEFAULT_LOCK_TIMEOUT if checked is None else checked
        if self._dir.exists() and not self._dir.is_dir():
            raise ConfigurationError(
                f"state directory {self._dir} is a file: name a directory (created if missing)"
            )
        if create:
            self._dir.mkdir(parents=True, exist_ok=True)

    @property
    def directory(self) -> Path:
        return self._dir

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        validate_name(key, "poller name")
        return (
            self._dir / f"{key}.json",
            self._dir / f".{key}.etag",
            self._dir / f".{key}.lock",
        )

    def _open_lock(self, lock_path: Path, exclusive: bool) -> int | None:
        """The lock file's descriptor; None for a read where no lock can exist."""
        try:
            return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError as exc:
            raise StoreUnavailableError(f"state directory {self._dir} does not exist") from exc
        except OSError as exc:
            if exc.errno not in _NO_WRITE:
                raise StoreUnavailableError(f"cannot open {lock_path}: {exc.strerror}") from exc
            if exclusive:
                if exc.errno == errno.EROFS:
                    raise StoreUnavailableError(
                        f"cannot write in {self._dir}: the file system is read-only"
                    ) from exc
                raise StoreAuthError(f"no permission to use {lock_path}") from exc
        # A read in a directory we may not write: share the writers' lock read-only.
        try:
            return os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None  # nobody ever wrote through a lock here; nothing to wait for
        except OSError as exc:
            raise StoreAuthError(f"no permission to use {lock_path}") from exc

    @contextlib.contextmanager
    def _locked(self, lock_path: Path, exclusive: bool) -> Iterator[None]:
        fd = self._open_lock(lock_path, exclusive)
        if fd is None:
            yield
            return
        try:
            self._wait_for_lock(fd, lock_path, exclusive)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def _wait_for_lock(self, fd: int, lock_path: Path, exclusive: bool) -> None:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + self._lock_timeout
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, mode)
                return
            except BlockingIOError:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailableError(
                    f"{lock_path} stayed locked by another process for {self._lock_timeout:g} s "
                    "(an instance frozen inside a write?); nothing was read or changed, "
                    "the next attempt tries again",
                    lock_timeout=self._lock_timeout,
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.05)

    def _remove_leftovers(self, *paths: Path) -> None:
        """Delete temporary files of ``paths`` left by a killed write (lock held)."""
        patterns = [re.compile(rf"^\.{re.escape(p.name)}\.[A-Za-z0-9_]{{8}}\.tmp$") for p in paths]
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._dir):
                if entry.name.endswith(".tmp") and any(p.match(entry.name) for p in patterns):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    @staticmethod
    def _read_unlocked(doc_path: Path, etag_path: Path) -> StoredDocument | None:
        try:
            data = doc_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            etag, _, digest = etag_path.read_text().strip().partition(" ")
        except FileNotFoundError:
            etag, digest = "", ""
        if not etag or (digest and digest != _digest(data)):
            # A document placed by hand (a restored backup, ``cp`` over it): an etag
            # of its own, so that no writer holding the old one overwrites it unseen.
            etag = '"h' + hashlib.sha256(data).hexdigest()[:24] + '"'
        return StoredDocument(data, etag)

    def _replace(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                write_synced(fh, data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _fsync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, key: str) -> StoredDocument | None:
        doc_path, etag_path, lock_path = self._paths(key)
        if not self._dir.is_dir():
            raise StoreUnavailableError(f"state directory {self._dir} does not exist")
        with self._locked(lock_path, exclusive=False), _os_errors("read", doc_path):
            return self._read_unlocked(doc_path, etag_path)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        doc_path, etag_path, lock_path = self._paths(key)
        with self._locked(lock_path, exclusive=True):
            with _os_errors("read", doc_path):
                current = self._read_unlocked(doc_path, etag_path)
            check_match(current, if_match, str(doc_path))
            self._remove_leftovers(doc_path, etag_path)
            etag = f'"{uuid.uuid4().hex}"'
            # Each file is replaced whole: a write that fails leaves nothing new visible.
            with _os_errors("write", doc_path):
                self._replace(etag_path, f"{etag} {_digest(data)}".encode())
                self._replace(doc_path, bytes(data))
                self._fsync_dir()
            return etag

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        doc_path, etag_path, lock_path = self._paths(key)
        with self._locked(lock_path, exclusive=True):
            with _os_errors("read", doc_path):
                current = self._read_unlocked(doc_path, etag_path)
            if current is None:
                return
            if if_match is not None:
                check_match(current, if_match, str(doc_path))
            with _os_errors("delete", doc_path):
                doc_path.unlink()
                with contextlib.suppress(FileNotFoundError):
                    etag_path.unlink()

    def list_keys(self) -> list[str]:
        if not self._dir.is_dir():
            return []
        return sorted(p.stem for p in self._dir.glob("*.json") if not p.name.startswith("."))

    def describe(self) -> str:
        return f"file:{self._dir.absolute()}"  # pasted with --store: any directory
