"""Change-log rows as events, at the cost the log's images make unavoidable.

Every row is checked and its images parsed before any handler runs, as
before: a malformed row fails the batch (``SerializationError``), never a
handler's read, and the history hashes every event's images anyway. What
cannot fail is left until it is read, as :func:`dbtrigger.events.events_from_rows`
does for a table's rows: an event's id (a SHA-256 per row, which a batch
delivered once never reads: the history reads ids only for a batch that
marked events) and its ``metadata`` dict. The rows are read as the tuples the
fetch returned, not as a dict per row.

An event made here equals, and has the same ``repr`` as, the event the
constructor makes from the same fields (``tests/test_changelog_events.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from dbtrigger.errors import SerializationError
from dbtrigger.event_identity import EventIds
from dbtrigger.events import RowChange
from dbtrigger.rowviews import guarded

#: ``upsert``: a row written into the log by ``changelog snapshot`` (the row as it
#: was then, not a change), delivered with ``metadata["snapshot"]`` True.
#: ``truncate``: the table was emptied (PostgreSQL's ``TRUNCATE``, or what
#: ``changelog resync`` records): no key (its values None), no images.
OPS = frozenset({"insert", "update", "delete", "upsert", "truncate"})
#: The columns of a log row an event is made of, besides the key's.
EVENT_COLUMNS = ("dbt_seq", "dbt_op", "dbt_before", "dbt_after", "dbt_txid", "dbt_changed_at")
#: Key and sequence types whose event id cannot fail to encode: ids of a batch
#: holding only these are computed when read; any other batch's at once, so
#: that a value :class:`~dbtrigger.events.EventIds` refuses fails the batch.
_ID_SAFE = frozenset({int, str})

#: One decoder for every image (``json.loads`` with a keyword builds a new one per
#: call); fractional numbers as ``Decimal`` so none is rounded.
_decode = json.JSONDecoder(parse_float=Decimal).decode


class _LogBatch:
    """What the events of one batch share."""

    __slots__ = ("batch_id", "ids", "poller")

    def __init__(self, ids: EventIds, poller: str, batch_id: str) -> None:
        self.ids = ids
        self.poller = poller
        self.batch_id = batch_id


class _LogEvent(RowChange):
    """A change-log event whose id and ``metadata`` are made when first read, then kept."""

    __slots__ = ("_batch", "_extra")

    _batch: _LogBatch
    _extra: tuple[Any, Any]  # (txid, changed_at)

    @property
    def event_id(self) -> str:
        value = self._event_id
        if value is None:
            value = self._event_id = self._batch.ids(self._pk, self._cursor)
        return value

    @property
    def metadata(self) -> Mapping[str, Any]:
        value = self._metadata
        if value is None:
            batch = self._batch
            txid, changed_at = self._extra
            value = self._metadata = MappingProxyType(
                {
                    "poller": batch.poller,
                    "batch_id": batch.batch_id,
                    "txid": txid,
                    "changed_at": changed_at,
                    "snapshot": self._op == "upsert",
                }
            )
        return value


def log_events(
    rows: Sequence[Mapping[str, Any]],
    *,
    pk_columns: Sequence[str],
    source: str,
    poller: str,
    batch_id: str,
) -> list[RowChange]:
    """One event per log row, with the operation and images the trigger wrote.

    Raises:
        SerializationError: a row lacks a column, has an unknown operation, an
            image that is not a JSON object, or a key that cannot be encoded.
    """
    columns, tuples = _tuples(rows, pk_columns, source, poller, batch_id)
    if not tuples:
        return []
    at = {name: i for i, name in enumerate(columns)}
    i_seq, i_op = at["dbt_seq"], at["dbt_op"]
    i_before, i_after = at["dbt_before"], at["dbt_after"]
    i_txid, i_changed = at["dbt_txid"], at["dbt_changed_at"]
    keys = [(name, at[name]) for name in pk_columns]
    single = keys[0] if len(keys) == 1 else None
    batch = _LogBatch(EventIds(poller, pk_columns), poller, batch_id)
    checked = (i_seq, *(i for _, i in keys))
    later = all(type(row[i]) in _ID_SAFE for row in tuples for i in checked)
    new = object.__new__
    proxy = MappingProxyType
    events: list[RowChange] = []
    append = events.append
    for row in tuples:
        seq = row[i_seq]
        op = row[i_op]
        if op not in OPS:
            raise SerializationError(
                f"change log row {seq} of {source} has unknown operation {op!r}",
                poller=poller,
                batch_id=batch_id,
            )
        if single is not None:
            pk = {single[0]: row[single[1]]}
        else:
            pk = {name: row[i] for name, i in keys}
        before = row[i_before]
        after = row[i_after]
        event = new(_LogEvent)
        event._op = op
        event._source = source
        event._cursor = seq
        event._pk = guarded(proxy(pk))
        event._before = None if before is None else _image(before, "dbt_before", seq)
        event._after = None if after is None else _image(after, "dbt_after", seq)
        event._metadata = None  # type: ignore[assignment]
        event._batch = batch
        event._extra = (row[i_txid], row[i_changed])
        event._event_id = None if later else batch.ids(pk, seq)  # type: ignore[assignment]
        append(event)
    return events


def _tuples(
    rows: Sequence[Mapping[str, Any]],
    pk_columns: Sequence[str],
    source: str,
    poller: str,
    batch_id: str,
) -> tuple[Sequence[str], Sequence[Sequence[Any]]]:
    """The rows as column names and tuples (a fetched batch already is).

    Raises:
        SerializationError: a row lacks a column the events need.
    """
    needed = (*EVENT_COLUMNS, *pk_columns)
    columns = getattr(rows, "columns", None)
    tuples = getattr(rows, "tuples", None)
    if columns is not None and tuples is not None:
        missing = [c for c in needed if c not in columns]
        if missing and tuples:  # (an empty batch has every column it needs)
            raise _lacks(source, missing[0], poller, batch_id)
        return columns, tuples
    out = []
    for row in rows:
        try:
            out.append(tuple([row[c] for c in needed]))
        except KeyError as exc:
            raise _lacks(source, exc.args[0], poller, batch_id) from None
    return needed, out


def _lacks(source: str, column: str, poller: str, batch_id: str) -> SerializationError:
    return SerializationError(
        f"change log row of {source} lacks column {column!r}", poller=poller, batch_id=batch_id
    )


def _image(raw: Any, column: str, seq: Any) -> Mapping[str, Any]:
    """A row image (not None) as the event's read-only view of it.

    Raises:
        SerializationError: it is not a JSON object.
    """
    if isinstance(raw, Mapping):
        value = dict(raw)
    else:
        try:
            value = _decode(raw) if type(raw) is str else json.loads(raw, parse_float=Decimal)
        except (TypeError, ValueError) as exc:
            raise SerializationError(f"change log row {seq}: {column} is not JSON: {exc}") from None
        if type(value) is not dict:
            raise SerializationError(f"change log row {seq}: {column} is not a JSON object")
    return guarded(MappingProxyType(value))
