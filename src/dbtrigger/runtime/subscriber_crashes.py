"""Fan-out's rows handed alone after a batch killed its process: who died on what.

A batch whose delivery killed its process on the last of ``max_attempts``
attempts is, with a dead-letter sink, handed over one row at a time
(:mod:`dbtrigger.runtime.crash_isolation`). With subscribers the process's
death says nothing about *which* subscriber killed it (they all run in it), so
each row goes to each subscriber alone, in batch order and then by name, with
``(subscriber, row)`` written to the state document first
(:func:`~dbtrigger.runtime.crash_isolation.probe_key`). A death then names the
subscriber as well as the row, and the next owner:

* does not hand that row to that subscriber again: it has *given it up*, as a
  subscriber that used up its ``max_attempts`` does
  (:func:`dbtrigger.state.fanout.decide`), so the row is dead-lettered
  (``ProcessDied``) in its name once no other subscriber still owes it;
* skips the (subscriber, row) calls that returned clean before the death
  (written as done), so the others get each row once in this phase, and
  settle it by their own outcome: accepted, rejected, or retried later for
  them alone.

A subscriber's call on a row alone runs as any of its calls does (its own
thread, ``ack_timeout_seconds``, ``ctx.reject`` / ``ctx.retry``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Protocol, TypeVar

from dbtrigger.events import RowChange
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.crash_isolation import OneByOne, probe_key
from dbtrigger.runtime.subscriber_options import Wrap
from dbtrigger.state import fanout
from dbtrigger.state.fanout import Resolution


class _Call(Protocol):
    @property
    def clean(self) -> bool: ...


_C = TypeVar("_C", bound=_Call)


class _Subscribers(Protocol[_C]):
    """What of :class:`~dbtrigger.runtime.subscribers.FanOut` (the module above
    this one, which calls it) a row handed alone needs: its calls, run as any."""

    @property
    def max_attempts(self) -> int: ...

    def _run(
        self,
        wrap: Wrap | None,
        parts: Mapping[str, list[RowChange]],
        handed: Mapping[str, Mapping[str, int]],
        ctx: BatchContext,
    ) -> list[_C]: ...

    def _check(self, calls: list[_C], ctx: BatchContext) -> None: ...

    def _results(self, calls: list[_C], ctx: BatchContext) -> dict[str, dict[str, Resolution]]: ...


def deliver_alone(
    fan: _Subscribers[_C],
    one: OneByOne,
    wrap: Wrap | None,
    parts: Mapping[str, list[RowChange]],
    handed: MutableMapping[str, dict[str, int]],
    pending: list[RowChange],
    ctx: BatchContext,
) -> tuple[dict[str, dict[str, Resolution]], frozenset[str]]:
    """Each subscriber's resolution of each row of its part, every call on one row;
    and the ids of the rows some subscriber killed the process on. ``handed`` is
    updated: a subscriber that did so has used up its attempts on the row."""
    results: dict[str, dict[str, Resolution]] = {name: {} for name in parts}
    owed = {name: {e.event_id for e in part} for name, part in parts.items()}
    died: set[str] = set()
    done = list(one.failure.done)
    stepped = False
    for event in pending:
        i = event.event_id
        for name in sorted(parts):
            if i not in owed[name]:
                continue
            key = probe_key(i, name)
            if key in done:  # it returned clean on this row before the death
                results[name][i] = fanout.ACCEPT
                continue
            if one.killed(key):
                one.say_killed(event, ctx, name)
                handed[i][name] = max(handed[i][name], fan.max_attempts - 1)
                results[name][i] = fanout.fail(
                    "killed its process when handed this row alone: " + one.failure.last_error
                )
                died.add(i)
                continue
            one.step(key, done)
            stepped = True
            calls = fan._run(wrap, {name: [event]}, handed, ctx)
            fan._check(calls, ctx)
            results[name].update(fan._results(calls, ctx)[name])
            if all(call.clean for call in calls):
                done.append(key)
    if stepped:  # (a death before the commit must not name a call that returned)
        one.step(None, done)
    return results, frozenset(died)


__all__ = ["deliver_alone"]
