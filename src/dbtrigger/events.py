"""The events handed to handlers.

A cursor poller sees the *current* state of each changed row, not the change
itself: it cannot tell an insert from an update, and it never sees the row as it
was before. So ``op`` is ``"upsert"`` and ``before`` is ``None`` for cursor
sources; sources that know more (a claim queue, a change table) may say more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dbtrigger.cursor import cursor_text, encoded_json, json_string, pk_hash, pk_json

VALID_OPS = frozenset({"insert", "update", "upsert", "delete"})

_sha256 = hashlib.sha256


def make_event_id(poller: str, pk: Mapping[str, Any], cursor: Any) -> str:
    """Identity of one source-side row state, equal across drivers and processes.

    Built from the poller name, the primary key and the cursor through the
    state document's own value encoding, never from ``repr`` of driver objects,
    so a psycopg ``Decimal`` and a PyMySQL ``Decimal`` of the same value agree.
    The hashed text is ``canonical_json([poller, encoded_pk(pk), [kind, value]])``.

    Raises:
        SerializationError: a key or cursor value has a type that cannot be encoded.
    """
    material = "[" + json_string(poller) + "," + pk_json(pk) + "," + encoded_json(cursor) + "]"
    return _sha256(material.encode()).hexdigest()[:32]


class EventIds:
    """:func:`make_event_id` for one poller and one set of key columns, made cheap.

    A source turns every fetched row into an event, so the id is computed once
    per row. The parts that never change within a poller (its name, the sorted
    key names, the JSON punctuation) are built once here; per row only the key
    and cursor values are encoded. The result equals :func:`make_event_id`.
    """

    __slots__ = ("_keys", "_prefix", "_single")

    def __init__(self, poller: str, pk_columns: Iterable[str]) -> None:
        self._prefix = "[" + json_string(poller) + ",{"
        self._keys = tuple((name, json_string(name) + ":") for name in sorted(pk_columns))
        # One key column is the usual case: its label is part of the prefix.
        self._single = self._keys[0][0] if len(self._keys) == 1 else None
        if self._single is not None:
            self._prefix += self._keys[0][1]

    def __call__(self, pk: Mapping[str, Any], cursor: Any) -> str:
        """The id of the row state with key values ``pk`` (a mapping over exactly
        the key columns) and cursor value ``cursor``.

        Raises:
            SerializationError: a value has a type that cannot be encoded.
        """
        if self._single is not None:
            keys = encoded_json(pk[self._single])
        else:
            keys = ",".join([label + encoded_json(pk[name]) for name, label in self._keys])
        material = self._prefix + keys + "}," + encoded_json(cursor) + "]"
        return _sha256(material.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RowChange:
    """One row state delivered to a handler.

    Attributes:
        event_id: stable identity of (poller, pk, cursor); equal on redelivery.
        op: ``insert``, ``update``, ``upsert`` or ``delete``.
        source: the source's display name (e.g. ``postgresql:public.orders``).
        cursor: the row's cursor column value (None when the column is NULL).
        pk: primary key column -> value.
        before: the row before the change, when the source knows it.
        after: the row after the change (all selected columns).
        metadata: poller name, batch id and source-specific extras.
    """

    event_id: str
    op: str
    source: str
    cursor: Any
    pk: Mapping[str, Any]
    before: Mapping[str, Any] | None
    after: Mapping[str, Any] | None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in VALID_OPS:
            raise ValueError(f"op must be one of {sorted(VALID_OPS)}, got {self.op!r}")
        if not self.event_id:
            raise ValueError("event_id must not be empty")
        # Freeze the mappings too: a handler that mutates an event would otherwise
        # change what a retry of the same batch sees.
        object.__setattr__(self, "pk", MappingProxyType(dict(self.pk)))
        if self.after is not None:
            object.__setattr__(self, "after", MappingProxyType(dict(self.after)))
        if self.before is not None:
            object.__setattr__(self, "before", MappingProxyType(dict(self.before)))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

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
        mapping into a fresh read-only view, which is most of the cost of
        turning a row into an event. A source that produces thousands of events
        per batch builds them here instead, handing over read-only views of
        dicts it created for this event alone (``metadata`` may be shared by a
        batch: nothing can change it). The result is indistinguishable from a
        constructor-built event.
        """
        event = object.__new__(cls)
        object.__setattr__(
            event,
            "__dict__",
            {
                "event_id": event_id,
                "op": op,
                "source": source,
                "cursor": cursor,
                "pk": pk,
                "before": before,
                "after": after,
                "metadata": metadata,
            },
        )
        return event

    @property
    def pk_hash(self) -> str:
        return pk_hash(self.pk)

    def dedup_key(self, poller: str | None = None) -> str:
        """``poller:pk_hash:cursor`` - the idempotency key for downstream systems.

        Replays of the same row state produce the same key; a later update of the
        row (a new cursor) produces a new one.
        """
        name = poller if poller is not None else str(self.metadata.get("poller", ""))
        return dedup_key(name, self.pk, self.cursor)


def dedup_key(poller: str, pk: Mapping[str, Any], cursor: Any) -> str:
    """The ``poller:pk_hash:cursor`` dedup key without building an event."""
    return f"{poller}:{pk_hash(pk)}:{cursor_text(cursor)}"
