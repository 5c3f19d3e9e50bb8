"""Who an event is: the identity of one source-side row state.

An event id names a row state (poller, key, cursor) the same way in every
process and with every driver, so a redelivered row is known again by the
window, the history and the dead-letter records. It is kept apart from the
event objects (:mod:`dbtrigger.events`) because those are about handing rows
out cheaply, and this is about hashing them the same way for ever: a change
here changes the ids in stored documents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from dbtrigger.cursor import cursor_text, encoded_json, json_string, pk_hash, pk_json

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

    The parts that never change within a poller (its name, the sorted key
    names, the JSON punctuation) are built once here; per row only the key and
    cursor values are encoded. The result equals :func:`make_event_id`.
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

    def single(self, key: Any, cursor: Any) -> str:
        """The id for a one-column key given as its bare value (no mapping built)."""
        material = self._prefix + encoded_json(key) + "}," + encoded_json(cursor) + "]"
        return _sha256(material.encode()).hexdigest()[:32]


def dedup_key(poller: str, pk: Mapping[str, Any], cursor: Any) -> str:
    """The ``poller:pk_hash:cursor`` dedup key without building an event."""
    return f"{poller}:{pk_hash(pk)}:{cursor_text(cursor)}"


__all__ = ["EventIds", "dedup_key", "make_event_id"]
