"""Finding the row that kills the process, one row at a time, with a dead-letter sink.

Bisection (:mod:`dbtrigger.isolation`) finds rows that *fail* alone; a row
that ends the process never fails, it takes the bisection down with it. Once
a batch killed its process on the last of ``max_attempts`` attempts
(:func:`dbtrigger.state.crashes.after_deaths` says ``ISOLATE``), the tick
hands it over through :class:`OneByOne` instead of the handler: each row
alone, its event id written to the state document's failure record
(``probing``, with the rows that passed so far as done) *before* its call.
If the process dies during a call, the next owner's takeover counts the
death and finds the row named there: that row is not handed over again but
named as failed (``ProcessDied``), as a row that raised alone is, in one
:class:`~dbtrigger.errors.PartialBatchError`, so the ordinary verdict writes
it to the dead-letter sink and the checkpoint passes the batch. One death per
such row, one store write per row of the batch: a rare path, kept simple.

Every row found so stays named (``killed``, added by the takeover that counted
its death), so a batch holding several such rows costs one death each.
With lanes (``max_concurrency > 1``) the rows go one after another on the
tick's thread (:attr:`OneByOne.alone`). With fan-out each row goes to each
subscriber alone, under the key :func:`probe_key` of (subscriber, row), so a
death names the subscriber too: only it gives the row up
(:meth:`dbtrigger.runtime.subscribers.FanOut.deliver` runs those steps).
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

from dbtrigger.errors import LostLeaseError, PartialBatchError
from dbtrigger.events import RowChange
from dbtrigger.runtime.async_calls import run_awaitable
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.state import lease as leasemod
from dbtrigger.state.document import FailureRecord


class ProcessDied(Exception):
    """The row's delivery ended its process (what its dead letter says)."""


def probe_key(event_id: str, subscriber: str | None = None) -> str:
    """What a step writes as ``probing`` for a row handed alone: its event id, or
    (fan-out) its subscriber's name with it."""
    return event_id if subscriber is None else json.dumps([subscriber, event_id])


class OneByOne:
    """A handler that hands ``handler`` each row alone, recording each step first."""

    #: Never split over lanes: one row at a time, on the tick's thread.
    alone = True

    def __init__(
        self,
        handler: Handler,
        wants_ctx: bool,
        *,
        session: LeaseSession,
        failure: FailureRecord,
        clock: Callable[[], dt.datetime],
        ttl: dt.timedelta,
        stopped: Callable[[BatchContext], Exception],
        emit: Callable[..., None],
    ) -> None:
        self.handler, self.wants_ctx = handler, wants_ctx
        self.session, self.failure = session, failure
        self.clock, self.ttl, self.stopped, self.emit = clock, ttl, stopped, emit

    def _call(self, event: RowChange, ctx: BatchContext) -> None:
        result = self.handler([event], ctx) if self.wants_ctx else self.handler([event])
        if inspect.isawaitable(result):
            run_awaitable(result, ctx, self.stopped)

    def killed(self, key: str) -> bool:
        """Did the row (``probe_key``) kill the process when handed alone before?"""
        return key in self.failure.killed or key == self.failure.probing

    def say_killed(
        self, event: RowChange, ctx: BatchContext, subscriber: str | None = None
    ) -> None:
        """``crash_isolated`` at WARNING: the row is dead-lettered, not handed again."""
        self.emit(
            "crash_isolated",
            "row %r (cursor %r) killed the process delivering it alone%s: it is not "
            "handed over again but dead-lettered%s",
            dict(event.pk),
            event.cursor,
            "" if subscriber is None else f" to subscriber {subscriber!r}",
            "" if subscriber is None else " for that subscriber",
            batch_id=ctx.batch_id,
            event_id=event.event_id,
            **({} if subscriber is None else {"subscriber": subscriber}),
        )

    def step(self, event_id: str | None, done: list[str]) -> None:
        """Write (under the lease, renewing it) which row is handed alone next."""
        self.session.update(
            functools.partial(
                leasemod.decide_probe,
                owner=self.session.owner,
                token=self.session.token,
                now=self.clock(),
                ttl=self.ttl,
                event_id=event_id,
                done=tuple(done),
            ),
            what="isolation step",
        )

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        done = list(self.failure.done)
        failed: list[dict[str, Any]] = []
        causes: dict[int, BaseException] = {}
        last_passed = False
        for event in events:
            if self.killed(event.event_id):
                causes[len(failed)] = ProcessDied(self.failure.last_error)
                failed.append(dict(event.pk))
                self.say_killed(event, ctx)
                continue
            self.step(event.event_id, done)
            try:
                self._call(event, ctx)
            except LostLeaseError:
                raise
            except Exception as exc:  # it fails alone: poison, as bisection finds it
                if ctx.lease_lost.is_set():
                    raise
                causes[len(failed)] = exc
                failed.append(dict(event.pk))
                last_passed = False
                continue
            done.append(event.event_id)
            last_passed = True
        if last_passed:  # (a death before the commit must not name a row that passed)
            self.step(None, done)
        if failed:
            raise PartialBatchError(failed, f"{len(failed)} row(s) failed alone", causes=causes)


__all__ = ["OneByOne", "ProcessDied", "probe_key"]
