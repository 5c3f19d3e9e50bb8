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
        self._numbers_before_text(finder, telemetry)

    @staticmethod
    def _numbers_before_text(finder: FindsNullCursors, telemetry: Telemetry) -> None:
        """Rows an SQLite date/time cursor holds as numbers beside text: SQLite
        sorts every number before every text, so once the checkpoint is text such
        a row is behind it and never fetched. Said, so that it is not lost unseen."""
        probe = getattr(finder, "numbers_before_text_keys", None)
        if probe is None:
            return
        try:
            keys = probe()
        except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the tick
            telemetry.emit("null_check_failed", "number-cursor probe failed: %s", exc)
            return
        if keys:
            column = finder.cursor_column
            telemetry.emit(
                "cursor_numbers_before_text",
                "%d%s row(s) hold a number in the date/time cursor %s, which also holds text: "
                "SQLite sorts every number before every text, so a row written with a number "
                "after the checkpoint became text is behind it and never delivered, e.g. %s. "
                "Store one kind: UPDATE ... SET %s = datetime(%s, 'unixepoch') WHERE "
                "typeof(%s) IN ('integer', 'real'), then re-deliver the rows it names "
                "(dbtrigger reset <poller> --to-cursor ...) if the new text is below the "
                "checkpoint",
                len(keys),
                "+" if len(keys) >= 10 else "",
                column,
                keys[:5],
                column,
                column,
                column,
                keys=keys[:10],
            )


__all__ = ["NullCursorProbe"]
