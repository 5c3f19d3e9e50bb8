"""The events handed to handlers.

A cursor poller sees the *current* state of each changed row, not the change
itself: it cannot tell an insert from an update, and it never sees the row as it
was before. So ``op`` is ``"upsert"`` and ``before`` is ``None`` for cursor
sources; sources that know more (a claim queue, a change table) may say more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dbtrigger.cursor import canonical_json, cursor_text, encode_value, encoded_pk, pk_hash

VALID_OPS = frozenset({"insert", "update", "upsert", "delete"})


def make_event_id(poller: str, pk: Mapping[str, Any], cursor: Any) -> str:
    """Identity of one source-side row state, equal across drivers and processes.

    Built from the poller name, the primary key and the cursor through the
    state document's own value encoding, never from ``repr`` of driver objects,
    so a psycopg ``Decimal`` and a PyMySQL ``Decimal`` of the same value agree.
    """
    material = canonical_json([poller, encoded_pk(pk), list(encode_value(cursor))])
    return hashlib.sha256(material.encode()).hexdigest()[:32]


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
