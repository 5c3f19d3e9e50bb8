"""The change a log-based source delivers, in a shape every database shares.

A log source's ``fetch`` returns :class:`Change` records (the port's "raw
rows"); :func:`to_events` turns them into :class:`~dbtrigger.RowChange`
events. PostgreSQL's logical decoding and a MariaDB/MySQL binlog reader fill
the same fields, so handlers, lanes, fan-out, quarantine and the CLI treat both
alike:

* ``op``: ``insert``, ``update`` or ``delete``; rows read by a snapshot are
  ``upsert`` (the row as it is now, not a change) with ``metadata["snapshot"]``;
  a ``TRUNCATE`` of a watched table is one ``truncate`` (every row gone: no
  images, every key value None), as a change log delivers it
  (:func:`truncate_change`).
* ``before``: the row before the change, as much of it as the log carries
  (``metadata["before_image"]`` says ``"full"`` or ``"key"``; None when the
  log carried nothing, e.g. a PostgreSQL update under ``REPLICA IDENTITY
  DEFAULT`` that did not touch the key).
* ``after``: the row after the change (None for a delete). A column whose
  value the log did not carry because it did not change (PostgreSQL's
  unchanged TOASTed values) holds :data:`UNCHANGED`, never None: None is a
  real NULL. ``metadata["unchanged"]`` names those columns.
* ``cursor``: the :class:`~dbtrigger.cdc.position.LogPosition` text
  (``commit#ordinal``): unique per change, equal on every redelivery.
* ``pk``: the table's key values (from the image that has them).
* ``metadata``: ``table`` (``schema.table``), ``commit`` (the commit token),
  ``ordinal``, ``last_in_transaction``, ``commit_time`` (aware UTC),
  ``transaction_id``, ``before_image``, ``unchanged``, ``snapshot``.

Transactions arrive whole and in commit order: nothing of a transaction is
handed out before it committed, its changes are consecutive, and
``last_in_transaction`` marks its end, so a handler that must apply a
transaction atomically can tell where one ends (a batch is cut at
``batch_size`` events, which may fall inside a large transaction).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dbtrigger.cdc.position import LogPosition
from dbtrigger.errors import SerializationError
from dbtrigger.event_identity import make_event_id
from dbtrigger.events import RowChange

#: Operations a log change may carry (a snapshot row is an ``upsert``; a ``TRUNCATE``
#: of a watched table is a ``truncate``).
LOG_OPS = frozenset({"insert", "update", "delete", "upsert", "truncate"})


class Unchanged:
    """The value of a column the log did not carry because it did not change.

    PostgreSQL writes a large (TOASTed) value into the log only when it
    changed; an update that left it alone carries a marker instead. Reading
    that as NULL would make a handler erase data, so it is this object, which
    is equal only to itself: test with ``value is UNCHANGED``.
    """

    __slots__ = ()
    _instance: Unchanged | None = None

    def __new__(cls) -> Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        return "UNCHANGED"  # pickles (lanes in processes, tests) as the singleton

    def __copy__(self) -> Unchanged:
        return self

    def __deepcopy__(self, memo: Any) -> Unchanged:
        return self


#: The one marker of an unchanged value the log did not carry (see :class:`Unchanged`).
UNCHANGED = Unchanged()


class Change(dict[str, Any]):
    """One committed change read from a log, before it becomes a ``RowChange``.

    The port's raw row: a plain dict (fast to build and read, one per change)
    of the fields in :attr:`FIELDS`; build it with keyword arguments.
    ``position`` is what the checkpoint records. It is internal to the source
    and the runtime: handlers get read-only events.
    """

    FIELDS = (
        "position",
        "op",
        "table",
        "pk",
        "before",
        "after",
        "commit_time",
        "transaction_id",
        "last_in_transaction",
        "before_image",
        "unchanged",
        "snapshot",
    )
    __slots__ = ()

    def __init__(
        self,
        *,
        position: LogPosition,
        op: str,
        table: str,
        pk: Mapping[str, Any],
        before: Mapping[str, Any] | None,
        after: Mapping[str, Any] | None,
        commit_time: dt.datetime | None = None,
        transaction_id: Any = None,
        last_in_transaction: bool = False,
        before_image: str | None = None,
        unchanged: tuple[str, ...] = (),
        snapshot: bool = False,
    ) -> None:
        super().__init__(
            position=position,
            op=op,
            table=table,
            pk=pk,
            before=before,
            after=after,
            commit_time=commit_time,
            transaction_id=transaction_id,
            last_in_transaction=last_in_transaction,
            before_image=before_image,
            unchanged=unchanged,
            snapshot=snapshot,
        )

    def __repr__(self) -> str:
        return f"Change({self['op']} {self['table']} {self['pk']} at {self['position']})"


def truncate_change(
    position: LogPosition,
    table: str,
    keys: Sequence[str],
    *,
    commit_time: dt.datetime | None,
    transaction_id: Any,
    last_in_transaction: bool,
) -> Change:
    """The ``truncate`` of ``table`` at ``position``: no images, every key value None.

    The shape a change log gives a ``TRUNCATE`` (docs/changes.md, "TRUNCATE"), so
    a handler, the history, replay and dead letters treat both sources' alike.
    """
    return Change(
        position=position,
        op="truncate",
        table=table,
        pk=dict.fromkeys(keys),
        before=None,
        after=None,
        commit_time=commit_time,
        transaction_id=transaction_id,
        last_in_transaction=last_in_transaction,
    )


def truncate_alone(changes: list[Change]) -> list[Change]:
    """The changes up to the first ``truncate``, or that ``truncate`` alone when it is first.

    A truncate concerns every key of its table: in a batch of its own it is
    handled after every change before it and before every change after it,
    whatever lanes (``max_concurrency``) do with the keys of one batch, as a
    change log's truncate is (:func:`dbtrigger.changelog.source._truncate_alone`).
    """
    at = next((i for i, c in enumerate(changes) if c["op"] == "truncate"), None)
    return changes if at is None else changes[: max(at, 1)]


class _LogEvent(RowChange):
    """A ``RowChange`` of a log change whose id is computed when first read.

    Building ids costs a hash per event; most handlers never read them (lanes
    and dedup keys use ``pk`` and ``cursor``).
    """

    __slots__ = ("_poller",)

    _poller: str

    @property
    def event_id(self) -> str:
        value = self._event_id
        if value is None:
            value = self._event_id = make_event_id(self._poller, self._pk, self._cursor)
        return value


def _view(image: Mapping[str, Any] | None) -> MappingProxyType[str, Any] | None:
    # The images are dicts built for this one change: a read-only view needs no copy.
    if image is None:
        return None
    return MappingProxyType(image if isinstance(image, dict) else dict(image))


_checked_types = frozenset({int, str, dt.datetime, dt.date, type(None), bool})


def to_events(
    changes: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str, source: str
) -> list[RowChange]:
    """One ``RowChange`` per change, at the change's log position.

    Raises:
        SerializationError: a change lacks its position, operation or table, or
            its key or position cannot be encoded in a checkpoint.
    """
    events: list[RowChange] = []
    append = events.append
    new = object.__new__
    for change in changes:
        try:
            position = change["position"]
            op = change["op"]
            table = change["table"]
            pk = change["pk"]
        except (KeyError, TypeError) as exc:
            raise SerializationError(
                f"a change from {source} lacks {exc}: not a log change record",
                poller=poller,
                batch_id=batch_id,
            ) from None
        if type(position) is not LogPosition:
            raise SerializationError(
                f"a change from {source} has no log position ({position!r})",
                poller=poller,
                batch_id=batch_id,
            )
        if op not in LOG_OPS:
            raise SerializationError(
                f"a change from {source} at {position} has unknown operation {op!r}",
                poller=poller,
                batch_id=batch_id,
            )
        pk = pk if type(pk) is dict else dict(pk)
        cursor = position.text
        if not all(type(v) in _checked_types for v in pk.values()):
            try:  # the id is computed later: what could fail is checked now
                make_event_id(poller, pk, cursor)
            except SerializationError as exc:
                raise SerializationError(
                    f"change of {table} at {position}: {exc}", poller=poller, batch_id=batch_id
                ) from None
        get = change.get
        event = new(_LogEvent)
        event._event_id = None  # type: ignore[assignment]
        event._poller = poller
        event._op = op
        event._source = source
        event._cursor = cursor
        event._pk = MappingProxyType(pk)
        event._before = _view(get("before"))
        event._after = _view(get("after"))
        event._metadata = MappingProxyType(
            {
                "poller": poller,
                "batch_id": batch_id,
                "table": table,
                "commit": position.commit,
                "ordinal": position.ordinal,
                "last_in_transaction": bool(get("last_in_transaction", False)),
                "commit_time": get("commit_time"),
                "transaction_id": get("transaction_id"),
                "before_image": get("before_image"),
                "unchanged": tuple(get("unchanged", ())),
                "snapshot": bool(get("snapshot", False)),
            }
        )
        append(event)
    return events


def transactions(events: Sequence[RowChange]) -> list[list[RowChange]]:
    """The events of a batch grouped by transaction, in order.

    The first and last group may be parts of transactions that continue in the
    previous or next batch (``metadata["last_in_transaction"]`` of a group's
    last event says whether it ended here).
    """
    groups: list[list[RowChange]] = []
    current: str | None = None
    for event in events:
        commit = event.metadata.get("commit")
        if not groups or commit != current:
            groups.append([])
            current = commit
        groups[-1].append(event)
    return groups


__all__ = [
    "LOG_OPS",
    "UNCHANGED",
    "Change",
    "Unchanged",
    "to_events",
    "transactions",
    "truncate_alone",
    "truncate_change",
]
