"""Per-event window bookkeeping for one batch: which rows to hand out, and
where the outcomes leave the checkpoint and the window.

The tick driver (:mod:`dbtrigger.runtime.tick`) reads rows and writes the
document; these functions only compute, from the rows read, the window in the
document and the handler's marks, using the pure decisions of
:mod:`dbtrigger.state.window`. Without a window (no event of this poller ever
asked for a retry) they reduce to what a tick always did: hand out the rows
read, and move the checkpoint to the last of them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, TypeVar

from dbtrigger.cursor import Position, pk_json
from dbtrigger.events import RowChange
from dbtrigger.runtime.lanes import moved_from
from dbtrigger.sources.base import position_of
from dbtrigger.state import window as windowmod
from dbtrigger.state.window import Bound, Settlement, Window

_T = TypeVar("_T")


@dataclass(frozen=True)
class Selection:
    """The rows of the next batch, chosen among those read after the checkpoint."""

    rows: Sequence[Mapping[str, Any]]
    """Raw rows to hand to the handler, in source order."""
    window: Window
    """The per-event window they were chosen against."""
    fetched: tuple[Position, ...] | None
    """Every row read after the checkpoint (with a window), else None."""
    complete: bool
    """The read returned every row after the checkpoint."""
    more: bool
    """Rows are likely pending after this batch."""
    tidy: Settlement | None = None
    """Nothing to hand out, but the window moves (rows in it are gone)."""
    fresh: int = 0
    """Rows handed out that were not waiting for a retry."""


@dataclass(frozen=True)
class WindowView:
    """What the window did to one read: for the tick's report (see
    :meth:`dbtrigger.runtime.tick.TickDriver.next_batch`)."""

    window: Window
    """The window the batch was chosen against: the stored one less the
    entries whose rows are gone."""
    pressure: bool = False
    withheld: int = 0
    """Rows of the read the window's bound kept back although the batch had room."""
    full: bool = False
    held: int = 0
    """Rows kept back behind an earlier event of their key that waits."""
    blocked: bool = False
    """Rows wait and not one new row goes out (:attr:`windowmod.Plan.blocked`)."""
    dropped: int = 0
    """Entries of the stored window whose rows are gone."""
    crowded: bool = False
    """Held rows fill even the widest read (:func:`widening`): rows of other keys
    after them are not read until the events they wait behind settle."""


#: Looks up exact positions in the source: those that still hold a row.
Locate = Callable[[Sequence[Position]], Sequence[Position]]


def choose(
    rows: Sequence[Mapping[str, Any]],
    positions: Sequence[Position] | None,
    window: Window,
    *,
    limit: int,
    batch_size: int,
    bound: Bound,
    now: dt.datetime,
    locate: Locate | None = None,
    hold: Set[str] = frozenset(),
    reserve: bool = False,
    groups: Sequence[tuple[str, ...]] | None = None,
) -> tuple[Selection | None, WindowView]:
    """The next batch among ``rows`` (read with ``limit``; ``positions`` are
    theirs, needed only with a window), and what the window did. None: nothing
    to do, an idle tick. ``hold``: window keys of waiting events not to hand
    out now (fan-out: nobody can take them). ``groups``: each row's
    :func:`row_keys` (default: its key alone, from ``positions``).

    Entries the read proves gone are dropped first (:func:`windowmod.gone`).
    If the window then still blocks progress while it holds entries the read
    could not place (beyond its last row, or of an order Python cannot be
    sure of), ``locate`` looks those exact tuples up and the ones with no row
    are dropped too; a source that cannot look rows up (``locate`` None) has
    them dropped as well: a duplicate delivery, should one still be there, is
    the price of never stalling on an entry that cannot be placed.

    ``reserve``: hand out no more rows than the window could hold as waiting
    even when it is empty (positions are then needed too); the tick asks for
    it after a batch whose retries did not all fit the bound.
    """
    complete = len(rows) < limit
    if not rows and not window:
        return None, WindowView(window)
    if not window and not reserve:
        selection = Selection(
            rows, window, None, complete, len(rows) >= batch_size, fresh=len(rows)
        )
        return selection, WindowView(window)
    positions = list(positions or ())
    keys = [windowmod.key_of(p) for p in positions]
    sizes = [windowmod.entry_size(p) for p in positions]
    if groups is None:
        groups = [(windowmod.row_key(p),) for p in positions]
    current = window.without(windowmod.gone(window, positions, complete=complete))

    def decide(w: Window) -> windowmod.Plan:
        return windowmod.plan(
            keys,
            sizes,
            w,
            now=now,
            batch_size=batch_size,
            bound=bound,
            groups=groups,
            hold=hold,
            reserve=reserve,
        )

    chosen = decide(current)
    if chosen.blocked and chosen.withheld and not complete:
        unseen = current.keys() - set(keys)
        if unseen:
            entries = [p for p in current.settled if windowmod.key_of(p) in unseen]
            entries += [
                p.position for p in current.pending if windowmod.key_of(p.position) in unseen
            ]
            found = {windowmod.key_of(p) for p in (locate(entries) if locate else ())}
            current = current.without(unseen - found)
            chosen = decide(current)
    view = WindowView(
        current,
        chosen.pressure,
        chosen.withheld,
        chosen.full,
        chosen.held,
        chosen.blocked,
        len(window) - len(current),
    )
    if not chosen.deliver:
        tidy = windowmod.settle(
            positions,
            complete=complete,
            window=current,
            settled=frozenset(),
            retried={},
            bound=bound,
        )
        if tidy.checkpoint is None and tidy.window == window:
            return None, view
        return Selection((), current, tuple(positions), complete, False, tidy), view
    more = not complete and not chosen.pressure
    picked = [rows[i] for i in chosen.deliver]
    return Selection(picked, current, tuple(positions), complete, more, fresh=chosen.new), view


def widening(
    rows: Sequence[Mapping[str, Any]],
    fetch: Callable[[int], Sequence[Mapping[str, Any]]],
    events: Callable[[Sequence[Mapping[str, Any]]], Sequence[RowChange]],
    window: Window,
    *,
    limit: int,
    batch_size: int,
    bound: Bound,
    now: dt.datetime,
    locate: Locate | None = None,
    hold: Set[str] = frozenset(),
    reserve: bool = False,
) -> tuple[Selection | None, WindowView]:
    """:func:`choose` over ``rows`` (read with ``limit``; ``events`` turns rows
    into events, for their positions and keys), reading further with ``fetch``
    while rows held back by per-key order take the batch's room.

    A read of ``limit`` rows (``batch_size`` and the window's entries) has room
    for a batch only if the rows it returns are new or in the window. Rows held
    back behind a waiting event of their key (:attr:`WindowView.held`) are
    neither, and a key with more later changes than that filled the read: with
    ``batch_size=1``, one retried change and one more change of its key, no
    row of any other key was read again until the retry settled (never, while
    the handler failed it and no dead-letter sink took it), and the log said
    only that rows wait behind it. So the read widens - to ``limit`` and twice
    the held rows it returned - until the batch fills, the read returns
    every row, or it reaches ``bound.max_events`` rows past ``limit``. A read is
    a prefix of the source, so a wider one never lets a held row out first.
    Held rows still blocking the widest read are :attr:`WindowView.crowded`.
    Under the window's pressure, or with it full, no new row may go out and
    the read stays as it is.
    """

    def pick(rows: Sequence[Mapping[str, Any]], limit: int) -> tuple[Selection | None, WindowView]:
        positions = keys = None
        if (window or reserve) and rows:
            planned = events(rows)
            positions, keys = [position_of(e) for e in planned], groups(planned)
        return choose(
            rows,
            positions,
            window,
            limit=limit,
            batch_size=batch_size,
            bound=bound,
            now=now,
            locate=locate,
            hold=hold,
            reserve=reserve,
            groups=keys,
        )

    base, widest = limit, limit + bound.max_events
    selection, view = pick(rows, limit)
    while view.held and not (view.pressure or view.full) and len(rows) >= limit:
        wider = min(widest, base + 2 * view.held)
        if wider <= limit or (selection is not None and len(selection.rows) >= batch_size):
            break
        limit = wider
        rows = fetch(limit)
        selection, view = pick(rows, limit)
    if view.blocked and view.held and len(rows) >= limit >= widest:
        view = dataclasses.replace(view, crowded=True)
    return selection, view


def attempts(events: Sequence[RowChange], window: Window) -> dict[str, int]:
    """Deliveries so far of the events waiting for a retry (event id -> count)."""
    if not window.pending:
        return {}
    return _by_event(events, {windowmod.key_of(p.position): p.attempts for p in window.pending})


def owed(events: Sequence[RowChange], window: Window) -> dict[str, Mapping[str, int]]:
    """Fan-out: the subscribers each waiting event is still owed to (event id ->
    subscriber -> attempts), for events whose pending entry names them."""
    waiting = {windowmod.key_of(p.position): p.owed for p in window.pending if p.owed is not None}
    if not waiting:
        return {}
    return _by_event(events, waiting)


def _by_event(events: Sequence[RowChange], waiting: Mapping[str, _T]) -> dict[str, _T]:
    """``waiting`` (window key -> what its pending entry holds) for the events of
    the batch that have an entry, by event id."""
    out: dict[str, _T] = {}
    for event in events:
        found = waiting.get(windowmod.key_of(position_of(event)))
        if found is not None:
            out[event.event_id] = found
    return out


def fetched(selection: Selection, events: Sequence[RowChange]) -> Sequence[Position]:
    """The rows the checkpoint may walk: all rows read (with a window), else the batch."""
    if selection.fetched is not None:
        return selection.fetched
    return [position_of(e) for e in events]


def settle_delivered(
    selection: Selection,
    events: Sequence[RowChange],
    retried: Mapping[str, str],
    *,
    now: dt.datetime,
    bound: Bound,
    backoff: tuple[float, float],
    jitter: Callable[[], float],
    owed: Mapping[str, Mapping[str, int]] | None = None,
    terminal: Collection[str] = (),
    deferred: Set[str] = frozenset(),
    delays: Mapping[str, float] | None = None,
) -> Settlement | None:
    """Fold a delivered batch into the window (``retried``: event id -> reason;
    ``owed``: with fan-out, event id -> the subscribers it goes to again;
    ``terminal``: the ids written to the dead-letter sink; ``deferred``:
    retried ids nobody received, which count no attempt; ``delays``: event id
    -> the handler's own delay instead of the backoff).

    An event after a retried event of the same row key is not settled,
    whatever the handler did with it: it comes again after that event, so a
    key's events end up handled in source order (docs/reliability.md,
    "Per-key order"). With fan-out it is owed again only to the subscribers
    the earlier event is owed to, with its attempt counts unchanged.

    None when no window is involved (none before, nothing retried): the
    checkpoint simply moves to the batch's last row, as it always did.
    """
    if not selection.window and not retried:
        return None
    pending = {windowmod.key_of(p.position): p for p in selection.window.pending}
    settled: set[str] = set()
    waiting: dict[str, windowmod.Pending] = {}
    # Row key -> who an earlier event of it in this batch is still owed to
    # (None: the single handler): the events after it wait too (per-key order).
    blocking: dict[str, set[str] | None] = {}
    for event in events:
        where = position_of(event)
        key = windowmod.key_of(where)
        group = row_keys(event)
        reason = retried.get(event.event_id)
        # A dead-lettered event is settled for good, held back or not.
        found = [blocking[k] for k in group if k in blocking]
        held = bool(found) and event.event_id not in terminal
        if reason is None and not held:
            settled.add(key)
            continue
        earlier = _owed_by(found)
        if reason is None:
            if earlier is not None:  # fan-out: owed again to who owes the earlier event
                waiting[key] = windowmod.held_entry(where, pending.get(key), earlier, now=now)
            continue  # the single handler: not settled; delivered again after it
        entry = windowmod.retry_entry(
            where,
            pending.get(key),
            reason=reason,
            now=now,
            base=backoff[0],
            cap=backoff[1],
            jitter=jitter(),
            owed=None if owed is None else owed.get(event.event_id),
            counted=event.event_id not in deferred,
            delay=None if delays is None else delays.get(event.event_id),
        )
        if held and earlier is not None and entry.owed is not None:
            before = pending.get(key)
            counts = dict(before.owed or {}) if before is not None else {}
            owes = {name: counts.get(name, 0) for name in earlier}
            entry = dataclasses.replace(entry, owed={**owes, **entry.owed})
        waiting[key] = entry
        for k in group:
            blocking[k] = (
                None
                if entry.owed is None or (held and earlier is None)
                else (earlier or set()) | set(entry.owed)
            )
    return windowmod.settle(
        fetched(selection, events),
        complete=selection.complete,
        window=selection.window,
        settled=settled,
        retried=waiting,
        bound=bound,
    )


def in_key_order(events: Sequence[RowChange], settled: frozenset[str]) -> frozenset[str]:
    """``settled`` less the events that follow an unsettled event of their row key
    in the batch: those come again after it (per-key order), whatever the
    handler did with them."""
    blocked: set[str] = set()
    out = set(settled)
    for event in events:
        group = row_keys(event)
        if any(k in blocked for k in group):
            out.discard(event.event_id)
        elif event.event_id not in settled:
            blocked.update(group)
    return frozenset(out)


def row_keys(event: RowChange) -> tuple[str, ...]:
    """The row keys ``event`` orders against (:func:`windowmod.row_key`): its own,
    and for an update that moved its row to another key (a log's ``UPDATE ... SET
    id = 40 WHERE id = 4``) the old one too - a later change of key 4 must not
    overtake the move that freed it, nor a move overtake a waiting change of 4."""
    own = windowmod.row_key(position_of(event))
    old = moved_from(event)
    return (own,) if old is None else (own, pk_json(old))


def groups(events: Sequence[RowChange]) -> list[tuple[str, ...]] | None:
    """Each event's :func:`row_keys`, for :func:`choose`; None when no event moved
    its row to another key (then each orders by its own key, from its position)."""
    if all(moved_from(e) is None for e in events):
        return None
    return [row_keys(e) for e in events]


def _owed_by(found: Sequence[set[str] | None]) -> set[str] | None:
    """Who the earlier waiting events of an event's keys are owed to (None: the
    single handler, or none waits)."""
    if not found or any(f is None for f in found):
        return None
    return set().union(*(f for f in found if f is not None))


def settle_failed(
    selection: Selection,
    events: Sequence[RowChange],
    settled_ids: frozenset[str],
    bound: Bound,
) -> Settlement | None:
    """Where a failed batch leaves the window (None: no window; the failure
    record's head/done rule applies, as it always did)."""
    if not selection.window:
        return None
    return windowmod.settle(
        fetched(selection, events),
        complete=selection.complete,
        window=selection.window,
        settled={windowmod.key_of(position_of(e)) for e in events if e.event_id in settled_ids},
        retried={},
        bound=bound,
    )
