"""What takes the space in a state document that a store cannot hold.

A store that refuses a document for its size (the Table store's 1 MiB entity,
MariaDB's ``max_allowed_packet``) knows only the bytes. The fix depends on
what made them large, and each part has its own knob: the settled window is
bounded by ``window_max_bytes`` (and fed by ``batch_size``), the journal by
``journal_limit``, and a failure record holds the ids of the rows a failed
batch got done (``batch_size`` again). So the error names the part that takes
the most and the setting to change, instead of guessing one (the Table store
used to name ``journal_limit`` for a window of 3,000 waiting events).

Pure: bytes in, one sentence out. A document that is not JSON is described by
its size alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"))) if value is not None else 0


def parts(data: bytes) -> dict[str, int] | None:
    """Encoded bytes of the window, the journal, the failure record and the
    rest of a document (None: not a JSON object)."""
    try:
        raw = json.loads(data)
    except ValueError:
        return None
    if not isinstance(raw, Mapping):
        return None
    out = {
        "window": _size(raw.get("window")),
        "journal": _size(raw.get("journal")),
        "failure": _size(raw.get("failure")),
    }
    out["other"] = max(0, len(data) - sum(out.values()))
    return out


def _window_counts(data: bytes) -> tuple[int, int]:
    window = json.loads(data).get("window") or {}
    return len(window.get("pending") or []), len(window.get("settled") or [])


def _journal_entries(data: bytes) -> int:
    return len(json.loads(data).get("journal") or [])


def explain(data: bytes) -> str:
    """Which part of a too-large document takes the space, and what to change."""
    found = parts(data)
    if found is None:
        return f"the document is {len(data)} bytes"
    largest = max(found, key=lambda k: found[k])
    listing = ", ".join(
        f"{name} {found[name]}" for name in ("window", "journal", "failure", "other")
    )
    if largest == "window":
        pending, settled = _window_counts(data)
        advice = (
            f"the settled window takes the most ({pending} event(s) waiting for a retry, "
            f"{settled} settled above the checkpoint): it is bounded by the poller's "
            "window_max_bytes, which must leave this store room for the rest of the "
            "document - lower window_max_bytes (and batch_size), or use a store without "
            "this limit (Blob, SQL)"
        )
    elif largest == "journal":
        advice = (
            f"the journal takes the most ({_journal_entries(data)} entries): lower the "
            "poller's journal_limit"
        )
    elif largest == "failure":
        advice = (
            "the failure record takes the most (the ids of the rows a failed batch got "
            "done): lower batch_size"
        )
    else:
        advice = (
            "neither the window nor the journal nor a failure record takes the most: "
            "look at the document (dbtrigger status POLLER --json) and report it"
        )
    return f"the document is {len(data)} bytes ({listing}); {advice}"
