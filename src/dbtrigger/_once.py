"""Work done once per object, at its first use: a table created when missing."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Once:
    """Runs ``action`` at the first :meth:`ensure`, once.

    Safe from several threads: one runs ``action`` while the others wait for it.
    An ``action`` that raises is not done; the next :meth:`ensure` tries again.
    ``done=True`` starts it done (nothing to do, e.g. the caller creates the table).
    """

    def __init__(self, action: Callable[[], object], *, done: bool = False) -> None:
        self._action = action
        self.done = done
        self._lock = threading.Lock()

    def ensure(self) -> None:
        if self.done:
            return
        with self._lock:
            if not self.done:
                self._action()
                self.done = True


__all__ = ["Once"]
