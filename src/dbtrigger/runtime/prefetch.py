"""The next batch, read while the current batch's lanes run (see
:meth:`~dbtrigger.runtime.reading.BatchReader.look_ahead`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dbtrigger.cursor import Position
from dbtrigger.errors import DbTriggerError
from dbtrigger.runtime.windowing import Selection
from dbtrigger.state.window import Window


@dataclass
class Prefetch:
    """The next batch, read on the tick's thread while the current batch's lanes run.

    ``after`` and ``window`` are where the current batch leaves the checkpoint
    and the settled window if all of its events are accepted; the read is of
    the batch that follows from there. Any error is kept, not raised: the
    lanes are still running, and the read may turn out not to be needed.
    """

    read: Callable[[], Selection | None]
    after: Position
    window: Window
    ran: bool = False
    selection: Selection | None = None
    error: Exception | None = None

    def run(self) -> None:
        self.ran = True
        try:
            self.selection = self.read()
        except Exception as exc:  # noqa: BLE001 - kept for take(), raised if the read is used
            self.error = exc

    def matches(self, after: Position, window: Window) -> bool:
        """Did it run, from where the batch really left the checkpoint and window?"""
        return self.ran and self.after == after and self.window == window

    def take(self) -> tuple[Selection | None, DbTriggerError | None]:
        """The selection, or the read's error (deferred like any fetch error)."""
        if self.error is not None and not isinstance(self.error, DbTriggerError):
            raise self.error
        return self.selection, self.error


__all__ = ["Prefetch"]
