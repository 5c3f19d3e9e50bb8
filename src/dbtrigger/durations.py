"""Durations typed on a command line: ``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w``.

``dbtrigger queue prune --older-than`` and ``dbtrigger changelog prune
--older-than`` once parsed these with two regular expressions of their own: the
queue's took bare seconds and spaces, the change log's did not, and the two
refused bad text with different hints. One rule serves both now, so an age
that one prune command accepts the other accepts too.
"""

from __future__ import annotations

import re

from dbtrigger.errors import ConfigurationError

__all__ = ["duration_seconds"]

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
