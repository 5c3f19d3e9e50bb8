"""A poller's history as JSON-lines files next to its state file.

Layout, in the state directory of :class:`~dbtrigger.state.stores.file.FileCheckpointStore`::

    orders.json                                 the state document
    orders.history.000000000001.jsonl           history records 1 ... (one JSON object a line)
    orders.history.000000004711.jsonl           the next segment, from record 4711
    .orders.history.lock                        flock target of appends and pruning

``list_keys`` of the checkpoint store only sees ``*.json``, so these files are
never taken for pollers. An append holds an exclusive ``flock`` (bounded wait,
like the state files), reads the last record's number from the end of the last
segment, appends and fsyncs: records are numbered without a gap or a repeat
across processes. A write killed half way leaves a last line without its
newline; the next append (holding the lock) cuts it off before writing, and
readers skip it. A segment rolls over past ``segment_bytes``; pruning removes
whole segments (:func:`~dbtrigger.history.store.prunable_segments`), so no
file is ever rewritten. Files are created readable by their owner only (the
records hold row keys).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dbtrigger import options as opt
from dbtrigger.errors import StoreAuthError, StoreUnavailableError
from dbtrigger.history import store as storemod
from dbtrigger.history.records import record_time
from dbtrigger.names import validate_name

#: A segment rolls over past this size.
DEFAULT_SEGMENT_BYTES = 8 * 1024 * 1024
#: How often ``tail`` lists the segments again when one it listed is gone (pruned).
TAIL_ATTEMPTS = 5


class FileHistory:
    """JSON-lines history files in ``directory`` (a state store's directory)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        lock_timeout: float = 10.0,
        retention: storemod.Retention = storemod.DEFAULT_RETENTION,
    ) -> None:
        self.directory = Path(directory)
        #: How long the runtime keeps records here (it prunes after its appends).
        self.retention = retention
        self.segment_bytes = opt.whole("segment_bytes", segment_bytes, minimum=1024)
        self.lock_timeout = opt.seconds("lock_timeout", lock_timeout)

    def describe(self) -> str:
        return f"file:{Path(self.directory).absolute()}/*.history.*.jsonl"

    # --- files ---------------------------------------------------------------------

    def _segments(self, poller: str) -> list[Path]:
        validate_name(poller, "poller name")
        prefix = f"{poller}.history."
        try:
            names = [
                entry.name
                for entry in os.scandir(self.directory)
                if entry.name.startswith(prefix) and entry.name.endswith(".jsonl")
            ]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreUnavailableError(f"cannot list {self.directory}: {exc.strerror}") from exc
        found = [(storemod.segment_seq(n[len(prefix) :]), n) for n in names]
        return [self.directory / n for _, n in sorted((s, n) for s, n in found if s is not None)]

    @staticmethod
    def _first_seq(path: Path) -> int:
        """The number of a segment's first record, from its name."""
        return storemod.segment_seq(path.name.split(".history.", 1)[1]) or 0

    @contextlib.contextmanager
    def _locked(self, poller: str) -> Iterator[None]:
        path = self.directory / f".{poller}.history.lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except PermissionError as exc:
            raise StoreAuthError(f"no permission to use {path}") from exc
        except OSError as exc:
            raise StoreUnavailableError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StoreUnavailableError(
                            f"{path} stayed locked for {self.lock_timeout:g} s; the history "
                            "append is tried again later"
                        ) from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)

    @classmethod
    def _last_records(cls, path: Path, count: int) -> tuple[list[dict[str, Any]], int]:
        """The last ``count`` complete records of one segment, and where its complete
        lines end (bytes): anything after that is a torn write. (A segment damaged in
        every line: :func:`~dbtrigger.history.store.last_records`.)"""
        with path.open("rb") as fh:

            def read(start: int, length: int) -> bytes:
                fh.seek(start)
                return fh.read(length)

            size = fh.seek(0, os.SEEK_END)
            return storemod.last_records(read, size, count, cls._first_seq(path), str(path))

    # --- the port ------------------------------------------------------------------

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        def last(path: Path, n: int) -> list[dict[str, Any]]:
            return self._last_records(path, n)[0]

        missing = ""
        for _ in range(TAIL_ATTEMPTS):
            try:
                return storemod.newest_records(reversed(self._segments(poller)), last, count)
            except FileNotFoundError as exc:
                missing = str(exc.filename)  # pruned under us: list again
            except OSError as exc:
                raise StoreUnavailableError(
                    f"cannot read the history of {poller!r}: {exc}"
                ) from exc
        raise StoreUnavailableError(
            f"history segment {missing} is listed but cannot be opened ({TAIL_ATTEMPTS} tries): "
            "a link to a missing file, or a file removed by hand? Restore or remove it"
        )

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        def load(path: Path) -> bytes | None:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise StoreUnavailableError(f"cannot read {path}: {exc.strerror}") from exc

        return storemod.read_segments(
            poller, self._segments(poller), self._first_seq, load, since_seq
        )

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if not records:
            return
        with self._locked(poller):
            last_seq, path, end = 0, None, 0
            for candidate in reversed(self._segments(poller)):
                found, end = self._last_records(candidate, 1)
                if found:
                    last_seq = storemod.last_number(poller, str(candidate), found[-1])
                    path = candidate
                    break
                candidate.unlink()  # only a torn line of a killed writer: nothing in it
            storemod.expect_end(poller, last_seq, after_seq)
            lines = [storemod.encode_line(r) for r in storemod.numbered(records, after_seq)]
            try:
                # Several records (the appender's round) roll over where one at a
                # time would have: a segment stays about segment_bytes, which is
                # what retention prunes by.
                first = after_seq + 1
                while lines:
                    if path is None or (end > 0 and end >= self.segment_bytes):
                        path = self.directory / f"{poller}.history.{storemod.segment_name(first)}"
                        end = 0
                    take = 1
                    size = end + len(lines[0])
                    while take < len(lines) and size < self.segment_bytes:
                        size += len(lines[take])
                        take += 1
                    self._write(path, b"".join(lines[:take]), end)
                    lines, first, end = lines[take:], first + take, size
            except PermissionError as exc:
                raise StoreAuthError(f"no permission to append to {path}") from exc
            except OSError as exc:
                raise StoreUnavailableError(
                    f"cannot append to the history of {poller!r}: {exc.strerror}"
                ) from exc

    def _write(self, path: Path, data: bytes, end: int) -> None:
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != end:
                os.ftruncate(fd, end)  # a torn last line of a killed writer
            os.lseek(fd, end, os.SEEK_SET)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def prune(self, poller: str, retention: storemod.Retention, now: dt.datetime) -> int:
        with self._locked(poller):
            segments = self._segments(poller)
            described = []
            for path in segments:
                try:
                    size = path.stat().st_size
                    with path.open("rb") as fh:
                        first = storemod.decode_lines(fh.readline())
                except FileNotFoundError:
                    continue
                described.append((path, size, record_time(first[0]) if first else None))
            return storemod.prune_segments(
                segments,
                described,
                self._first_seq,
                lambda path: path.unlink(missing_ok=True),
                retention,
                now,
            )

    def delete(self, poller: str) -> None:
        """Remove the whole history of ``poller`` (tests; a poller removed for good)."""
        with self._locked(poller):
            for path in self._segments(poller):
                path.unlink(missing_ok=True)


__all__ = ["DEFAULT_SEGMENT_BYTES", "FileHistory"]
