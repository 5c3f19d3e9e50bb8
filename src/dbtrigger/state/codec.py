"""The state document's encodings of times and positions, below everything that stores them.

A time is UTC ISO-8601 with microseconds and ``Z``; a position is its cursor
value and key values, each with its kind (:mod:`dbtrigger.cursor`), so that a
value comes back as the type it was. The document (:mod:`.document`), the
settled window (:mod:`.window`) and the journal (:mod:`.journal`) all write
positions and times this one way.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from dbtrigger.cursor import Position, decode_value, encode_value, infer_kind
from dbtrigger.errors import CorruptStateError

_UTC = dt.timezone.utc


#: The last few times :func:`format_time` wrote, and their texts. A commit writes
#: five times and three of them are the same instant (the commit's clock reading:
#: heartbeat, checkpoint, journal entry) or the lease's start, the same for every
#: commit of a tick; a look-up is a thirtieth of a format.
_formatted: dict[dt.datetime, str] = {}
_FORMATTED_MAX = 16


def format_time(value: dt.datetime) -> str:
    """UTC ISO-8601 with microseconds and ``Z``: the document's only time format."""
    text = _formatted.get(value)
    if text is not None:
        # (Equal aware datetimes are the same instant, so the same UTC text; a
        # naive one never equals an aware one, and is never stored.)
        return text
    if value.tzinfo is _UTC and type(value) is dt.datetime:
        # Every time a poller writes (its clock is UTC): isoformat's "+00:00" is the
        # "Z". Five of these a commit; converting first costs three times as much.
        text = value.isoformat(timespec="microseconds")[:-6] + "Z"
        if len(_formatted) >= _FORMATTED_MAX:
            _formatted.clear()
        _formatted[value] = text
        return text
    if value.tzinfo is None:
        raise ValueError("state document times must be timezone-aware")
    return (
        value.astimezone(dt.timezone.utc).replace(tzinfo=None).isoformat(timespec="microseconds")
        + "Z"
    )


def parse_time(value: Any, where: str) -> dt.datetime:
    if not isinstance(value, str):
        raise CorruptStateError(f"{where} must be an ISO-8601 string, got {value!r}")
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise CorruptStateError(f"{where} is not an ISO-8601 time: {value!r}") from exc
    if parsed.tzinfo is None:
        raise CorruptStateError(f"{where} has no time zone: {value!r}")
    return parsed.astimezone(dt.timezone.utc)


def position_to_json(position: Position) -> dict[str, Any]:
    kind, value = encode_value(position.cursor)
    tiebreaker: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for name, pk_value in position.pk.items():
        kinds[name], tiebreaker[name] = encode_value(pk_value)
    return {
        "kind": f"{kind}+pk",
        "value": value,
        "tiebreaker": tiebreaker,
        "tiebreaker_kinds": kinds,
    }


def position_from_json(raw: Any, where: str = "checkpoint.cursor") -> Position:
    if not isinstance(raw, Mapping):
        raise CorruptStateError(f"{where} must be an object, got {raw!r}")
    kind = raw.get("kind")
    if not isinstance(kind, str) or not kind:
        raise CorruptStateError(f"{where}.kind must be a non-empty string")
    cursor_kind = kind.split("+", 1)[0]
    cursor = decode_value(cursor_kind, raw.get("value"))
    tiebreaker = raw.get("tiebreaker") or {}
    kinds = raw.get("tiebreaker_kinds") or {}
    if not isinstance(tiebreaker, Mapping) or not isinstance(kinds, Mapping):
        raise CorruptStateError(f"{where}.tiebreaker must be an object of key values")
    pk = {
        str(name): decode_value(str(kinds.get(name) or infer_kind(value)), value)
        for name, value in tiebreaker.items()
    }
    return Position(cursor=cursor, pk=pk)
