"""What changed between two readable source definitions (the one a state
document recorded and the one the source has now).

A fingerprint mismatch is refused (:mod:`dbtrigger.state.lease`); these say
which fields differ, so the refusal and ``dbtrigger reset --accept-source``
can name them: ``port 5432 -> 5499; table orders -> orders_v2``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dbtrigger.cursor import canonical_json


def definition_changes(
    stored: Mapping[str, Any], configured: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """``(field, stored, configured)`` for every field that differs (the hash aside)."""
    names = [k for k in configured if k != "fingerprint"]
    names += [k for k in stored if k not in configured and k != "fingerprint"]
    return [
        (name, stored.get(name), configured.get(name))
        for name in names
        if canonical_json(stored.get(name)) != canonical_json(configured.get(name))
    ]


def show_changes(changes: Sequence[tuple[str, Any, Any]]) -> str:
    """``port 5432 -> 5499; table orders -> orders_v2`` (values as JSON, shortened)."""

    def show(value: Any) -> str:
        text = canonical_json(value)
        return text if len(text) <= 80 else text[:77] + "..."

    return "; ".join(f"{name} {show(old)} -> {show(new)}" for name, old, new in changes)


__all__ = ["definition_changes", "show_changes"]
