"""Numeric options of the public constructors, checked one way, at construction.

Python compares almost anything, so a wrong type used to pass the old
``if batch_size < 1`` checks or fail far from its cause: ``batch_size="100"``
raised a bare ``TypeError`` at the first comparison (for a Function App, at
import: no function indexed); ``batch_size=True`` is an ``int`` equal to 1;
``lease_ttl_seconds=nan`` passes every comparison (``nan <= 0`` is False) and
made a lease that never expires, or always has; ``inf`` a wait of forever.
Every public constructor now passes each numeric option through
:func:`whole`, :func:`seconds` or :func:`number`, which return the value as an ``int`` or a
``float`` or raise a :class:`~dbtrigger.errors.ConfigurationError` that names
the option, the value given and what it must be.

A string is never a number here: ``%SETTING%`` references are the business of
the Azure glue (``DbBindings``), which resolves them first
(:func:`dbtrigger.settings.setting_number`).
"""

from __future__ import annotations

import math
import numbers

from dbtrigger.errors import ConfigurationError

__all__ = ["flag", "flag_or", "number", "optional_seconds", "optional_whole", "seconds", "whole"]


def _refuse(name: str, value: object, wanted: str) -> ConfigurationError:
    shown = f"{value!r} ({type(value).__name__})" if not isinstance(value, float) else repr(value)
    return ConfigurationError(f"{name} must be {wanted}, got {shown}")


def flag(name: str, value: object) -> bool:
    """``value``, which must be ``True`` or ``False`` (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise _refuse(name, value, "True or False")
    return value


def flag_or(name: str, value: object, word: str) -> bool | str:
    """``value``, which must be ``True``, ``False`` or the string ``word``."""
    if isinstance(value, bool) or value == word:
        return value
    raise _refuse(name, value, f"True, False or {word!r}")


def whole(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]``.

    A bool, a string, a float (even ``100.0``: a count is typed as one) and
    anything outside the range are refused, naming ``name``.
    """
    wanted = f"a whole number >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _refuse(name, value, wanted)
    result = int(value)
    if result < minimum or (maximum is not None and result > maximum):
        raise _refuse(name, value, wanted)
    return result


def number(name: str, value: object, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """``value`` as a finite ``float`` above ``minimum`` (or equal, when ``inclusive``).

    Ints are welcome; a bool, a string, NaN and the infinities are refused,
    naming ``name``.
    """
    return _real(name, value, minimum, inclusive, "a finite number")


def seconds(name: str, value: object, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """:func:`number` for a duration (``lease_ttl_seconds=120`` is fine, ``nan`` is not)."""
    return _real(name, value, minimum, inclusive, "a finite number of seconds")


def _real(name: str, value: object, minimum: float, inclusive: bool, what: str) -> float:
    wanted = f"{what} {'>=' if inclusive else '>'} {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(name, value, wanted)
    result = float(value)
    if not math.isfinite(result) or result < minimum or (result == minimum and not inclusive):
        raise _refuse(name, value, wanted)
    return result


def optional_seconds(
    name: str, value: object, *, minimum: float = 0.0, inclusive: bool = False
) -> float | None:
    """:func:`seconds`, with ``None`` (the default is decided elsewhere) let through."""
    if value is None:
        return None
    return seconds(name, value, minimum=minimum, inclusive=inclusive)


def optional_whole(
    name: str, value: object, *, minimum: int = 1, maximum: int | None = None
) -> int | None:
    """:func:`whole`, with ``None`` let through."""
    if value is None:
        return None
    return whole(name, value, minimum=minimum, maximum=maximum)
