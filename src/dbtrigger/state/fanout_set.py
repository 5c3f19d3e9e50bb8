"""Which subscribers a fan-out poller last ran with, as its state document says.

A subscriber added to ``subscribers=`` between two runs is handed the events
after the checkpoint only (the fan-out set is frozen when an event is handed
out, :mod:`dbtrigger.state.fanout`): the rows before it were delivered to the
others, never to it. That is the contract, but it must not happen silently -
an operator adding a consumer to a poller whose checkpoint is far ahead would
otherwise find its backlog missing with nothing said. So each lease taken by a
fan-out poller records its subscribers' names in the document (top-level
``"subscribers"``: a sorted list of strings), and the next run compares them
with its own (:func:`change`): who joined (and starts at the checkpoint), who
left (owed events of its are dead-lettered or hold the checkpoint), both at
once (perhaps a rename, which to dbtrigger is one of each).

The field rides in :attr:`StateDocument.extra`, the top-level fields the
document codec keeps as they are: a dbtrigger that does not know it writes
it back unchanged, a single-handler poller leaves it (its run does not
change what the last fan-out ran with), and it is replaced, never appended
to, so a removed subscriber leaves nothing behind in it.

A subscriber declared with its former name
(:func:`dbtrigger.runtime.subscriber_options.renamed`) is a rename, not a
leave and a join: :func:`renaming` moves what the document owes the old name
(its waiting events' ``owed`` entries, with their counts) and its place in
the recorded set to the new name, before anything else reads the document.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from dbtrigger.errors import CorruptStateError

if TYPE_CHECKING:
    from dbtrigger.state.document import StateDocument

#: The top-level state document field holding the last fan-out set.
FIELD = "subscribers"


def recorded(doc: StateDocument | None) -> tuple[str, ...] | None:
    """The subscribers the document's last fan-out lease ran with (None: none
    recorded - a new poller, a single handler's, or a dbtrigger before this).

    Raises:
        CorruptStateError: the field is not a list of names.
    """
    if doc is None:
        return None
    raw = doc.extra.get(FIELD)
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(name, str) for name in raw):
        raise CorruptStateError(f"{FIELD} must be a list of subscriber names, got {raw!r}")
    return tuple(raw)


def recording(doc: StateDocument, names: Collection[str] | None) -> StateDocument:
    """``doc`` recording ``names`` as its fan-out set (``doc`` itself when it
    does already, or for ``names`` None: a single handler records nothing)."""
    if names is None:
        return doc
    wanted = sorted(names)
    if doc.extra.get(FIELD) == wanted:
        return doc
    return replace(doc, extra={**doc.extra, FIELD: wanted})


def change(
    before: Collection[str] | None, now: Collection[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(joined, left)``: the subscribers of ``now`` that ``before`` did not
    have, and those it had that ``now`` does not. Nothing when ``before`` is
    None (no set recorded: nothing to compare with)."""
    if before is None:
        return (), ()
    return (
        tuple(sorted(set(now) - set(before))),
        tuple(sorted(set(before) - set(now))),
    )


def renaming(
    doc: StateDocument | None, renames: Mapping[str, str]
) -> tuple[StateDocument | None, dict[str, int]]:
    """``doc`` with each former name of ``renames`` (old -> new) replaced by the
    new one - in the recorded set and in every waiting event's ``owed`` (the
    counts kept; an event owed to both keeps the larger) - and, per former
    name, how many waiting events moved. ``doc`` itself when nothing changes.
    Pure: the tick commits the result with its first write.
    """
    if doc is None or not renames:
        return doc, {}
    moved: dict[str, int] = {}
    window = doc.window
    if window is not None and any(set(p.owed or ()) & renames.keys() for p in window.pending):
        pending = []
        for entry in window.pending:
            if entry.owed is None or not set(entry.owed) & renames.keys():
                pending.append(entry)
                continue
            owed: dict[str, int] = {}
            for name, count in entry.owed.items():
                new = renames.get(name, name)
                if new != name:
                    moved[name] = moved.get(name, 0) + 1
                owed[new] = max(count, owed.get(new, count))
            pending.append(replace(entry, owed=owed))
        window = replace(window, pending=tuple(pending))
    before = recorded(doc)
    extra = doc.extra
    if before is not None and set(before) & renames.keys():
        extra = {**extra, FIELD: sorted({renames.get(name, name) for name in before})}
    if window is doc.window and extra is doc.extra:
        return doc, moved
    return replace(doc, window=window, extra=extra), moved


__all__ = ["FIELD", "change", "recorded", "recording", "renaming"]
