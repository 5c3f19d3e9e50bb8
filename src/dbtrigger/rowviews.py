"""Read-only views of one row, which hand out copies of nested values.

An event (:mod:`dbtrigger.events`) is shared: every fan-out subscriber gets
the same event objects, a retry within the tick (a bisected batch) hands
them out again, and the dead-letter record is written from them after the
handler ran. Its mappings are read-only, but a value inside them - a jsonb or
JSON object or array, a PostgreSQL array, an hstore dict - is a Python dict or
list the driver built once. Were it handed out as it is, a handler that
appended to ``e.after["payload"]["tags"]`` would change what every other
reader sees. So each read of such a value returns a deep copy of it
(:func:`own`), made for that reader; scalars, all a typical row holds, are
handed out as they are after one type check.

Copies on read, not a frozen copy per event: nothing is paid for a column a
handler does not read, and a handler gets plain dicts and lists (JSON-
serialisable, ``isinstance(x, dict)``) that it may change for its own use.
And nothing at all where no column can hold such a value: a reflected table
whose column types all yield scalars (:func:`dbtrigger.sources.rows.plain_types`)
is read through
:class:`PlainRowMapping`, which skips the check.
"""

from __future__ import annotations

import copy
import datetime as dt
import uuid
from abc import abstractmethod
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from decimal import Decimal
from types import MappingProxyType
from typing import Any

#: Types whose values cannot be changed in place: a read hands them out as they
#: are. Everything else a row can hold is checked on each read (:func:`own`).
PLAIN = frozenset(
    {
        int,
        str,
        float,
        bool,
        type(None),
        Decimal,
        dt.datetime,
        dt.date,
        dt.time,
        dt.timedelta,
        uuid.UUID,
        bytes,
    }
)


def _thaw(value: Any) -> Any:
    """A deep copy of a mutable value (a jsonb / JSON object or array, a
    PostgreSQL array, an hstore dict), made for one reader; anything else that
    is not known to be mutable is returned as it is."""
    kind = type(value)
    if kind is dict:
        return {k: v if type(v) in PLAIN else _thaw(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in PLAIN else _thaw(v) for v in value]
    if kind is tuple:
        return tuple([v if type(v) in PLAIN else _thaw(v) for v in value])
    if isinstance(value, dict | list | set | bytearray):
        return copy.deepcopy(value)
    return value


def own(value: Any) -> Any:
    """What one read of a column returns: the value itself when it cannot be
    changed, else a deep copy of it (see the module)."""
    return value if type(value) in PLAIN else _thaw(value)


def guarded(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """``mapping`` (a read-only view owned by one event), or, when a value of it
    could be changed in place, a view that hands out copies of such values."""
    for value in mapping.values():
        if type(value) not in PLAIN:
            return FrozenMapping(mapping)
    return mapping


class _ProxyFace(Mapping[str, Any]):
    """What a ``MappingProxyType`` offers besides reading a key, for the two views
    here: ``items``/``values`` and ``|`` over a :meth:`copy` (nested values
    copied), equality and ``repr`` over the values as they are (:meth:`_raw`)."""

    __slots__ = ()

    @abstractmethod
    def copy(self) -> dict[str, Any]: ...

    @abstractmethod
    def _raw(self) -> dict[str, Any]: ...

    def items(self) -> ItemsView[str, Any]:
        return self.copy().items()

    def values(self) -> ValuesView[Any]:
        return self.copy().values()

    def __eq__(self, other: object) -> bool:
        theirs = _comparable(other)
        return NotImplemented if theirs is None else self._raw() == theirs

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Any) -> Any:
        if isinstance(other, _ProxyFace):
            other = other.copy()
        return self.copy() | other

    def __ror__(self, other: Any) -> Any:
        return other | self.copy()

    def __repr__(self) -> str:
        return f"mappingproxy({self._raw()!r})"


class RowMapping(_ProxyFace):
    """A read-only mapping over some columns of one row tuple (an event's ``pk``
    or ``after``), made afresh on each read and holding no copy of the row.

    Reading a column is a lookup of its position in the batch's name index and
    an index into the tuple; no dict is built per row. That is most of what
    reading an event costs a handler, and a dict kept per row also set off the
    collector's young collections while the batch is alive. Everything else a
    ``MappingProxyType`` offers (iteration in column order, ``keys``/``items``/
    ``values``, ``copy``, ``|``, equality with any mapping, the same ``repr``)
    behaves the same; what needs the whole row builds a dict of it first.

    A value that could be changed in place (a JSON object or array, an array
    column) is handed out as a deep copy, one per read (:func:`own`): the
    tuple is shared by every reader of the event, and must stay the row as read.
    """

    __slots__ = ("_index", "_row")

    _index: dict[str, int]
    _row: Sequence[Any]

    def __getitem__(self, key: str) -> Any:
        value = self._row[self._index[key]]
        return value if type(value) in PLAIN else _thaw(value)

    def get(self, key: str, default: Any = None) -> Any:
        index = self._index.get(key)
        return default if index is None else own(self._row[index])

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def copy(self) -> dict[str, Any]:
        """The columns as a new dict (as ``MappingProxyType.copy``; nested values copied)."""
        row = self._row
        return {name: own(row[index]) for name, index in self._index.items()}

    def _raw(self) -> dict[str, Any]:
        """The columns as they are in the tuple (for comparing, never handed out)."""
        row = self._row
        return {name: row[index] for name, index in self._index.items()}

    def keys(self) -> KeysView[str]:
        return self._index.keys()


class PlainRowMapping(RowMapping):
    """A :class:`RowMapping` over a row whose every column has a type that only
    yields values that cannot be changed in place: reads
    hand the tuple's values out as they are, with no check at all - the
    single-handler catch-up path of most tables costs nothing for the guard.
    (Which types those are: :func:`dbtrigger.sources.rows.plain_types`.)"""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        return self._row[self._index[key]]

    def get(self, key: str, default: Any = None) -> Any:
        index = self._index.get(key)
        return default if index is None else self._row[index]

    def copy(self) -> dict[str, Any]:
        """The columns as a new dict (as ``MappingProxyType.copy``)."""
        return self._raw()


class FrozenMapping(_ProxyFace):
    """A read-only view of one event's dict that holds a nested value: what
    ``MappingProxyType`` is to the others, except that a value that could be
    changed in place is handed out as a deep copy, one per read (:func:`own`)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return own(self._data[key])

    def get(self, key: str, default: Any = None) -> Any:
        return own(self._data[key]) if key in self._data else default

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __reversed__(self) -> Iterator[str]:
        return reversed(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def copy(self) -> dict[str, Any]:
        """The mapping as a new dict (nested values copied)."""
        return {k: own(v) for k, v in self._data.items()}

    def keys(self) -> KeysView[str]:
        return self._data.keys()

    def _raw(self) -> dict[str, Any]:
        return dict(self._data.items())


def _comparable(other: object) -> dict[str, Any] | None:
    """``other`` as a plain dict to compare a row mapping with (None: not a mapping)."""
    if isinstance(other, _ProxyFace):
        return other._raw()
    if isinstance(other, Mapping):
        return dict(other.items())
    return None


def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy of ``mapping`` for :class:`RowChange`'s constructor:
    a ``MappingProxyType`` of a new dict, deep-copied and guarded when a value
    could be changed in place (the caller's nested dicts are not shared)."""
    data = dict(mapping)
    for value in data.values():
        if type(value) not in PLAIN:
            return FrozenMapping({k: own(v) for k, v in data.items()})
    return MappingProxyType(data)
