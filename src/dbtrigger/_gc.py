"""Pausing the cyclic garbage collector while a batch is being built.

Fetching and normalising a batch allocates several container objects per row
(the row dict, the event, its read-only views) that all stay alive until the
handler is done. CPython's collector is triggered by allocation counts, so a
batch of thousands of rows sets off a run of young-generation collections in
the middle of building it, each one re-scanning every object of the batch made
so far - cycles that cannot exist yet, since nothing is released. Measured, that
was a quarter to a third of a catch-up drain at batch 1000 and above.

The pause covers only that allocation burst and only when the collector is
enabled; reference counting still frees everything as usual, and the collector
resumes (and catches up) as soon as the batch is built.

The second measure covers a whole tick that holds the lease. Each batch's
events live through a handler call, long enough to be promoted to the oldest
generation, and every so many batches that triggers a full collection, which
walks every object of the process: the imported modules, SQLAlchemy's caches,
the application's own. Measured, those full collections were the largest part
of what a catch-up spent in the collector. :func:`older_objects_frozen` moves
what existed before the tick out of the collector's view for the tick's
duration (``gc.freeze()``, undone by ``gc.unfreeze()`` when it ends: both are
constant-time list splices), so full collections during the tick walk only
what the tick made. Cyclic garbage among older objects is then found one tick
later, no object is lost or freed early. It does nothing when the collector is
off or the application froze objects itself (e.g. before forking workers).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_freeze_lock = threading.Lock()
_freeze_holders = 0
_froze = False


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Keep the objects that exist now out of every collection until this exits.

    Nested and concurrent uses (several pollers in one process) share one
    freeze: the first to enter freezes, the last to leave unfreezes.
    """
    global _freeze_holders, _froze  # noqa: PLW0603 - one process-wide collector
    with _freeze_lock:
        if _freeze_holders == 0:
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _freeze_holders += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_holders -= 1
            if _freeze_holders == 0 and _froze:
                _froze = False
                gc.unfreeze()
