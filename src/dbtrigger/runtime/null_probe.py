"""The NULL-cursor probe: rows the source cannot deliver because their cursor is NULL."""

from __future__ import annotations

import time

from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.sources.base import FindsNullCursors, SourceAdapter


class NullCursorProbe:
    """Warns about rows the source cannot deliver because their cursor is NULL.

    Runs on the first tick and then at most every ``interval`` seconds.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -float("inf")

    def run(self, source: SourceAdapter, telemetry: Telemetry) -> None:
        if self.interval <= 0:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return  # (before the protocol check: that costs more than the clock)
        finder = source if isinstance(source, FindsNullCursors) else None
        if finder is None:
            return
        self._last = now
        try:
            keys = finder.null_cursor_keys()
        except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the tick
            telemetry.emit("null_check_failed", "NULL-cursor probe failed: %s", exc)
            return
        telemetry.emit("null_cursor_probe", values={"count": len(keys)})
        if keys:
            telemetry.emit(
                "null_cursor_rows",
                "%d%s row(s) have a NULL %s and cannot be delivered until it is set, e.g. %s",
                len(keys),
                "+" if len(keys) >= 10 else "",
                finder.cursor_column,
                keys[:5],
                keys=keys[:10],
            )


__all__ = ["NullCursorProbe"]
