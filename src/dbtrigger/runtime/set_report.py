"""Subscribers that joined or left a fan-out poller since its last run, said once.

The fan-out set is frozen when an event is handed out, so a subscriber added
between two runs starts with the events after the checkpoint: everything
before it went to the others only. That is the contract
(:mod:`dbtrigger.state.fanout`), but done silently it looks like lost rows to
whoever added a consumer to a poller far ahead. The state document records
the set each lease ran with (:mod:`dbtrigger.state.fanout_set`); on its first
tick that sees a different one, the poller says what it means and what to do:

* ``subscriber_joined`` (WARNING) - who joined, from which checkpoint, and the
  ``dbtrigger backfill`` that hands it the earlier rows under a poller name of
  its own (the live checkpoint is not touched);
* ``subscriber_left`` (INFO) - who left: it is handed nothing more; events
  it still owed are dead-lettered with a sink, or hold the checkpoint
  (``checkpoint_held`` says so);
* both at once may be a rename, which to dbtrigger is one subscriber leaving
  and another joining: both say so at WARNING, with the way to declare it
  (``renamed(handler, formerly=OLD)``);
* ``subscriber_renamed`` (INFO) - a rename declared that way: what the old
  name owed moved to the new one (:meth:`SetReport.renaming`, before the
  lease is taken, so the tick's first commit stores it).

A partition of a :class:`~dbtrigger.partitions.PartitionedPoller` (its source
a ``PartitionSource``) has a document of its own, but the change is the
group's: said once a process for the group, with one backfill for all of it.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field

from dbtrigger._paste import pasteable
from dbtrigger.names import import_path_of
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.subscriber_options import Renamed, renames_of
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state import fanout_set
from dbtrigger.state.document import StateDocument

#: (group, its source's id, recorded, configured) said in this process, for partitions.
_GROUPS_SAID: set[tuple[str, int, tuple[str, ...] | None, tuple[str, ...]]] = set()


@dataclass(eq=False, repr=False)
class SetReport:
    """Says once per change how a fan-out poller's subscribers differ from the
    set its state document recorded; see the module docstring."""

    telemetry: Telemetry
    _: KW_ONLY
    poller: str
    subscribers: Mapping[str, Handler]
    cli_target: Callable[[], str]
    source: object = None
    #: The last (recorded, configured) pair looked at: said once.
    _seen: tuple[tuple[str, ...] | None, tuple[str, ...]] | None = field(default=None, init=False)
    #: The renames said (old, new, events moved): said once each.
    _renamed: set[tuple[str, str, int]] = field(default_factory=set, init=False)

    def renaming(self, doc: StateDocument | None) -> StateDocument | None:
        """``doc`` with the subscribers declared ``renamed(..., formerly=)`` under
        their new names (:func:`~dbtrigger.state.fanout_set.renaming`); said once."""
        renames = renames_of(self.subscribers)
        before = fanout_set.recorded(doc)
        out, moved = fanout_set.renaming(doc, renames)
        for old, new in renames.items():
            if old not in moved and old not in (before or ()):
                continue
            key = (old, new, moved.get(old, 0))
            if key in self._renamed:
                continue
            self._renamed.add(key)
            self.telemetry.emit(
                "subscriber_renamed",
                "poller %s: subscriber %s is now %s (renamed(formerly=%r)): the %d waiting "
                "event(s) %s owed are owed to %s, with their attempts; nothing to backfill",
                self.poller,
                old,
                new,
                old,
                moved.get(old, 0),
                old,
                new,
                subscriber=new,
                formerly=old,
                events=moved.get(old, 0),
            )
        return out

    def __call__(self, doc: StateDocument | None) -> None:
        now = tuple(sorted(self.subscribers))
        before = fanout_set.recorded(doc)
        if (before, now) == self._seen:
            return
        self._seen = (before, now)
        joined, left = fanout_set.change(before, now)
        group = self._group()
        if group is not None and (joined or left):
            key = (group, id(getattr(self.source, "base", None)), before, now)
            if key in _GROUPS_SAID:
                return  # another partition of the group said it
            _GROUPS_SAID.add(key)
        poller = group or self.poller
        renamed = (
            "; if this is a rename: to dbtrigger a rename is one subscriber leaving and "
            "another joining, and the new name is not handed what the old one owed "
            "unless the rename is declared: subscribers={'NEW': "
            "dbtrigger.renamed(handler, formerly='OLD')} takes over what OLD still owes "
            "(with a sink, what OLD owed is dead-lettered in its name when next due: with "
            "the rename declared, dbtrigger dead-letter replay --subscriber NEW hands it "
            "to NEW)"
            if joined and left
            else ""
        )
        position = doc.checkpoint.position if doc is not None and doc.checkpoint else None
        waiting = len(doc.window.pending) if doc is not None and doc.window is not None else 0
        if joined and (position is not None or waiting):
            cursor = str(position.cursor) if position is not None else "none yet"
            earlier = (
                f"the rows up to the checkpoint (cursor {cursor}) and the {waiting} event(s) "
                "already handed out and waiting for a retry"
                if group is None
                else "the rows up to each partition's checkpoint and the events already "
                "handed out and waiting for a retry"
            )
            commands = [self._backfill(poller, name) for name in joined]
            self.telemetry.emit(
                "subscriber_joined",
                "poller %s: subscriber(s) %s joined (the poller last ran with %s): handed "
                "the events read from now on only; %s went to the others and are not "
                "delivered to them%s. To hand them the earlier rows, backfill them under a "
                "poller name of their own (the live checkpoint is not touched; the rows "
                "after it then come twice: be idempotent): %s",
                poller,
                ", ".join(joined),
                ", ".join(before or ()) or "no subscriber",
                earlier,
                renamed,
                " ; ".join(commands),
                subscribers=list(joined),
                commands=commands,
                left=list(left),
                cursor=cursor,
                waiting=waiting,
            )
        if left:
            self.telemetry.emit(
                "subscriber_left_joined" if joined else "subscriber_left",
                "poller %s: subscriber(s) %s left (the poller last ran with %s): nothing more is "
                "handed to them; events they still owe are dead-lettered with a sink, "
                "otherwise they hold the checkpoint (checkpoint_held)%s",
                poller,
                ", ".join(left),
                ", ".join(before or ()),
                renamed,
                subscribers=list(left),
                joined=list(joined),
            )

    def _group(self) -> str | None:
        """The PartitionedPoller group this poller is a partition of, or None (not
        imported: nothing can be one; importing it would load SQLAlchemy)."""
        module = sys.modules.get("dbtrigger.partitions.source")
        if module is None or not isinstance(self.source, module.PartitionSource):
            return None
        return str(self.source.poller)

    def _backfill(self, poller: str, name: str) -> str:
        """The ``dbtrigger backfill`` of every row so far to subscriber ``name``."""
        target = self.cli_target()
        trigger = target.split("--source ", 1)[1] if "--source " in target else "MODULE:ATTR"
        fn = self.subscribers[name]
        fn = fn.handler if isinstance(fn, Renamed) else fn
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        handler = import_path_of(fn) or (
            f"{module}:{qualname}" if module and qualname and "<" not in qualname else None
        )
        handler = handler or "MODULE:FUNCTION"
        reason = shlex.quote(f"new subscriber {name}")
        return pasteable(
            f"dbtrigger backfill {shlex.quote(f'{poller}-{name}-backfill')} "
            f"--trigger {trigger} --from-beginning --handler {handler} "
            f"--reason {reason} --yes"
        )
