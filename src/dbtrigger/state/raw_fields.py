"""Reading one field of a state document's raw JSON, checked.

A document is read from bytes anyone may have edited: every field is checked
for presence, null and type here, and a bad one is a
:class:`~dbtrigger.errors.CorruptStateError` naming where it is
(``lease.fencing_token``), never a ``TypeError`` further on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dbtrigger.errors import CorruptStateError


def require(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in raw:
        raise CorruptStateError(f"{where}.{key} is missing")
    if raw[key] is None:  # a required field has no null form (a hand edit, a damaged write)
        raise CorruptStateError(f"{where}.{key} is null; it must be {kind_words(kind)}")
    return typed(raw, key, kind, where)


def kind_words(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    words = {int: "an integer", str: "a string"}
    return " or ".join(words.get(k, "an object") for k in kinds)


def typed(
    raw: Mapping[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    where: str,
    default: Any = None,
) -> Any:
    """``raw[key]`` if it has type ``kind`` (absent or null: ``default``); bools are not ints."""
    value = raw.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise CorruptStateError(f"{where}.{key} has the wrong type: {value!r}")
    return value


def count(
    raw: Mapping[str, Any], key: str, where: str, default: int | None, *, required: bool = False
) -> int | None:
    """A non-negative integer field (``required``: it must be present)."""
    value = require(raw, key, int, where) if required else typed(raw, key, int, where, default)
    if value is not None and value < 0:
        raise CorruptStateError(f"{where}.{key} must not be negative: {value!r}")
    return value  # type: ignore[no-any-return]


__all__ = ["count", "kind_words", "require", "typed"]
