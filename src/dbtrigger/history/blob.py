"""A poller's history as append blobs beside its state blob.

Layout, in the container of :class:`~dbtrigger.state.stores.blob.BlobCheckpointStore`::

    state/{app}/orders.json                                   the state document
    state/{app}/orders.history/000000000001.jsonl             append blob: records 1 ...
    state/{app}/orders.history/000000004711.jsonl             the next segment

``list_keys`` of the state store skips names with a ``/`` after the app, so
these are never taken for pollers. Every append is one ``Append Block`` with
an append-position condition (the segment's length as last seen): a second
writer's block moves the position and ours fails with 412, so records are
numbered without a gap or a repeat. The writer keeps the segment's length
from its last append, so an append costs one request; a conflict or a first
append reads the segment's end again. A segment rolls over once it has
reached ``segment_bytes`` or the service's block limit is near (an append blob
takes 50,000 blocks), judged by the segment alone so that every writer at its
end agrees (the new segment's creation then conflicts like a block); pruning
deletes whole segments.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import ResourceExistsError, ResourceNotFoundError
from azure.storage.blob import ContainerClient

from dbtrigger import _azure_errors as azure_errors
from dbtrigger import options as opt
from dbtrigger.errors import CasConflictError, StoreUnavailableError
from dbtrigger.history import store as storemod
from dbtrigger.history.records import record_time
from dbtrigger.names import validate_name

HISTORY_BLOB = azure_errors.StorageService(
    what="history blob",
    role="Storage Blob Data Contributor",
    lost_race_codes=frozenset(
        {"AppendPositionConditionNotMet", "ConditionNotMet", "BlobAlreadyExists"}
    ),
)

#: A segment rolls over past this size ...
DEFAULT_SEGMENT_BYTES = 8 * 1024 * 1024
#: ... or this many appends (the service allows 50,000 blocks per append blob).
MAX_BLOCKS = 45_000


class SegmentGoneError(StoreUnavailableError):
    """A history segment that was listed is gone (pruned meanwhile); list again."""


@dataclass
class _Segment:
    name: str
    size: int
    blocks: int
    #: The number of the last record in it (0: not known).
    last_seq: int = 0
    #: It ends inside a line (damaged: a blob written again by hand and cut short):
    #: the next append starts with a newline, as a file's is cut back to its lines.
    cut: bool = False


def _first_seq(segment: _Segment) -> int:
    """The number of a segment's first record, from its name."""
    return storemod.segment_seq(segment.name) or 0


class BlobHistory:
    """Append-blob history segments under ``{prefix}/{app}/{poller}.history/``.

    ``container`` and ``app`` may be callables (resolved at first use), so a
    history derived from a state store whose settings are read lazily reads
    them just as lazily. ``credential`` gives a refusal's words for the
    credential (the state store's: the app setting it was read from, its SAS's
    expiry); by default they are read from the client.
    """

    def __init__(
        self,
        container: ContainerClient | Any,
        *,
        app: str | Any,
        prefix: str = "state",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        retention: storemod.Retention = storemod.DEFAULT_RETENTION,
        credential: Callable[[], str] | None = None,
    ) -> None:
        #: How long the runtime keeps records here (it prunes after its appends).
        self.retention = retention
        self._container = container
        self._app = app
        self._credential = credential or (lambda: azure_errors.credential_words(self.client, None))
        self.prefix = prefix
        self.segment_bytes = opt.whole("segment_bytes", segment_bytes, minimum=1024)
        #: poller -> the active segment as this writer last saw it.
        self._active: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    @property
    def client(self) -> ContainerClient:
        value = self._container
        return value() if callable(value) and not isinstance(value, ContainerClient) else value

    @property
    def app(self) -> str:
        value = self._app
        return str(value() if callable(value) else value)

    def _folder(self, poller: str) -> str:
        return f"{self.prefix}/{self.app}/{validate_name(poller, 'poller name')}.history/"

    def describe(self) -> str:
        try:
            where = f"{self.client.container_name}/{self.prefix}/{self.app}"
        except Exception:  # noqa: BLE001 - describe never raises (settings unresolved)
            where = f"(unresolved)/{self.prefix}"
        return f"azure-blob:{where}/*.history/"

    def _mapped(
        self, op: str, name: str, *, write: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        return azure_errors.mapped(
            HISTORY_BLOB,
            f"{op} of history blob {name}",
            write=write,
            credential=self._credential,
        )

    # --- segments -----------------------------------------------------------------------

    def _segments(self, poller: str) -> list[_Segment]:
        folder = self._folder(poller)
        with self._mapped("listing", folder + "*"):
            try:
                blobs = list(self.client.list_blobs(name_starts_with=folder))
            except ResourceNotFoundError:
                return []
        found = []
        for blob in blobs:
            rest = blob.name[len(folder) :]
            if "/" in rest or storemod.segment_seq(rest) is None:
                continue
            found.append(_Segment(blob.name, int(blob.size or 0), 0))
        return sorted(found, key=lambda s: s.name)

    def _read_range(self, name: str, offset: int, length: int | None = None) -> bytes:
        """Raises: SegmentGoneError: the segment was listed and is gone now (pruned)."""
        with self._mapped("read", name):
            try:
                downloader = self.client.get_blob_client(name).download_blob(
                    offset=offset, length=length, max_concurrency=1
                )
                return bytes(downloader.readall())
            except ResourceNotFoundError:
                pass
        raise SegmentGoneError(f"history blob {name} is gone (pruned since it was listed)")

    def _where(self, segment: _Segment) -> str:
        return f"blob {self.client.container_name}/{segment.name}"

    def _last_records(self, segment: _Segment, count: int) -> list[dict[str, Any]]:
        return self._last_and_end(segment, count)[0]

    def _last_and_end(self, segment: _Segment, count: int) -> tuple[list[dict[str, Any]], int]:
        def read(start: int, length: int) -> bytes:
            return self._read_range(segment.name, start, length)

        first = _first_seq(segment)
        return storemod.last_records(read, segment.size, count, first, self._where(segment))

    # --- the port -----------------------------------------------------------------------

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        def last(segment: _Segment, n: int) -> list[dict[str, Any]]:
            try:
                return self._last_records(segment, n)
            except SegmentGoneError:
                return []  # pruned meanwhile, with every older one

        return storemod.newest_records(reversed(self._segments(poller)), last, count)

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        def load(segment: _Segment) -> bytes | None:
            if segment.size == 0:
                return b""
            try:
                return self._read_range(segment.name, 0, segment.size)
            except SegmentGoneError:
                return None

        return storemod.read_segments(
            poller, self._segments(poller), _first_seq, load, since_seq, self._where
        )

    def _active_segment(self, poller: str) -> tuple[_Segment | None, int]:
        """The segment to append to and the history's last number, read now.

        An empty newest segment (its creator died before appending) is the
        one to append to when it is named for the next number; otherwise it
        is left over from a conflict and removed. One damaged in every line is
        appended to, after the numbers its lines had (kept: readers report
        them as a gap)."""
        empty: _Segment | None = None
        for listed in reversed(self._segments(poller)):
            # The size the records are read up to is the position appended at:
            # a block landing in between moves it, and our append then conflicts.
            segment = self._props(listed.name, 0)
            last, end = self._last_and_end(segment, 1)
            segment.cut = end < segment.size
            if not last:
                if empty is None:
                    empty = segment
                continue
            segment.last_seq = storemod.last_number(poller, self._where(segment), last[-1])
            if empty is not None:
                if _first_seq(empty) == segment.last_seq + 1:
                    empty.last_seq = segment.last_seq
                    return empty, segment.last_seq
                self._delete(empty.name)
            return segment, segment.last_seq
        return empty, 0

    def _props(self, name: str, last_seq: int) -> _Segment:
        with self._mapped("read", name):
            props = self.client.get_blob_client(name).get_blob_properties()
        return _Segment(
            name, int(props.size), int(props.append_blob_committed_block_count or 0), last_seq
        )

    def _delete(self, name: str) -> None:
        with self._mapped("delete", name, write=True), contextlib.suppress(ResourceNotFoundError):
            self.client.delete_blob(name)

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if not records:
            return
        data = b"".join(storemod.encode_line(r) for r in storemod.numbered(records, after_seq))
        with self._lock:
            active = self._active.get(poller)
        if active is None or active.last_seq != after_seq:
            active, last = self._active_segment(poller)
            storemod.expect_end(poller, last, after_seq)
        try:
            # Full is a fact of the segment, never of this append's size: a writer
            # that rolled over because its records would not fit, and another still
            # at the old segment's end with fewer, would otherwise both write the
            # next numbers (the append-position condition guards one segment only).
            full = active is not None and (
                active.size >= self.segment_bytes or active.blocks >= MAX_BLOCKS
            )
            if active is None or full:
                active = self._new_segment(poller, after_seq + 1)
            elif active.cut:
                data = b"\n" + data
            result = self._append_block(active, data)
        except CasConflictError:
            with self._lock:
                self._active.pop(poller, None)
            raise
        offset = int(result.get("blob_append_offset") or active.size)
        blocks = int(result.get("blob_committed_block_count") or active.blocks + 1)
        with self._lock:
            self._active[poller] = _Segment(
                active.name, offset + len(data), blocks, after_seq + len(records)
            )

    def _new_segment(self, poller: str, first_seq: int) -> _Segment:
        name = self._folder(poller) + storemod.segment_name(first_seq)
        client = self.client.get_blob_client(name)
        with self._mapped("create", name, write=True):
            try:
                client.create_append_blob(match_condition=MatchConditions.IfMissing)
            except ResourceExistsError:
                props = self._props(name, first_seq - 1)
                if props.size:
                    raise CasConflictError(
                        f"history segment {name} exists already: another writer appended first"
                    ) from None
                return props  # an empty segment a writer died after creating
        return _Segment(name, 0, 0)

    def _append_block(self, segment: _Segment, data: bytes) -> dict[str, Any]:
        client = self.client.get_blob_client(segment.name)
        with self._mapped("append", segment.name, write=True):
            result: dict[str, Any] = client.append_block(
                data, appendpos_condition=segment.size, retry_total=0
            )
        return result

    def prune(self, poller: str, retention: storemod.Retention, now: dt.datetime) -> int:
        segments = self._segments(poller)
        described: list[tuple[_Segment, int, dt.datetime | None]] = []
        for segment in segments:
            if segment.size == 0:
                described.append((segment, 0, None))
                continue
            head = self._read_range(segment.name, 0, min(segment.size, storemod.TAIL_CHUNK))
            first = storemod.decode_lines(head)
            described.append((segment, segment.size, record_time(first[0]) if first else None))
        return storemod.prune_segments(
            segments, described, _first_seq, lambda s: self._delete(s.name), retention, now
        )


__all__ = ["HISTORY_BLOB", "BlobHistory"]
