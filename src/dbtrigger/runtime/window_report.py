"""Saying when the settled window blocks progress - once per change, not every tick.

A window that keeps rows back while not one new row goes out (at its 75% mark
or full, see :mod:`dbtrigger.state.window`) is correct back-pressure, but it
stops the poller until the pinned events settle, and an operator must be able
to see that without reading state documents: ``window_blocked`` at WARNING
names how many rows wait, how full the window is and the oldest pinned event
(its key and cursor, attempts, due time and reason) - or, when what waits
is later events of keys whose earlier event waits for a retry (per-key
order), says that instead - ``window_unblocked`` at
INFO says when rows flow again, and the ``window_withheld_rows`` gauge follows
every read. A poller that stays blocked for hours logs one line, not one per
tick; a new oldest pinned event, or a change from "at pressure" to "full", is
a new state and is said again. Rows held that way are read past, up to
``window_max_events`` of them (:func:`dbtrigger.runtime.windowing.widening`);
more than that stop every key ("crowded"), and the warning says how to get out.
"""

from __future__ import annotations

from typing import Any

from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.runtime.windowing import WindowView
from dbtrigger.state import document as docmod
from dbtrigger.state.window import Bound, key_of


class WindowReport:
    """Remembers what the window last blocked on, for one poller."""

    def __init__(
        self, name: str, bound: Bound, telemetry: Telemetry, *, has_sink: bool = True
    ) -> None:
        self.name = name
        self.bound = bound
        #: A dead-letter sink takes an event that used up max_attempts; without
        #: one such an event pins the checkpoint until someone acts.
        self.has_sink = has_sink
        self.emit = telemetry.emit
        #: (what blocks: "pressure" or "full", key of the oldest pinned event); None: flowing.
        self.state: tuple[str, str | None] | None = None
        self.withheld = 0

    def report(self, view: WindowView) -> None:
        """Report what the window did to one read."""
        if view.dropped:
            self.emit(
                "window_entries_gone",
                "dropped %d settled-window entr%s whose rows are gone (deleted, or updated "
                "to a new cursor)",
                view.dropped,
                "y" if view.dropped == 1 else "ies",
                values={"count": view.dropped},
            )
        if view.withheld != self.withheld:  # the common case, 0 again, costs nothing
            self.withheld = view.withheld
            self.emit("window_withheld", values={"rows": view.withheld})
        window = view.window
        oldest = window.pending[0] if window.pending else None
        state = None
        if view.blocked:
            state = (
                "full"
                if view.full
                else ("pressure" if view.withheld else ("crowded" if view.crowded else "held")),
                None if oldest is None else key_of(oldest.position),
            )
        if state == self.state:
            return
        self.state = state
        if state is None:
            self.emit("window_unblocked", "the settled window no longer blocks progress")
            return
        why = {
            "full": "the window has no room for another event",
            "pressure": "the window is at 75%% of its bound (only due retries and late rows "
            "go out)",
            "held": "each waits behind an earlier event of its key that waits for a retry "
            "(per-key order)",
            "crowded": "each waits behind an earlier event of its key that waits for a retry "
            "(per-key order), and there are more of them than the read goes past "
            f"(window_max_events={self.bound.max_events}), so rows of other keys after them "
            "are not read either: let the pinned events settle, or raise window_max_events",
        }[state[0]]
        pinned = "no event is waiting for a retry"
        fields: dict[str, Any] = {}
        moves = "(or are dead-lettered after max_attempts)"
        if not self.has_sink:
            moves = (
                "(no dead-letter sink is configured, so an event that fails max_attempts "
                "times is never set aside: fix what fails it, or pass quarantine= to "
                "dead-letter it)"
            )
        if oldest is not None:
            owing = sorted(oldest.owed or ())
            pinned = (
                f"the checkpoint is pinned by {len(window.pending)} event(s) waiting for a "
                f"retry, the oldest {dict(oldest.position.pk)} at cursor "
                f"{oldest.position.cursor} ({oldest.attempts} attempt(s), due "
                f"{docmod.format_time(oldest.not_before)}, reason {oldest.reason!r}"
                + (f", owed to subscriber(s) {', '.join(owing)}" if owing else "")
                + ")"
            )
            fields = {
                "pinned_key": dict(oldest.position.pk),
                "pinned_cursor": docmod.position_to_json(oldest.position),
                "attempts": oldest.attempts,
                "due": docmod.format_time(oldest.not_before),
                "reason": oldest.reason,
            }
            if owing:
                fields["subscribers"] = owing
        self.emit(
            "window_blocked",
            "the settled window blocks progress: %d row(s) after the checkpoint wait and "
            "none goes out: " + why + " (window %d/%d events, %d/%d bytes); %s. It moves on as "
            "the pinned events settle " + moves + "; see `dbtrigger status %s`",
            view.withheld + view.held,
            len(window),
            self.bound.max_events,
            window.encoded_size(),
            self.bound.max_bytes,
            pinned,
            self.name,
            window_events=len(window),
            withheld=view.withheld,
            held=view.held,
            blocked_by=state[0],
            **fields,
        )
