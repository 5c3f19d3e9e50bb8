"""``PartitionedPoller``: one member of a group that splits a table's partitions.

Each process (worker, Function instance) that runs the same partitioned poller
is a member. From a background thread, a member rewrites the membership
document (:mod:`dbtrigger.partitions.layout`) by compare-and-swap: its
heartbeat, and the partitions it claims, steals or releases to reach its fair
share. The cycles are fast while anything is moving and slow once the group
has settled (:mod:`dbtrigger.partitions.cadence`). Between cycles it ticks the
partitions it owns, each an ordinary :class:`~dbtrigger.PollTrigger` with its
own state document (``<name>.p000-032``), checkpoint, lease and fencing token.

Safety does not depend on ownership: if two members ever tick the same
partition (a stale view after a steal), the partition's per-tick lease lets
only one of them process and commit at a time, so a stale owner costs a
skipped tick. Ownership is only how the work gets spread; still, a member
starts no batch of a partition it no longer owns: each round of ticks begins
with a read of the membership document (a steal written between two rounds
is seen before the handler could be started), and between a partition's
batches the view is re-read once it is older than the fast balance interval.
A member whose own heartbeat has not been written for the member TTL ticks
nothing until it is.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dbtrigger import options as opt
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import (
    CasConflictError,
    ConfigurationError,
    ContentionError,
    DbTriggerError,
    OperatorError,
)
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.names import validate_name
from dbtrigger.partitions import cadence, layout
from dbtrigger.partitions.balancing import Balancing, membership_key, partition_poller
from dbtrigger.partitions.buckets import BUCKETS
from dbtrigger.partitions.failures import PartitionBackoff
from dbtrigger.partitions.inspect import GroupState, PartitionState, group_state
from dbtrigger.partitions.layout import BalanceDecision, Membership
from dbtrigger.partitions.loop import BalanceLoop
from dbtrigger.partitions.report import GroupReport
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.runtime import drain as draining
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.subscriber_options import (
    SubscriberCall,
    check_fan_out,
    refuse_registration,
)
from dbtrigger.runtime.trigger import TickResult, default_owner_id, utc_now
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.partitions")

#: Partitions a new group is laid out in when no count is given: shares come
#: out even for 1, 2, 3, 4, 6 and 12 members, and 12 splits into 24 or merges
#: into 6, 4, 3 or 2 without moving a row.
DEFAULT_PARTITIONS = 12
#: How often an idle member checks whether it gained partitions or a handover ended.
WAKE_POLL_SECONDS = 0.05
HANDOVER_POLL_SECONDS = 0.25


class PartitionedPoller(Balancing):
    """Poll ``source`` as ``partitions`` bucket ranges spread over every member.

    Args:
        name / source / checkpoint_store: as for :class:`~dbtrigger.PollTrigger`;
            the source must be a :class:`~dbtrigger.SqlAlchemySource` (the
            bucket is computed in its SQL).
        partitions: the partition count a new group starts with (default
            :data:`DEFAULT_PARTITIONS`). Once the membership document exists,
            its layout is the truth: change it with ``dbtrigger partitions set``
            (a differing value here is warned about).
        balance_interval_seconds: how often a settled member heartbeats and
            rebalances (default 3 s); while ownership is changing it cycles
            every sixth of that (at most 0.5 s) until the group has settled.
        member_ttl_seconds: a member whose heartbeat has not moved for this long
            (on the observer's own monotonic clock) is dead and its partitions
            free; default 10/3 x the interval (10 s at the default), at least 2 x.
        join_window_seconds: while a group is forming (no member owns
            anything yet), a starting member heartbeats this long before it
            claims, so that members started together see each other and each
            claims its share instead of the first one taking all (default: the
            fast interval, 0.5 s at the default interval). A member joining a
            working group claims at once.
        min_hold_cycles: a partition is not stolen from a member that took it
            fewer than this many of its cycles ago.
        member_id: this member's identity (default host/pid/random).
        background: heartbeat and rebalance from a daemon thread, so a long
            round of ticks never makes this member look dead (default). With
            False, balancing happens between partition ticks only.
        **options: every other :class:`~dbtrigger.PollTrigger` option
            (``batch_size``, ``lease_ttl_seconds``, ``quarantine``, ...), used
            for each partition's trigger. ``subscribers={name: handler}`` fans
            every partition out to those subscribers, each partition settling
            its own window; ticks then take no handler.
    """

    def __init__(
        self,
        *,
        name: str,
        source: SqlAlchemySource,
        checkpoint_store: CheckpointStore,
        partitions: int = DEFAULT_PARTITIONS,
        balance_interval_seconds: float | None = None,
        member_ttl_seconds: float | None = None,
        join_window_seconds: float | None = None,
        min_hold_cycles: int = 2,
        member_id: str | None = None,
        metrics: MetricsCollector | None = None,
        clock: Callable[[], dt.datetime] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        background: bool = True,
        **options: Any,
    ) -> None:
        self.name = validate_name(name, "poller name")
        if not isinstance(source, SqlAlchemySource):
            raise ConfigurationError(
                f"partitioned polling needs a SqlAlchemySource, not {type(source).__name__}: "
                "a change log or a database log is read in one order across keys (a "
                "truncate concerns every key, so no partition may skip it); poll it with "
                "one PollTrigger and pass max_concurrency= to handle keys side by side"
            )
        partitions = opt.whole("partitions", partitions)
        layout.even_ranges(partitions)  # validates the count against the bucket space
        min_hold_cycles = opt.whole("min_hold_cycles", min_hold_cycles, minimum=0)
        interval, ttl, window = cadence.settings(
            opt.optional_seconds("balance_interval_seconds", balance_interval_seconds),
            opt.optional_seconds("member_ttl_seconds", member_ttl_seconds),
            opt.optional_seconds(
                "join_window_seconds", join_window_seconds, minimum=0.0, inclusive=True
            ),
        )
        self.source = source
        self.store = checkpoint_store
        self.partitions = partitions
        self.interval = interval
        self.member_ttl = ttl
        self.join_window = window
        self.min_hold = min_hold_cycles
        self.member_id = member_id or default_owner_id()
        self.host = socket.gethostname()
        self.metrics = SafeMetrics(metrics, self.name)
        self._metrics_inner = metrics
        self.clock = clock or utc_now
        self.monotonic = monotonic
        #: Fan-out: every partition's trigger gets the subscribers and settles its own
        #: window; the marker is the handler ``dbtrigger run`` and ticks without one pass.
        self.subscribers, _ = check_fan_out(
            options.get("subscribers"), ack_timeout=options.get("ack_timeout_seconds")
        )
        self.options = options
        self.default_handler: Handler | None = SubscriberCall() if self.subscribers else None
        self.last_result: TickResult | None = None
        self.membership: Membership | None = None
        self.owned: tuple[str, ...] = ()
        self.last_decision: BalanceDecision | None = None
        self._triggers: dict[str, PollTrigger] = {}
        self._generation: int | None = None
        self._liveness = cadence.Liveness(ttl, monotonic)
        self._join_until: float | None = None  # end of the join window, once started
        self._warmed = False  # the source was readied in a join window (once a process)
        self._joined = False  # claimed for the first time (the join window is over)
        self._was_joining = False  # the last cycle was one of the join window
        self._turn = 0
        self._backoff = PartitionBackoff(self.name, monotonic)
        self._loop = BalanceLoop(
            self._cycle,
            self.leave,
            poller=self.name,
            member_id=self.member_id,
            cadence=cadence.Cadence(
                interval,
                monotonic,
                random.Random(),  # noqa: S311 - jitter, not security
            ),
            liveness=self._liveness,
            monotonic=monotonic,
            ttl=ttl,
        )
        self.background = background
        self._wake = threading.Event()  # set when this member gains partitions
        self._handover = False  # an owned partition's lease is still held by its last owner
        self._lock = threading.RLock()
        self._report = GroupReport(self.name, self.member_id, partitions, self.metrics)
        #: When (our monotonic clock) the membership document was last read, by a
        #: balance cycle or a confirmation; how old the view of ownership is.
        self._view_at = -float("inf")
        self._view_max_age = cadence.fast_interval(interval)
        #: The partition this member's round is on and since when (our monotonic
        #: clock; reset between its batches), and the one said to be stuck.
        self._in_flight: tuple[str, float] | None = None
        self._stuck_said: tuple[str, float] | None = None

    # --- identity ------------------------------------------------------------------

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register ``fn`` as the handler ``dbtrigger run`` drives."""
        refuse_registration(self.name, self.subscribers)
        self.default_handler = fn
        return fn

    def _handler_for(self, handler: Handler | None) -> Handler:
        """The handler the partitions tick with: the given one, the subscribers, or @handler's."""
        if handler is not None:
            return handler
        if self.subscribers:
            return SubscriberCall()
        if self.default_handler is not None:
            return self.default_handler
        raise ConfigurationError(
            f"poller {self.name!r} needs a handler: register one with @poller.handler, "
            "pass tick(handler) / drain(handler), or construct it with subscribers={name: handler}"
        )

    def describe(self) -> list[str]:
        """The settings an operator wants to see before the first tick (the worker banner)."""
        source = self.source.describe()
        return [
            f"source      {self.source.name}, table {source.get('table') or 'query'}, "
            f"cursor {self.source.cursor_column}, key ({', '.join(self.source.pk_columns)})",
            f"store       {self.store.describe()}",
            f"partitions  {self.partitions} for a new group (a stored layout wins)"
            + (f"; fan-out to {', '.join(self.subscribers)}" if self.subscribers else ""),
            f"balancing   every {self.interval:g}s once settled, every "
            f"{cadence.fast_interval(self.interval):g}s while ownership moves; member TTL "
            f"{self.member_ttl:g}s; join window {self.join_window:g}s",
        ]

    # --- ticking ---------------------------------------------------------------------

    def partition_triggers(self) -> tuple[int, dict[str, PollTrigger]]:
        """The current layout's generation and one trigger per partition, without joining.

        For code that processes partitions without being a member (the Azure
        Functions coordinator and queue worker): the layout document is
        created if it does not exist yet, but no heartbeat is written.
        """
        with self._lock:
            doc, etag = self.load_membership()
            if etag is None:
                with contextlib.suppress(CasConflictError):
                    self.store.write(self.key, layout.dumps(doc), if_match=None)
                doc, _ = self.load_membership()
            if doc.generation != self._generation:
                self._rebuild(doc)
                self._generation = doc.generation
            return doc.generation, dict(self._triggers)

    def trigger(self, partition_id: str) -> PollTrigger:
        """The trigger of one partition of the current layout."""
        if self.membership is None:
            self.balance()
        try:
            return self._triggers[partition_id]
        except KeyError:
            raise ConfigurationError(
                f"poller {self.name!r} has no partition {partition_id!r} in its current layout"
            ) from None

    def tick_result(
        self, handler: Handler | None = None, *, should_stop: Callable[[], bool] | None = None
    ) -> TickResult:
        """Balance if due, then one tick of every owned partition (in rotating order).

        A partition that fails does not stop the others; the first error (an
        operator error before any other) is raised after all had their turn,
        and that partition sits out the rounds until its own backoff ends
        (:mod:`~dbtrigger.partitions.failures`). One taken over mid-tick
        (another member declared this one dead, or an operator fenced its lease:
        a ``ContentionError``) raises nothing: the new owner delivers its batch
        again, so the round says it at WARNING, re-reads ownership and goes on.
        A partition's tick stops after its batch in flight as soon as this
        member no longer owns it (a balance cycle gave it up or learnt it was
        stolen), so no further batch of it starts here. With ``subscribers=``
        no handler is passed: each partition fans out to them.
        """
        handler = self._handler_for(handler)
        read = self._view_at
        if self.background:
            if not self._loop.running:
                self.balance()
                self._loop.start()
            self._await_join(should_stop)
        elif self._loop.due():
            self.balance()
        if self._view_at == read:  # no cycle read the document for this round: confirm
            self.confirm_ownership()
        self._wake.clear()
        owned = [] if self._loop.stale() else list(self.owned)
        if owned:
            self._turn = (self._turn + 1) % len(owned)
            owned = owned[self._turn :] + owned[: self._turn]
        rows = batches = 0
        more = False
        handover: list[str] = []  # owned, still leased by their previous owner
        outcomes: set[str] = set()
        results: list[TickResult] = []
        errors: list[DbTriggerError] = []
        for pid in owned:
            if should_stop is not None and should_stop():
                break
            if not self.background and self._loop.due():
                self.balance()
            self.confirm_ownership(self._view_max_age)
            result = self._tick_partition(pid, handler, should_stop, errors, len(owned))
            if result is None:
                continue
            results.append(result)
            rows += result.rows
            batches += result.batches
            more = more or result.more
            outcomes.add(result.outcome)
            if self._handing_over(result):
                handover.append(pid)
        self._handover = bool(handover)
        self._backoff.forget(set(self.owned))
        failing = self._backoff.failing
        idle = "idle" in outcomes or not owned or not (outcomes or set(owned) - set(failing))
        outcome = "failed" if errors else "committed" if rows else "idle" if idle else "lease_busy"
        self.last_result = TickResult(
            rows,
            batches,
            outcome,  # type: ignore[arg-type]
            more=more,
            partitions=len(owned),
            held_back=any(r.held_back for r in results),
            held_back_seconds=max((r.held_back_seconds for r in results), default=0.0),
            waiting_retries=sum(r.waiting_retries for r in results),
            next_retry_at=min((r.next_retry_at for r in results if r.next_retry_at), default=None),
            window_withheld=sum(r.window_withheld for r in results),
            failing_partitions=failing,
            handover=tuple(sorted(handover)),
        )
        if errors:
            raise next((e for e in errors if isinstance(e, OperatorError)), errors[0])
        return self.last_result

    def _tick_partition(
        self,
        pid: str,
        handler: Handler | None,
        should_stop: Callable[[], bool] | None,
        errors: list[DbTriggerError],
        owned: int,
    ) -> TickResult | None:
        """One partition's tick in a round; None when it was skipped or failed
        (its error appended to ``errors``, its own backoff started). Taken over
        mid-tick, it is a ``lost_race`` with ``more``: no failure of this member's."""
        trigger = self._triggers.get(pid)
        if trigger is None or pid not in self.owned or self._backoff.waiting(pid):
            return None  # given up, stolen or regrouped since the round began; failing
        self._in_flight = (pid, self.monotonic())
        try:
            result = trigger.tick_result(handler, should_stop=self._stop_for(pid, should_stop))
        except ContentionError as exc:  # another member or an operator took its lease
            self._backoff.taken_over(pid, exc, self.member_id)
            self._view_at = -float("inf")  # the next partition's turn re-reads ownership
            return TickResult(0, 0, "lost_race", more=True)  # its batch comes again
        except DbTriggerError as exc:
            errors.append(exc)
            if not isinstance(exc, OperatorError):
                self._backoff.failed(pid, exc, owned - 1)
            return None
        finally:
            self._in_flight = None
        self._backoff.succeeded(pid)
        return result

    def _stop_for(self, pid: str, should_stop: Callable[[], bool] | None) -> Callable[[], bool]:
        """Asked between a partition's batches: stop, or the partition is no longer ours."""

        def stop() -> bool:
            self._in_flight = (pid, self.monotonic())  # between batches: the next one starts
            if should_stop is not None and should_stop():
                return True
            self.confirm_ownership(self._view_max_age)
            return pid not in self.owned or self._loop.stale()

        return stop

    def _cycle(self) -> None:
        """The balance thread's cycle: balance, then say if the round is stuck."""
        self.balance()
        self._report_waiting()

    def _report_waiting(self) -> None:
        """Say once (:meth:`GroupReport.batch_stuck`) that a batch has run past its
        partition's lease TTL while this member owns other partitions."""
        flight = self._in_flight
        if flight is None or flight == self._stuck_said:
            return
        pid, since = flight
        trigger = self._triggers.get(pid)
        waiting = [p for p in self.owned if p != pid]
        ran = self.monotonic() - since
        if trigger is None or not waiting or ran < trigger.lease_ttl.total_seconds():
            return
        self._stuck_said = flight
        self._report.batch_stuck(pid, ran, trigger.lease_ttl.total_seconds(), waiting)

    def _handing_over(self, result: TickResult) -> bool:
        """The partition's lease is held by another live member: it is finishing a batch."""
        holder = result.holder
        if result.outcome != "lease_busy" or holder is None or holder == self.member_id:
            return False
        return self.membership is not None and holder in self.membership.members

    def _await_join(self, should_stop: Callable[[], bool] | None) -> None:
        """Sit out the join window (heartbeating from the thread), then claim at once.

        The window is spent readying the source for the first round instead of
        sleeping through it: the driver imported, a pooled connection opened
        and the table's shape reflected (0.2-0.6 s of a cold process's start on
        PostgreSQL), which the first partition tick would otherwise pay after
        the claim. A failure here is left to that tick to report.
        """
        if not self._was_joining or self._join_until is None:
            return
        if not self._warmed:
            self._warmed = True
            with contextlib.suppress(DbTriggerError):
                self.source.validate()
        while (left := self._join_until - self.monotonic()) > 0:
            if should_stop is not None and should_stop():
                return
            if self._loop.closing.wait(min(left, WAKE_POLL_SECONDS)):
                return
        self.balance()

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        """The worker's idle sleep, ended early when this member gains partitions.

        While a partition it owns is still leased by its previous owner
        (finishing its batch in flight), the sleep is cut to
        :data:`HANDOVER_POLL_SECONDS`, so the partition is picked up as soon as
        it is free rather than an idle interval later.
        """
        if self._handover:
            seconds = min(seconds, HANDOVER_POLL_SECONDS)
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if stop.wait(min(left, WAKE_POLL_SECONDS)):
                return False
            if self._wake.is_set():
                return True

    def tick(
        self, handler: Handler | None = None, *, should_stop: Callable[[], bool] | None = None
    ) -> int:
        """One round; the rows committed, their history written (:meth:`flush_history`)."""
        try:
            return self.tick_result(handler, should_stop=should_stop).rows
        finally:
            self.flush_history()

    def run(self, *, timer: Any = None, handler: Handler | None = None) -> int:
        self.timer_fired(timer)
        return self.tick(handler)

    def flush_history(self) -> bool:
        """Wait (boundedly) until every partition's history records so far are written."""
        written = True
        for trigger in list(self._triggers.values()):
            written = trigger.flush_history() and written
        return written

    def drain(
        self,
        handler: Handler | None = None,
        *,
        max_ticks: int | None = None,
        held_wait_seconds: float = draining.DEFAULT_HELD_WAIT_SECONDS,
        retry_wait_seconds: float = draining.DEFAULT_RETRY_WAIT_SECONDS,
        stop: threading.Event | None = None,
        handover_wait_seconds: float = draining.DEFAULT_HANDOVER_WAIT_SECONDS,
    ) -> int:
        """Tick the owned partitions until nothing is left to deliver, waiting for
        held-back rows and due retries as a poller's drain does
        (:mod:`dbtrigger.runtime.drain`); ``stop`` ends a wait and the drain. A
        partition that moved to another member meanwhile is that member's to
        deliver; one that moved here while its previous owner still runs a batch
        of it is waited for, up to ``handover_wait_seconds`` (LeaseAcquireError
        naming it past that). History is flushed on the way out."""
        try:
            return draining.drain(
                self,
                self._handler_for(handler),
                max_ticks=max_ticks,
                progress=None,
                lease_wait_seconds=None,  # no lease of its own: one per partition
                held_wait_seconds=held_wait_seconds,
                retry_wait_seconds=retry_wait_seconds,
                stop=stop,
                handover_wait_seconds=handover_wait_seconds,
            )
        finally:
            self.flush_history()

    def rows_behind(self) -> int | None:
        """About how many rows wait in the partitions this member owns (the
        worker's progress line); None while it owns none.

        An estimate that costs what a plain poller's count costs: the rows after
        the furthest-behind of their checkpoints, counted on the table without
        the bucket condition (a range count on the ``(cursor, key)`` index; an
        exact count per partition hashes every row behind each checkpoint: 1.5 s
        for 12 partitions of a 20k-row backlog), times the share of the buckets
        they hold. Partitions that drain side by side keep it close; one far
        behind the others makes it high.
        """
        with self._lock:
            owned = [self._triggers[pid] for pid in self.owned if pid in self._triggers]
        sources = [t.source for t in owned if isinstance(t.source, PartitionSource)]
        if not owned or len(sources) != len(owned):
            return None
        positions = {}
        for trigger in owned:
            doc = trigger.read_state()
            position = doc.position if doc else BEGINNING
            positions[repr(position)] = position
        rows = max(self.source.count_after(position) for position in positions.values())
        buckets = sum(s.partition.hi - s.partition.lo for s in sources)
        return round(rows * buckets / BUCKETS)

    def close(self) -> None:
        """Release the partition triggers' threads (lanes, heartbeats). Membership
        is kept: :meth:`leave` gives the partitions back."""
        for trigger in list(self._triggers.values()):
            trigger.close()

    def leave(self) -> None:
        """Give up every partition now (shutdown), so others need not wait for the TTL."""
        self._loop.stop(timeout=self.interval * 2)
        if self.membership is not None:
            self.balance(leaving=True)
            self.owned = ()
        self._joined, self._join_until, self._was_joining = False, None, False  # joins afresh

    # --- inspection --------------------------------------------------------------------

    def group_state(self, *, lag: bool = True) -> GroupState:
        """Members, and every partition with its owner, lease, checkpoint, retries
        waiting and (with ``lag``) the rows behind and the age of the oldest."""
        doc, _ = self.load_membership()
        with self._lock:
            if self._generation != doc.generation:
                self._rebuild(doc)
                self._generation = doc.generation
            sources = {pid: t.source for pid, t in self._triggers.items()}
        measured = {
            pid: source
            for pid, source in sources.items()
            if lag and isinstance(source, PartitionSource)
        }
        return group_state(self.store, doc, now=self.clock(), sources=measured)

    def status(self, *, lag: bool = True) -> list[PartitionState]:
        """Every partition with its owner, checkpoint and (with ``lag``) rows pending."""
        return list(self.group_state(lag=lag).partitions)


__all__ = [
    "DEFAULT_PARTITIONS",
    "PartitionedPoller",
    "membership_key",
    "partition_poller",
]
