"""The events handed to handlers.

A cursor poller sees the *current* state of each changed row, not the change
itself: it cannot tell an insert from an update, and it never sees the row as it
was before. So ``op`` is ``"upsert"`` and ``before`` is ``None`` for cursor
sources; sources that know more (a claim queue, a change table) may say more.

Events are made for every row delivered, so making one must cost next to
nothing: :func:`events_from_rows` wraps each row tuple the driver returned in a
small slotted object: its ``pk`` and ``after`` are read-only views of that
tuple, and its ``event_id`` is computed the first time something reads it (and
then kept). What a handler never reads is never built. Everything that can
make an event unreadable (a missing key column, a NULL key, a key or cursor
value that has no checkpoint encoding) is checked for the whole batch before
the handler runs, so a lazily computed id cannot fail later.

An event stays the row as read: every fan-out subscriber, a retry within the
tick and the dead-letter record share it, so a nested value (a JSON object, an
array) is handed out as a deep copy on each read (:mod:`dbtrigger.rowviews`);
scalars, all a typical row holds, cost one type check per read.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import uuid
from collections.abc import Callable, Mapping, Sequence, Set
from operator import attrgetter, itemgetter, methodcaller
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from dbtrigger._row_events import RowEvents
from dbtrigger.cursor import (
    encode_value,
    encoded_json,
    json_string,
    pk_hash,
)
from dbtrigger.errors import ConfigurationError, SerializationError
from dbtrigger.event_identity import EventIds, dedup_key, make_event_id
from dbtrigger.rowviews import PlainRowMapping, RowMapping, frozen, guarded

#: ``truncate``: a change log's record that the whole table was emptied (no key, no images).
VALID_OPS = frozenset({"insert", "update", "upsert", "delete", "truncate"})

_sha256 = hashlib.sha256


def _check_key(
    op: str,
    pk: Mapping[str, Any],
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
) -> None:
    """A ``truncate`` has no key (every value None) and no images; any other event has
    no None in its key (sources refuse a NULL key). Dead letters and the runtime tell
    a truncate by that (:func:`dbtrigger.replay.dead_letters.event_of`).

    Raises:
        ConfigurationError: naming what does not fit ``op``.
    """
    nulls = [name for name, value in pk.items() if value is None]
    if op == "truncate" and (before is not None or after is not None or len(nulls) < len(pk)):
        raise ConfigurationError(
            "a truncate event concerns the whole table: it takes before=None, after=None "
            f"and every key value None (got pk={dict(pk)!r}, "
            f"before={'None' if before is None else 'an image'}, "
            f"after={'None' if after is None else 'an image'})"
        )
    if op != "truncate" and nulls:
        raise ConfigurationError(
            f"an event with op={op!r} needs a value in every key column; {nulls[0]!r} is None "
            "(a key of Nones and no images is a truncate: op='truncate')"
        )


class RowChange:
    """One row state delivered to a handler. Immutable: its mappings are read-only,
    and a nested value read from them is a copy (see :func:`dbtrigger.rowviews.own`).

    Attributes:
        event_id: stable identity of (poller, pk, cursor); equal on redelivery.
        op: ``insert``, ``update``, ``upsert`` or ``delete``; from a change log also
            ``truncate`` (every row of the table gone; ``pk`` values None, no images:
            the constructor refuses anything else, and a None key value on other ops).
        source: the source's display name (e.g. ``postgresql:public.orders``).
        cursor: the row's cursor column value (None when the column is NULL).
        pk: primary key column -> value.
        before: the row before the change, when the source knows it.
        after: the row after the change (all selected columns).
        metadata: poller name, batch id and source-specific extras.

    Events from a source are built by :func:`events_from_rows` and compute
    ``pk``, ``after`` and ``event_id`` on first access; an event built with the
    constructor holds read-only copies of what it was given. The two are
    indistinguishable: equal when their fields are, same ``repr``.
    """

    __slots__ = ("_after", "_before", "_cursor", "_event_id", "_metadata", "_op", "_pk", "_source")

    def __init__(
        self,
        event_id: str,
        op: str,
        source: str,
        cursor: Any,
        pk: Mapping[str, Any],
        before: Mapping[str, Any] | None,
        after: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if op not in VALID_OPS:
            raise ValueError(f"op must be one of {sorted(VALID_OPS)}, got {op!r}")
        if not event_id:
            raise ValueError("event_id must not be empty")
        _check_key(op, pk, before, after)
        # Deep copies behind read-only views: a handler that mutates an event
        # (or the caller's dicts, or a nested value) would otherwise change what
        # a retry, another subscriber or the dead-letter record sees.
        self._event_id = event_id
        self._op = op
        self._source = source
        self._cursor = cursor
        self._pk = frozen(pk)
        self._before = None if before is None else frozen(before)
        self._after = None if after is None else frozen(after)
        self._metadata = frozen(metadata or {})

    @classmethod
    def _unchecked(
        cls,
        event_id: str,
        op: str,
        source: str,
        cursor: Any,
        pk: MappingProxyType[str, Any],
        before: MappingProxyType[str, Any] | None,
        after: MappingProxyType[str, Any] | None,
        metadata: MappingProxyType[str, Any],
    ) -> RowChange:
        """Build an event from parts a source has already validated and frozen.

        The constructor validates ``op`` and ``event_id`` and copies every
        mapping into a fresh read-only view. A source that makes its own events
        in bulk (the change log) hands over read-only views of dicts it created
        for this event alone (``metadata`` may be shared by a batch); a view
        holding a nested value (a JSON object) is wrapped so that reads hand
        out copies of it (see :func:`dbtrigger.rowviews.own`).
        """
        event = object.__new__(cls)
        event._event_id = event_id
        event._op = op
        event._source = source
        event._cursor = cursor
        event._pk = guarded(pk)
        event._before = None if before is None else guarded(before)
        event._after = None if after is None else guarded(after)
        event._metadata = metadata
        return event

    # Plain attribute reads through C-level getters; no setters, so assigning
    # raises AttributeError (the event is frozen).
    if TYPE_CHECKING:

        @property
        def event_id(self) -> str: ...
        @property
        def op(self) -> str: ...
        @property
        def source(self) -> str: ...
        @property
        def cursor(self) -> Any: ...
        @property
        def pk(self) -> Mapping[str, Any]: ...
        @property
        def before(self) -> Mapping[str, Any] | None: ...
        @property
        def after(self) -> Mapping[str, Any] | None: ...
        @property
        def metadata(self) -> Mapping[str, Any]: ...

    else:
        event_id = property(attrgetter("_event_id"))
        op = property(attrgetter("_op"))
        source = property(attrgetter("_source"))
        cursor = property(attrgetter("_cursor"))
        pk = property(attrgetter("_pk"))
        before = property(attrgetter("_before"))
        after = property(attrgetter("_after"))
        metadata = property(attrgetter("_metadata"))

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.event_id,
            self.op,
            self.source,
            self.cursor,
            self.pk,
            self.before,
            self.after,
            self.metadata,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowChange):
            return NotImplemented
        return self._fields() == other._fields()

    # Like the frozen dataclass this class used to be: equality by value, and
    # not hashable (its mappings are not).
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        names = ("event_id", "op", "source", "cursor", "pk", "before", "after", "metadata")
        parts = ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields(), strict=True))
        return f"RowChange({parts})"

    @property
    def pk_hash(self) -> str:
        return pk_hash(self.pk)

    def to_cloudevent(
        self,
        *,
        source: str | None = None,
        type: str | None = None,
        extensions: Mapping[str, Any] | None = None,
    ) -> Any:
        """This change as a CloudEvent (``cloudevents.core.v1.event.CloudEvent``), for a
        handler that forwards it to Event Grid, Event Hubs, Service Bus, ...: ``id`` is
        :attr:`event_id` (equal on redelivery), ``source`` ``/dbtrigger/<poller>``, ``type``
        ``dbtrigger.row.<op>``, ``data`` the change as plain JSON. Needs the
        ``cloudevents`` extra; see :mod:`dbtrigger.cloud_event`."""
        from dbtrigger.cloud_event import to_cloudevent  # noqa: PLC0415 - optional SDK

        return to_cloudevent(self, source=source, type=type, extensions=extensions)

    def dedup_key(self, poller: str | None = None) -> str:
        """``poller:pk_hash:cursor`` - the idempotency key for downstream systems.

        Replays of the same row state produce the same key; a later update of the
        row (a new cursor) produces a new one.
        """
        name = poller if poller is not None else str(self.metadata.get("poller", ""))
        return dedup_key(name, self.pk, self.cursor)


class RowShape:
    """What the events of one batch share: column names, where the cursor and key
    are in each row tuple, the source, the batch's metadata and its id maker.

    ``plain``: the source knows every column yields values that cannot be
    changed in place (:func:`dbtrigger.sources.rows.plain_types`), so reads skip
    the copy-on-read check; otherwise (the default) nested values are copied.

    Raises:
        SerializationError: the columns lack the cursor or a key column.
    """

    __slots__ = (
        "columns",
        "cursor_index",
        "ids",
        "index",
        "metadata",
        "op",
        "pk_index",
        "pk_indexes",
        "pk_names",
        "single_index",
        "source",
        "view",
    )

    def __init__(
        self,
        columns: Sequence[str],
        *,
        cursor_column: str,
        pk_columns: Sequence[str],
        source: str,
        poller: str,
        batch_id: str,
        op: str = "upsert",
        plain: bool = False,
    ) -> None:
        self.columns = tuple(columns)
        where = {name: index for index, name in enumerate(self.columns)}
        missing = [c for c in (cursor_column, *pk_columns) if c not in where]
        if missing:
            raise SerializationError(
                f"row from {source} lacks column {missing[0]!r}; it has {sorted(self.columns)}",
                poller=poller,
                batch_id=batch_id,
            )
        self.cursor_index = where[cursor_column]
        #: Column name -> position in a row tuple (a repeated name: its last
        #: position, as a dict built from the row would hold it).
        self.index = where
        self.pk_names = tuple(pk_columns)
        self.pk_indexes = tuple(where[c] for c in self.pk_names)
        self.pk_index = dict(zip(self.pk_names, self.pk_indexes, strict=True))
        self.single_index = self.pk_indexes[0] if len(self.pk_indexes) == 1 else -1
        self.source = source
        self.op = op
        self.metadata = MappingProxyType({"poller": poller, "batch_id": batch_id})
        self.ids = EventIds(poller, self.pk_names)
        #: The class of the events' ``pk`` and ``after`` views.
        self.view: type[RowMapping] = PlainRowMapping if plain else RowMapping

    def for_batch(self, batch_id: str) -> RowShape:
        """This shape for another batch of the same poller: only the metadata differs."""
        shape = _new(RowShape)
        for name in RowShape.__slots__:
            setattr(shape, name, getattr(self, name))
        shape.metadata = MappingProxyType({"poller": self.metadata["poller"], "batch_id": batch_id})
        return shape

    def key_of(self, row: Sequence[Any]) -> dict[str, Any]:
        """The row's key as a new dict, in ``pk_columns`` order."""
        if self.single_index >= 0:
            return {self.pk_names[0]: row[self.single_index]}
        return {n: row[i] for n, i in zip(self.pk_names, self.pk_indexes, strict=True)}

    def event_id(self, row: Sequence[Any]) -> str:
        if self.single_index >= 0:
            return self.ids.single(row[self.single_index], row[self.cursor_index])
        return self.ids(self.key_of(row), row[self.cursor_index])


_new = object.__new__


class _RowEvent(RowChange):
    """A :class:`RowChange` over one row tuple: ``pk`` and ``after`` are read-only
    views of the tuple (:class:`RowMapping`, made on each read), the id is
    computed when first read and kept. Made only by :func:`events_from_rows`,
    which checked the batch, so none of them can fail.

    Nothing else is kept per event: a view or a dict held by every event of a
    batch would be more objects for the garbage collector to allocate, count
    and scan while the handler runs.
    """

    __slots__ = ("_row", "_shape")

    _row: Sequence[Any]
    _shape: RowShape

    @property
    def event_id(self) -> str:
        value = self._event_id
        if value is None:
            value = self._event_id = self._shape.event_id(self._row)
        return value

    if not TYPE_CHECKING:
        # Made by calling the class (events_from_rows), as the views are: with
        # object's own __init__ that is C all the way (type_call), about 250
        # instructions less than object.__new__(cls), whose wrapper checks its
        # arguments first.
        __init__ = object.__init__

    @property
    def pk(self) -> Mapping[str, Any]:
        view = self._shape.view()
        view._row = self._row
        view._index = self._shape.pk_index
        return view

    @property
    def after(self) -> Mapping[str, Any]:
        view = self._shape.view()
        view._row = self._row
        view._index = self._shape.index
        return view

    @property
    def cursor(self) -> Any:
        return self._row[self._shape.cursor_index]

    @property
    def op(self) -> str:
        return self._shape.op

    @property
    def source(self) -> str:
        return self._shape.source

    @property
    def before(self) -> None:
        return None

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self._shape.metadata


# Types whose every value has a checkpoint encoding that cannot fail. Anything
# else (float and Decimal: NaN cannot be ordered; unknown driver types) is
# checked value by value.
_ALWAYS_ENCODABLE = frozenset({int, str, bool, dt.datetime, dt.date, uuid.UUID, bytes, type(None)})


_FLOATS = _ALWAYS_ENCODABLE | {float}
_NONE = type(None)


def _is_float(value: Any) -> bool:
    return type(value) is float


def _check_column(
    shape: RowShape,
    rows: Sequence[Sequence[Any]],
    index: int,
    *,
    key: bool,
    types: Set[type] | None = None,
) -> None:
    """Refuse the batch if a value of this key or cursor column cannot be encoded
    (or a key value is NULL), naming the column and the row's key. ``types``:
    the column's value types, when the source has already collected them."""
    if types is None:
        types = {type(row[index]) for row in rows}
    if key and _NONE in types:
        position = next(i for i, row in enumerate(rows) if row[index] is None)
        raise SerializationError(
            f"row from {shape.source} has a NULL primary key {shape.key_of(rows[position])!r}; "
            "keys must be unique and set",
            poller=shape.metadata["poller"],
            batch_id=shape.metadata["batch_id"],
        )
    if types <= _ALWAYS_ENCODABLE:
        return
    values = list(map(itemgetter(index), rows))
    if types <= _FLOATS and not any(map(math.isnan, filter(_is_float, values))):
        return  # (a float column: only NaN is refused)
    name = shape.columns[index]
    for position, value in enumerate(values):
        if type(value) in _ALWAYS_ENCODABLE:
            continue
        try:
            encode_value(value)
        except SerializationError as exc:
            raise SerializationError(
                f"row from {shape.source} with key {shape.key_of(rows[position])!r}: column "
                f"{name!r}: {exc}",
                poller=shape.metadata["poller"],
                batch_id=shape.metadata["batch_id"],
                column=name,
            ) from None


def events_from_rows(
    shape: RowShape,
    rows: Sequence[Sequence[Any]],
    types: Mapping[int, Set[type]] | None = None,
) -> list[RowChange]:
    """One event per row tuple (in ``shape.columns`` order), built lazily.

    The batch is checked first, column by column: no NULL key, and every key
    and cursor value encodable, so that an event's id, computed when first
    read, cannot fail. ``types``: column index -> the set of its values' types
    in ``rows``, for columns whose types the source already collected (its own
    check of the same tuples, :meth:`~dbtrigger.sources.column_checks.ShapeChecks.check_rows`);
    the others are scanned here.

    Raises:
        SerializationError: naming the column and the row's key.
    """
    known = types or {}
    for index in shape.pk_indexes:
        _check_column(shape, rows, index, key=True, types=known.get(index))
    index = shape.cursor_index
    _check_column(shape, rows, index, key=False, types=known.get(index))
    cls = cast("Callable[[], _RowEvent]", _RowEvent)  # (object.__init__, see _RowEvent)
    # The list says their shape: batch_shape need not walk them.
    events: RowEvents[RowChange, RowShape] = RowEvents(shape)
    append = list.append.__get__(events)  # (list's own: RowEvents.append forgets the shape)
    for row in rows:
        event = cls()
        event._row = row
        event._shape = shape
        event._event_id = None  # type: ignore[assignment]
        append(event)
    return events


def key_dict(event: RowChange) -> dict[str, Any]:
    """``dict(event.pk)``, from the row tuple where its values are plain (``dict()``
    of a row view walks it through Python-level ``keys`` and ``__getitem__``)."""
    if type(event) is _RowEvent:
        shape = event._shape
        if shape.view is PlainRowMapping:
            return shape.key_of(event._row)
    return dict(event.pk)


_shape_of = attrgetter("_shape")
_row_of = attrgetter("_row")
_hexdigest = methodcaller("hexdigest")


def batch_shape(events: Sequence[RowChange]) -> RowShape | None:
    """The one :class:`RowShape` every event of ``events`` was made over by
    :func:`events_from_rows` (None: any other event, or several shapes)."""
    if not events:
        return None
    if type(events) is RowEvents and events.shape is not None:
        return cast("RowShape", events.shape)  # (made by events_from_rows, not changed since)
    first = events[0]
    if type(first) is not _RowEvent:
        return None
    shape = first._shape
    if set(map(type, events)) != {_RowEvent} or set(map(_shape_of, events)) != {shape}:
        return None
    return shape


def row_event(shape: RowShape, row: Sequence[Any]) -> RowChange:
    """The event :func:`events_from_rows` made over ``row`` (already checked with
    its batch): equal in every field, its id computed again when read."""
    event = cast("Callable[[], _RowEvent]", _RowEvent)()
    event._row = row
    event._shape = shape
    event._event_id = None  # type: ignore[assignment]
    return event


def _encoded_column(values: list[Any]) -> tuple[str, list[Any]]:
    """How to write ``encoded_json`` of each value of a column into a ``%`` format:
    a pattern and its arguments. An exact ``int`` column (most keys and many
    cursors) is formatted by ``%d`` itself; a ``str`` column is escaped by the
    same C routine :func:`encoded_json` uses; anything else is encoded value by
    value. The texts are those :func:`encoded_json` writes."""
    kinds = set(map(type, values))
    if kinds == {int}:
        return '["int",%d]', values
    if kinds == {str}:
        return '["str",%s]', list(map(json_string, values))
    return "%s", list(map(encoded_json, values))


def event_ids(events: Sequence[RowChange]) -> list[str]:
    """The events' ids, in order, each also kept by its event.

    Equal to reading ``event.event_id`` one by one; for a batch made by
    :func:`events_from_rows` with a one-column key (the common table) the
    hashed texts are formatted a column at a time, with no Python call per
    row: the SHA-256 itself is then most of the cost. The history reads every
    id of every committed batch, so this runs for every row a poller delivers.
    """
    shape = batch_shape(events)
    if shape is None or shape.single_index < 0:
        return [e.event_id for e in events]
    rows = list(map(_row_of, events))
    key_pattern, keys = _encoded_column(list(map(itemgetter(shape.single_index), rows)))
    cursor_pattern, cursors = _encoded_column(list(map(itemgetter(shape.cursor_index), rows)))
    pattern = shape.ids._prefix.replace("%", "%%") + key_pattern + "}," + cursor_pattern + "]"
    texts = map(pattern.__mod__, zip(keys, cursors, strict=True))
    digests = map(_sha256, map(str.encode, texts))
    ids = [digest[:32] for digest in map(_hexdigest, digests)]
    for event, eid in zip(events, ids, strict=True):
        event._event_id = eid
    return ids


# make_event_id, dedup_key and EventIds live in dbtrigger.event_identity; they are
# still offered here, where docs/api.md lists them.
__all__ = [
    "VALID_OPS",
    "EventIds",
    "RowChange",
    "RowShape",
    "batch_shape",
    "dedup_key",
    "event_ids",
    "events_from_rows",
    "key_dict",
    "make_event_id",
    "row_event",
]
