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
import sys
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
#: The process's allocated memory blocks after the last full collection this
#: module ran (0: none yet). See :func:`_freeze_collecting`.
_collected_at = 0
#: When to run a full collection before a freeze: after the process's allocated
#: blocks grew by a quarter since the last one (the share by which CPython's own
#: rule lets its oldest generation grow), and by at least FLOOR blocks, so that
#: a small process does not collect at every tick.
GROWTH = 0.25
FLOOR = 50_000


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
                _freeze_collecting()
        _freeze_holders += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_holders -= 1
            if _freeze_holders == 0 and _froze:
                _froze = False
                gc.unfreeze()


def _freeze_collecting() -> None:
    """``gc.freeze()``, after a full collection when the process has grown enough
    to call for one.

    A freeze takes every tracked object out of the collector's view, garbage
    included: cycles a tick let go of as it ended (a heartbeat and its watcher, a
    batch's events) are frozen with the rest at the next tick. Ticks that follow
    each other with hardly an allocation between them (a drain, a busy worker)
    then run every full collection inside a freeze, and that garbage is never
    found: a 10,000-tick drain grew from 50k to 870k objects (450 MB RSS).

    The measure of growth is ``sys.getallocatedblocks()`` (a walk of the
    allocator's arenas: about 10 us for a small process, 0.2 ms at six million
    blocks); ``gc.get_freeze_count()`` would count the frozen objects one by one.
    """
    global _collected_at  # noqa: PLW0603 - one process-wide collector
    blocks = sys.getallocatedblocks()
    if _collected_at == 0:
        _collected_at = blocks
    elif blocks > max(_collected_at * (1 + GROWTH), _collected_at + FLOOR):
        gc.collect()
        _collected_at = sys.getallocatedblocks()
    gc.freeze()
