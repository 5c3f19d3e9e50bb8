"""Durations typed on a command line: ``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w``.

``dbtrigger queue prune --older-than`` and ``dbtrigger changelog prune
--older-than`` once parsed these with two regular expressions of their own: the
queue's took bare seconds and spaces, the change log's did not, and the two
refused bad text with different hints. One rule serves both now, so an age
that one prune command accepts the other accepts too.

:func:`human_duration` goes the other way: seconds as a person reads them in a
log line or a command's output (``3h 25m``, not ``12345.678s``).
"""

from __future__ import annotations

import re

from dbtrigger.errors import ConfigurationError

__all__ = ["duration_seconds", "human_duration"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_seconds(text: str) -> float:
    """Seconds in ``text``: a number of seconds, or a number with s, m, h, d or w."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigurationError(
            f"not a duration: {text!r} (use seconds, or a number with s, m, h, d or w: "
            "90, 90s, 15m, 12h, 7d, 2w)"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def human_duration(seconds: float) -> str:
    """``0.4s``, ``45s``, ``12m 5s``, ``3h 25m``, ``2d 4h``: two units at most.

    Tenths below 10 s (a short drain, a quick retry), whole seconds below a
    minute; above that the two largest units, rounded down. Negative is 0.
    """
    seconds = max(float(seconds), 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m {secs}s" if secs else f"{minutes}m"
    hours, mins = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {mins}m" if mins else f"{hours}h"
    days, hrs = divmod(hours, 24)
    return f"{days}d {hrs}h" if hrs else f"{days}d"
