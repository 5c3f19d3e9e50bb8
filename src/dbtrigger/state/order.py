"""The order of two positions as every database sees it, where that is certain.

An entry of the settled window whose row is gone must be found without a
complete read (:func:`dbtrigger.state.window.gone`): a read is a prefix of
the source in its order, so an entry it went past without returning is gone.
That needs the order of two ``(cursor, key)`` tuples. Python knows it for
sure when the values are numbers, timestamps or dates (every database orders
those as Python does); text, UUIDs and bytes may sort otherwise under a
database collation or byte layout, so for them the order is "unknown".
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Sequence
from typing import Any

from dbtrigger.cursor import Position


def _rank(value: Any) -> tuple[str, Any] | None:
    """``value`` with the family it orders in, when every database orders that
    family as Python does (numbers, timestamps, dates); None otherwise (text,
    UUIDs and bytes may follow a collation or a byte layout of their own)."""
    if isinstance(value, (int, decimal.Decimal)):  # bool is an int, as in SQL
        return ("number", value)
    if isinstance(value, float):
        return None if math.isnan(value) else ("number", value)
    if isinstance(value, dt.datetime):
        return ("naive" if value.tzinfo is None else "aware", value)
    if isinstance(value, dt.date):
        return ("date", value)
    return None


def _compare(a: Any, b: Any) -> int | None:
    """-1, 0 or 1 as a database orders ``a`` and ``b``; None: not known for sure."""
    ra, rb = _rank(a), _rank(b)
    if ra is None or rb is None or ra[0] != rb[0]:
        return None
    return -1 if ra[1] < rb[1] else (1 if ra[1] > rb[1] else 0)


def precedes(a: Position, b: Position, columns: Sequence[str]) -> bool | None:
    """Does ``a`` come before ``b`` in the source's order, ``(cursor, *columns)``?

    None when that is not known for sure (see :func:`_rank`): the caller must
    then treat ``a`` as possibly after ``b``. ``columns`` are the key columns
    in the source's order (a stored position keeps its key in the document's
    order, which need not be the source's).
    """
    found = _compare(a.cursor, b.cursor)
    if found is None:
        return None
    if found:
        return found < 0
    for name in columns:
        if name not in a.pk or name not in b.pk:
            return None
        found = _compare(a.pk[name], b.pk[name])
        if found is None:
            return None
        if found:
            return found < 0
    return False  # the same tuple


__all__ = ["precedes"]
