"""The settled window: per-event outcomes above the checkpoint.

With per-event outcomes (``ctx.reject`` / ``ctx.retry``) a batch no longer
settles all or nothing. An event the handler asked to retry must hold the
checkpoint back - across later batches, ticks and restarts - while the events
after it keep flowing. So the state document keeps, besides the checkpoint
(everything at or before it is settled):

* ``settled``: events above the checkpoint that are settled (accepted, or
  rejected and dead-lettered) while an earlier one is not, so they are not
  delivered again;
* ``pending``: events waiting for a retry, with their attempt count and the
  earliest time they may be delivered again (exponential backoff with jitter).

Both are keyed by the event's full ``(cursor, pk)`` tuple, not by its place in
the source: after a restart the tick re-reads the rows after the checkpoint
and skips exactly the tuples it already settled. A row that committed late
below the newest settled one is still delivered, and a row updated since
(new cursor) is a new tuple and is delivered again.

The checkpoint only ever moves by walking the rows the source returned, in its
order, over settled tuples (:func:`settle`): it can never pass an event that
is not settled, whatever Python thinks of the order of cursor values.

**Entries whose row is gone.** A row deleted, or updated to a new cursor,
leaves its entry behind: its tuple is never read again. Such an entry must go
(:func:`gone`), or it holds room in the bound for ever and, at the pressure
mark, stops the poller for good. A read is a prefix of the source in its
order, so an entry the read did not return although the read went past its
tuple is gone: that needs no complete read, only the order of two tuples.
Python knows that order for sure when the values are numbers, timestamps or
dates (every database orders those as Python does); text, UUIDs and bytes
may sort otherwise under a database collation, so for them it is "unknown",
and such an entry is kept (:func:`precedes`). For what stays unknown the tick
asks the source, only when the window blocks progress, whether those exact
tuples still hold a row (:mod:`dbtrigger.runtime.windowing`): one indexed
lookup, no guess. A read that returned every row after the checkpoint
(``complete``) proves every entry it did not return gone.

The window is bounded (:class:`Bound`, by events and bytes). At 75% of either
bound the tick stops handing out rows beyond the window (it only retries due
events and fills gaps), and while the window is in use it hands out no more
new rows than the window could still remember. If a single batch still
overflows it (a first retry in a batch larger than the bound), the newest
settled entries are not remembered and those events are delivered again:
:attr:`Settlement.overflow` says how many, and the tick logs it. Entries are
never dropped silently, and a pending entry is never dropped while its row is
there.

Everything here is pure: positions, keys, times and sizes in, decisions out.
A lane or a subscriber (parallel delivery, fan-out) needs no cursor of its
own: each settles tuples, and :func:`settle` computes the checkpoint from the
union.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.cursor import Position, canonical_json, pk_json
from dbtrigger.errors import CorruptStateError
from dbtrigger.redaction import redact
from dbtrigger.state.backoff import backoff_seconds
from dbtrigger.state.codec import format_time, parse_time, position_from_json, position_to_json
from dbtrigger.state.order import precedes

#: Longest retry reason kept in the document.
MAX_REASON = 200

#: Share of the bound at which the tick stops handing out rows beyond the window.
PRESSURE = 0.75


def key_of(position: Position) -> str:
    """The window key of an event: its full (cursor, pk) tuple, canonically encoded."""
    return canonical_json(position_to_json(position))


def row_key(position: Position) -> str:
    """The event's row key (its pk alone), canonically encoded: every event of
    one row shares it. A pending event holds back the later events of its row
    key (:func:`plan`), so one key's events are handled in source order."""
    return pk_json(position.pk)


def entry_size(position: Position) -> int:
    """Bytes one settled entry adds to the encoded window (with its comma)."""
    return len(json.dumps(position_to_json(position), separators=(",", ":"))) + 1


#: Bytes a pending entry adds on top of its position (attempts, time, reason).
PENDING_OVERHEAD = 90 + MAX_REASON


def pending_size(entry: Pending) -> int:
    """Bytes one pending entry adds to the encoded window (with its comma)."""
    return len(json.dumps(_pending_json(entry), separators=(",", ":"))) + 1


@dataclass(frozen=True)
class Pending:
    """An event waiting for a retry: delivered ``attempts`` times so far."""

    position: Position
    attempts: int
    not_before: dt.datetime
    reason: str = ""
    #: Fan-out only (``subscribers=``): the subscribers that still owe this
    #: event a resolution, each with its deliveries that ended unresolved. It
    #: is delivered again to them only. None: every subscriber (or the handler).
    owed: Mapping[str, int] | None = None


@dataclass(frozen=True)
class Window:
    """The document's settled window, typed: the runtime never sees its JSON.

    ``bound`` is the writer's bound, stored along so that ``dbtrigger status``
    can tell how full the window is without the trigger's code; ``extra``
    holds fields a newer dbtrigger wrote into it, written back as they were
    read. Neither takes part in comparing windows: two windows are the same
    when they hold the same entries.
    """

    settled: tuple[Position, ...] = ()
    pending: tuple[Pending, ...] = ()
    bound: Bound | None = field(default=None, compare=False)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __len__(self) -> int:
        return len(self.settled) + len(self.pending)

    def to_json(self, bound: Bound | None = None) -> dict[str, Any] | None:
        """The document's ``window`` object; None when empty (the field is left out).

        ``bound``: the poller's bound (default: :attr:`bound`), written along
        so that ``dbtrigger status`` can tell how full the window is without
        the trigger's code.
        """
        if not self.settled and not self.pending:
            return None
        out: dict[str, Any] = {
            "settled": [position_to_json(p) for p in self.settled],
            "pending": [_pending_json(p) for p in self.pending],
        }
        bound = bound if bound is not None else self.bound
        if bound is not None:
            out["bound"] = {"max_events": bound.max_events, "max_bytes": bound.max_bytes}
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def from_json(cls, raw: Any) -> Window:
        """Parse the document's ``window`` (None or absent: empty).

        Raises:
            CorruptStateError: naming the malformed part.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise CorruptStateError("window must be an object or null")
        settled_raw = raw.get("settled") or []
        pending_raw = raw.get("pending") or []
        if not isinstance(settled_raw, list) or not isinstance(pending_raw, list):
            raise CorruptStateError("window.settled and window.pending must be lists")
        settled = tuple(position_from_json(p, "window.settled") for p in settled_raw)
        pending = []
        for item in pending_raw:
            if not isinstance(item, Mapping) or not isinstance(item.get("attempts"), int):
                raise CorruptStateError("window.pending entries need 'at' and 'attempts'")
            pending.append(
                Pending(
                    position=position_from_json(item.get("at"), "window.pending.at"),
                    attempts=item["attempts"],
                    not_before=parse_time(item.get("not_before"), "window.pending.not_before"),
                    reason=str(item.get("reason", "")),
                    owed=_owed_from_json(item.get("owed")),
                )
            )
        extra = {k: v for k, v in raw.items() if k not in _WINDOW_KEYS}
        return cls(settled, tuple(pending), _bound_from_json(raw.get("bound")), extra)

    def encoded_size(self) -> int:
        raw = self.to_json()
        return 0 if raw is None else len(json.dumps(raw, separators=(",", ":")))

    def keys(self) -> set[str]:
        """The window keys of every entry, settled and pending."""
        return {key_of(p) for p in self.settled} | {key_of(p.position) for p in self.pending}

    def without(self, keys: Collection[str]) -> Window:
        """The window less the entries under ``keys`` (itself when none is there)."""
        if not keys:
            return self
        return Window(
            tuple(p for p in self.settled if key_of(p) not in keys),
            tuple(p for p in self.pending if key_of(p.position) not in keys),
        )


_WINDOW_KEYS = frozenset({"settled", "pending", "bound"})


def _bound_from_json(raw: Any) -> Bound | None:
    """The stored bound (None when absent or not two positive whole numbers: it is
    a report for ``dbtrigger status``, never a reason to refuse the document)."""
    if not isinstance(raw, Mapping):
        return None
    events, size = raw.get("max_events"), raw.get("max_bytes")
    if not (_positive(events) and _positive(size)):
        return None
    return Bound(events, size)  # type: ignore[arg-type]  # checked by _positive


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pending_json(p: Pending) -> dict[str, Any]:
    out: dict[str, Any] = {
        "at": position_to_json(p.position),
        "attempts": p.attempts,
        "not_before": format_time(p.not_before),
        "reason": p.reason,
    }
    if p.owed is not None:
        out["owed"] = dict(sorted(p.owed.items()))
    return out


def _owed_from_json(raw: Any) -> dict[str, int] | None:
    """``window.pending[].owed``: subscriber name -> attempts (optional)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in raw.items()
    ):
        raise CorruptStateError(
            "window.pending[].owed must map subscriber names to attempt counts (ints >= 0)"
        )
    return dict(raw)


def gone(window: Window, fetched: Sequence[Position], *, complete: bool) -> set[str]:
    """Keys of the entries the read ``fetched`` (every row after the checkpoint,
    in source order, up to its limit) proves gone: not returned although the
    read went past their tuple - or returned every row (``complete``)."""
    if not window:
        return set()
    seen = {key_of(p) for p in fetched}
    entries = [*window.settled, *(p.position for p in window.pending)]
    if complete:
        return {k for k in (key_of(p) for p in entries) if k not in seen}
    if not fetched:
        return set()
    last = fetched[-1]
    columns = tuple(last.pk)
    out = set()
    for position in entries:
        k = key_of(position)
        if k not in seen and precedes(position, last, columns) is True:
            out.add(k)
    return out


@dataclass(frozen=True)
class Bound:
    """How much the window may hold: events and encoded bytes."""

    max_events: int = 1000
    max_bytes: int = 48 * 1024

    def under_pressure(self, window: Window, size: int | None = None) -> bool:
        """At or above 75% of either bound: hand out no rows beyond the window."""
        size = window.encoded_size() if size is None else size
        return len(window) >= PRESSURE * self.max_events or size >= PRESSURE * self.max_bytes


@dataclass(frozen=True)
class Plan:
    """Which of the fetched rows to hand out (indexes, in source order)."""

    deliver: tuple[int, ...]
    pressure: bool = False
    withheld: int = 0
    """Rows of the read, neither settled nor waiting, that the window's bound
    kept back although the batch had room."""
    full: bool = False
    """The window had no room left for another event (not just the 75% mark)."""
    new: int = 0
    """Rows handed out that were not waiting for a retry."""
    held: int = 0
    """Rows kept back behind an earlier event of their row key that waits."""
    skipped: int = 0
    """Due retries left for a later batch: the room was kept for new rows."""

    @property
    def blocked(self) -> bool:
        """Rows wait, and the window lets not one new row out: progress stops
        until its pinned events settle (a smaller batch is not a stop)."""
        return (self.withheld > 0 or self.held > 0) and self.new == 0


def plan(
    keys: Sequence[str],
    sizes: Sequence[int],
    window: Window,
    *,
    now: dt.datetime,
    batch_size: int,
    bound: Bound,
    groups: Sequence[str | Sequence[str]] | None = None,
    hold: Set[str] = frozenset(),
    reserve: bool = False,
) -> Plan:
    """Choose the rows of one batch among the rows fetched after the checkpoint.

    Settled tuples are skipped; pending ones only once their backoff is over
    and unless in ``hold`` (fan-out: nobody can take them now);
    any other row (new, or committed late inside the window) is handed out -
    except, under pressure, rows beyond the window's newest entry, and while
    the window is in use, rows it could not remember (``sizes`` are their
    :func:`entry_size`; a pending entry's overhead is reserved for each).
    Rows kept back that way are counted (:attr:`Plan.withheld`); due retries
    after them are still handed out (they need no new room).

    **Per-key order.** ``groups`` are the rows' :func:`row_key` (or several: an
    update that moved its row to another key orders against both). A row that
    is not settled and not handed out - a retry not yet due, a row the bound
    keeps back - holds back every later row of its key in the read
    (:attr:`Plan.held`): one key's events are handed out in source order, and
    never one after an earlier one of its key that is still waiting. This
    needs no guess about rows the read did not return: a later row of a key
    is only in the read if every earlier row of the source is too (a read is
    a prefix), so an earlier event that is not in it is gone.

    ``reserve``: reserve room for every new row even when the window is empty
    (after a batch whose retries did not all fit, :attr:`Settlement.unremembered`):
    no more rows go out than the window can hold as waiting.

    **Due retries take at most half the batch while new rows wait** (the rest when fewer
    can go): due at every read (``retry_delay_seconds=0``), they filled every batch.
    """
    if not window and not reserve:
        return Plan(tuple(range(min(batch_size, len(keys)))))
    args = (keys, sizes, window, now, batch_size, bound, groups, hold)
    first = _pick(*args, None)
    if first.skipped and len(first.deliver) < batch_size:  # room the new rows left: retries
        return _pick(*args, batch_size - first.new)
    return first


def _group(groups: Sequence[str | Sequence[str]], i: int) -> Sequence[str]:
    g = groups[i]
    return (g,) if isinstance(g, str) else g


def _pick(
    keys: Sequence[str],
    sizes: Sequence[int],
    window: Window,
    now: dt.datetime,
    batch_size: int,
    bound: Bound,
    groups: Sequence[str | Sequence[str]] | None,
    hold: Set[str],
    retry_room: int | None,
) -> Plan:
    """:func:`plan`, due retries handed out up to ``retry_room`` of the batch."""
    settled = {key_of(p) for p in window.settled}
    pending = {key_of(p.position): p for p in window.pending}
    span_end = max((i for i, k in enumerate(keys) if k in settled or k in pending), default=-1)
    size = window.encoded_size()
    pressure = bound.under_pressure(window, size)
    if retry_room is None:  # all but the room for the new rows, up to half the batch
        fresh = sum(
            k not in settled and k not in pending
            for k in keys[: span_end + 1 if pressure else None]
        )
        retry_room = batch_size - min(batch_size // 2, fresh)
    room_events = bound.max_events - len(window)
    room_bytes = bound.max_bytes - size
    chosen: list[int] = []
    new_rows = True  # may a row that needs new room still be handed out?
    full = False
    withheld = new = held = skipped = 0
    blocked: set[str] = set()  # row keys with an earlier row that waits

    def wait(i: int) -> None:
        if groups is not None:
            blocked.update(_group(groups, i))

    for i, key in enumerate(keys):
        if len(chosen) >= batch_size:
            break
        if key in settled:
            continue
        if groups is not None and any(k in blocked for k in _group(groups, i)):
            held += 1
            continue
        waiting = pending.get(key)
        if waiting is not None:
            due = waiting.not_before <= now and key not in hold
            if due and len(chosen) - new < retry_room:
                chosen.append(i)  # its entry exists already: no new room needed
            else:
                skipped += due
                wait(i)
            continue
        if new_rows and pressure and i > span_end:
            new_rows = False
        cost = sizes[i] + PENDING_OVERHEAD
        if new_rows and (room_events < 1 or cost > room_bytes):
            new_rows, full = False, True
        if not new_rows:
            withheld += 1
            wait(i)
            continue
        room_events -= 1
        room_bytes -= cost
        chosen.append(i)
        new += 1
    if pressure:  # rows after the window, the batch's end kept from the loop: withheld too
        withheld = max(withheld, len(keys) - 1 - span_end)
    return Plan(tuple(chosen), pressure, withheld, full, new, held, skipped)


@dataclass(frozen=True)
class Settlement:
    """The result of :func:`settle`."""

    checkpoint: Position | None
    """Where the checkpoint moves (None: it stays)."""
    window: Window
    overflow: int = 0
    """Settled entries that did not fit the bound: those events come again."""
    walked: int = 0
    """Fetched rows the checkpoint moved over."""
    passed: frozenset[str] = frozenset()
    """Their keys."""
    unremembered: int = 0
    """Events this batch asked to retry that did not fit the bound: not
    remembered as waiting, so they come again at once, without a backoff, and
    that delivery does not count as an attempt. The tick then hands out no more
    rows than the window can hold as waiting, until a batch retries nothing."""


def settle(
    fetched: Sequence[Position],
    *,
    complete: bool,
    window: Window,
    settled: Set[str],
    retried: Mapping[str, Pending],
    bound: Bound,
) -> Settlement:
    """Fold one batch's outcomes into the window and move the checkpoint.

    Args:
        fetched: every row read after the checkpoint, in source order (a
            prefix of the source: the checkpoint walks it).
        complete: the read returned every row after the checkpoint (fewer
            than it asked for), so a window entry not among ``fetched`` is a
            row that is gone.
        window: the window before the batch.
        settled: keys settled by this batch (accepted, or dead-lettered).
        retried: keys this batch asked to retry, with their new pending entry.
        bound: the window's bound.
    """
    settled_keys = {key_of(p) for p in window.settled} | set(settled)
    pending = {key_of(p.position): p for p in window.pending if key_of(p.position) not in settled}
    pending.update(retried)
    for k in retried:
        settled_keys.discard(k)

    keys = [key_of(p) for p in fetched]
    walked = 0
    checkpoint: Position | None = None
    for position, k in zip(fetched, keys, strict=True):
        if k not in settled_keys:
            break
        checkpoint = position
        walked += 1
    passed = set(keys[:walked])
    seen = set(keys)

    def keep(k: str) -> bool:
        return k not in passed and (k in seen or not complete)

    by_key = {key_of(p): p for p in window.settled}
    by_key.update({k: p for p, k in zip(fetched, keys, strict=True) if k in settled_keys})
    order = {k: i for i, k in enumerate(keys)}
    before = {key_of(p): i for i, p in enumerate(window.settled)}
    # Source order, then (entries the read did not return) their order in the
    # window: the same outcome always encodes the same bytes, so a tick that
    # changes nothing writes nothing.
    new_settled = sorted(
        (k for k in settled_keys if keep(k) and k in by_key),
        key=lambda k: (order.get(k, len(order)), before.get(k, -1)),
    )
    new_pending = tuple(
        sorted(
            (p for k, p in pending.items() if keep(k)),
            key=lambda p: order.get(key_of(p.position), len(order)),
        )
    )
    kept = [by_key[k] for k in new_settled]
    out = Window(tuple(kept), new_pending)
    overflow = unremembered = 0
    size = out.encoded_size()

    def over() -> bool:
        return len(kept) + len(waiting) > bound.max_events or size > bound.max_bytes

    waiting = list(new_pending)
    while kept and over():
        size -= entry_size(kept.pop())
        overflow += 1
    # Still over: the entries this batch added for retries, newest first. An
    # entry that existed before stays (its attempts count), so the bound holds
    # whatever the batch size (a batch of 3,000 retried events made a 590 KB
    # document, which the Table store refused on every commit).
    fresh = set(retried) - {key_of(p.position) for p in window.pending}
    for entry in reversed(new_pending):
        if not over():
            break
        if key_of(entry.position) in fresh:
            waiting.remove(entry)
            size -= pending_size(entry)
            unremembered += 1
    if overflow or unremembered:
        out = Window(tuple(kept), tuple(waiting))
    return Settlement(checkpoint, out, overflow, walked, frozenset(passed), unremembered)


def held_entry(
    position: Position,
    previous: Pending | None,
    subscribers: Collection[str],
    *,
    now: dt.datetime,
) -> Pending:
    """Fan-out: an event that waits behind an earlier event of its row key that
    ``subscribers`` still owe, which every subscriber it was handed accepted.
    It is owed again to those subscribers only - each with the count it had
    (being held back is not an attempt); the others accepted it and never see
    it again, even one that owed it before (it had failed it in an earlier
    batch: kept as owing, it was handed the event again, a duplicate)."""
    counts = dict(previous.owed or {}) if previous is not None else {}
    owed = {name: counts.get(name, 0) for name in subscribers}
    return Pending(
        position=position,
        attempts=previous.attempts if previous is not None else 0,
        not_before=previous.not_before if previous is not None else now,
        reason=previous.reason if previous is not None else HELD_REASON,
        owed=owed,
    )


#: The reason a held-back event carries in the window (fan-out).
HELD_REASON = "waits for an earlier event of its key"


def retry_entry(
    position: Position,
    previous: Pending | None,
    *,
    reason: str,
    now: dt.datetime,
    base: float,
    cap: float,
    jitter: float,
    owed: Mapping[str, int] | None = None,
    counted: bool = True,
    delay: float | None = None,
) -> Pending:
    """The pending entry for an event the handler asked to retry (``owed``:
    with fan-out, the subscribers it is delivered to again; ``delay``: the
    handler's ``delay_seconds``, instead of the backoff). Not ``counted``:
    nobody received it (its fan-out subscribers were busy), so neither an
    attempt nor a backoff; it is due at once (held back while they are busy)."""
    attempts = (previous.attempts if previous is not None else 0) + (1 if counted else 0)
    if not counted:
        delay = 0.0
    elif delay is None:
        delay = backoff_seconds(attempts, base=base, cap=cap, jitter=jitter)
    return Pending(
        position=position,
        attempts=attempts,
        not_before=now + dt.timedelta(seconds=delay),
        reason=redact(reason[: 4 * MAX_REASON])[:MAX_REASON],  # no secret in the document
        owed=None if owed is None else dict(owed),
    )
