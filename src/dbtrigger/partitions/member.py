"""``PartitionedPoller``: one member of a group that splits a table's partitions.

Each process (worker, Function instance) that runs the same partitioned poller
is a member. Every ``balance_interval_seconds`` (with up to 20% jitter, so
members do not write in lock-step) a member rewrites the membership document
(:mod:`dbtrigger.partitions.layout`) by compare-and-swap: its heartbeat, and
the partitions it claims, steals or releases. Between balance cycles it ticks
the partitions it owns, each an ordinary :class:`~dbtrigger.PollTrigger` with
its own state document (``<name>.p000-032``), checkpoint, lease and fencing
token.

Safety does not depend on ownership: if two members ever tick the same
partition (a stale view after a steal), the partition's per-tick lease lets
only one of them process and commit at a time, so a stale owner costs a
skipped tick. Ownership is only how the work gets spread.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbtrigger import options as opt
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import (
    CasConflictError,
    ConfigurationError,
    CorruptStateError,
    DbTriggerError,
    FingerprintMismatchError,
    OperatorError,
)
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.names import validate_name
from dbtrigger.partitions import layout
from dbtrigger.partitions.layout import BalanceDecision, Membership
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.trigger import TickResult, default_owner_id, utc_now
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.partitions")

#: CAS rounds for one balance write before the cycle is skipped.
MAX_BALANCE_ROUNDS = 5


def membership_key(poller: str) -> str:
    return f"{poller}.members"


def partition_poller(poller: str, partition_id: str) -> str:
    return f"{poller}.{partition_id}"


@dataclass(frozen=True)
class PartitionState:
    """One row of ``status``: a partition, its owner and how far behind it is."""

    id: str
    lo: int
    hi: int
    owner: str | None
    checkpoint: Any
    lag_rows: int | None


class PartitionedPoller:
    """Poll ``source`` as ``partitions`` bucket ranges spread over every member.

    Args:
        name / source / checkpoint_store: as for :class:`~dbtrigger.PollTrigger`;
            the source must be a :class:`~dbtrigger.SqlAlchemySource` (the
            bucket is computed in its SQL).
        partitions: the partition count a new group starts with. Once the
            membership document exists, its layout is the truth: change it with
            ``dbtrigger partitions set`` (a differing value here is warned about).
        balance_interval_seconds: how often a member heartbeats and rebalances.
        member_ttl_seconds: a member whose heartbeat has not moved for this long
            (on the observer's own monotonic clock) is dead and its partitions
            free; default 4 x the interval, at least 2 x.
        min_hold_cycles: a partition is not stolen from a member that took it
            fewer than this many of its cycles ago.
        member_id: this member's identity (default host/pid/random).
        background: heartbeat and rebalance from a daemon thread, so a long
            round of ticks never makes this member look dead (default). With
            False, balancing happens between partition ticks only.
        **options: every other :class:`~dbtrigger.PollTrigger` option
            (``batch_size``, ``lease_ttl_seconds``, ``quarantine``, ...), used
            for each partition's trigger.
    """

    def __init__(
        self,
        *,
        name: str,
        source: SqlAlchemySource,
        checkpoint_store: CheckpointStore,
        partitions: int = 8,
        balance_interval_seconds: float = 15.0,
        member_ttl_seconds: float | None = None,
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
                f"partitioned polling needs a SqlAlchemySource, not {type(source).__name__}"
            )
        partitions = opt.whole("partitions", partitions)
        layout.even_ranges(partitions)  # validates the count against the bucket space
        balance_interval_seconds = opt.seconds("balance_interval_seconds", balance_interval_seconds)
        member_ttl_seconds = opt.optional_seconds("member_ttl_seconds", member_ttl_seconds)
        min_hold_cycles = opt.whole("min_hold_cycles", min_hold_cycles, minimum=0)
        ttl = member_ttl_seconds if member_ttl_seconds is not None else 4 * balance_interval_seconds
        if ttl < 2 * balance_interval_seconds:
            raise ConfigurationError(
                f"member_ttl_seconds ({ttl:g}) must be at least twice balance_interval_seconds "
                f"({balance_interval_seconds:g}): a member that misses one cycle is not dead"
            )
        self.source = source
        self.store = checkpoint_store
        self.partitions = partitions
        self.interval = balance_interval_seconds
        self.member_ttl = ttl
        self.min_hold = min_hold_cycles
        self.member_id = member_id or default_owner_id()
        self.metrics = SafeMetrics(metrics, self.name)
        self._metrics_inner = metrics
        self.clock = clock or utc_now
        self.monotonic = monotonic
        self.options = options
        self.default_handler: Handler | None = None
        self.last_result: TickResult | None = None
        self.membership: Membership | None = None
        self.owned: tuple[str, ...] = ()
        self._triggers: dict[str, PollTrigger] = {}
        self._generation: int | None = None
        self._seen: dict[str, tuple[int, float]] = {}
        self._next_balance = -float("inf")
        self._turn = 0
        self._random = random.Random()  # noqa: S311 - jitter, not security
        self.background = background
        self._beater: threading.Thread | None = None
        self._closing = threading.Event()
        self._lock = threading.RLock()
        self._exit_hook = False

    # --- identity ------------------------------------------------------------------

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register ``fn`` as the handler ``dbtrigger run`` drives."""
        self.default_handler = fn
        return fn

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint()

    @property
    def key(self) -> str:
        return membership_key(self.name)

    # --- balancing -------------------------------------------------------------------

    def _observe(self, doc: Membership) -> frozenset[str]:
        """Members whose heartbeat moved within the TTL, on our own monotonic clock."""
        now = self.monotonic()
        live = set()
        for name, member in doc.members.items():
            if name == self.member_id:
                continue
            seen = self._seen.get(name)
            if seen is None or seen[0] != member.beat:
                self._seen[name] = (member.beat, now)
                seen = self._seen[name]
            if now - seen[1] < self.member_ttl:
                live.add(name)
        return frozenset(live)

    def load_membership(self) -> tuple[Membership, str | None]:
        stored = self.store.read(self.key)
        if stored is None:
            return layout.new_membership(self.name, self.fingerprint, self.partitions), None
        doc = layout.loads(stored.data)
        if doc.poller != self.name:
            raise CorruptStateError(
                f"membership document {self.key!r} belongs to poller {doc.poller!r}"
            )
        if doc.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"poller {self.name!r}: the source definition changed since the partitions were "
                f"laid out (stored {doc.fingerprint}, configured {self.fingerprint}); use a new "
                "poller name",
                poller=self.name,
                stored_fingerprint=doc.fingerprint,
                configured_fingerprint=self.fingerprint,
            )
        return doc, stored.etag

    def balance(self, *, leaving: bool = False) -> BalanceDecision | None:
        """One balance cycle: heartbeat, claim/steal/release; None if every CAS round lost."""
        with self._lock:
            return self._balance(leaving=leaving)

    def _balance(self, *, leaving: bool) -> BalanceDecision | None:
        for _ in range(MAX_BALANCE_ROUNDS):
            doc, etag = self.load_membership()
            live = self._observe(doc)
            decision = layout.balance(
                doc,
                me=self.member_id,
                live=live,
                min_hold_beats=self.min_hold,
                now=self.clock(),
                leaving=leaving,
            )
            assert decision.document is not None  # noqa: S101 - balance always writes a beat
            try:
                self.store.write(self.key, layout.dumps(decision.document), if_match=etag)
            except CasConflictError:
                continue
            self._applied(decision.document, decision)
            return decision
        log.warning(
            "balance cycle of %s skipped: the membership document kept changing",
            self.member_id,
            extra={"event": "balance_skipped", "poller": self.name},
        )
        return None

    def _applied(self, doc: Membership, decision: BalanceDecision) -> None:
        self.membership = doc
        self.owned = decision.owned
        if doc.generation != self._generation:
            self._rebuild(doc)
        if len(doc.partitions) != self.partitions and self._generation is None:
            log.warning(
                "poller %s is laid out in %d partitions, not the configured %d: the stored "
                "layout wins (change it with `dbtrigger partitions set`)",
                self.name,
                len(doc.partitions),
                self.partitions,
                extra={"event": "partition_count_differs", "poller": self.name},
            )
        self._generation = doc.generation
        self.metrics.set_gauge("partitions_owned", len(self.owned))
        self.metrics.set_gauge("partition_members", len(doc.members))
        for action, pids in (
            ("claimed", decision.claimed),
            ("stolen", decision.stolen),
            ("released", decision.released),
        ):
            if pids:
                self.metrics.increment(
                    "partition_rebalances_total", len(pids), labels={"action": action}
                )
                log.info(
                    "member %s %s partition(s) %s",
                    self.member_id,
                    action,
                    ", ".join(pids),
                    extra={
                        "event": f"partitions_{action}",
                        "poller": self.name,
                        "partitions": pids,
                    },
                )
        if decision.dead:
            log.warning(
                "member(s) %s stopped heartbeating; their partitions are free",
                ", ".join(decision.dead),
                extra={"event": "members_expired", "poller": self.name, "members": decision.dead},
            )

    def _rebuild(self, doc: Membership) -> None:
        """One PollTrigger per partition of the current layout."""
        self._triggers = {
            p.id: PollTrigger(
                name=partition_poller(self.name, p.id),
                source=PartitionSource(self.source, p, poller=self.name),
                checkpoint_store=self.store,
                owner_id=self.member_id,
                metrics=self._metrics_inner,
                clock=self.clock,
                **self.options,
            )
            for p in doc.partitions
        }

    def _balance_if_due(self) -> None:
        """Balance now if it is due (between partition ticks, without a thread)."""
        now = self.monotonic()
        if now < self._next_balance:
            return
        self.balance()
        self._next_balance = now + self._delay()

    def _delay(self) -> float:
        """The next cycle: the interval plus up to 20% jitter, so members spread out."""
        return self.interval + self._random.uniform(0, 0.2 * self.interval)

    def _start_heartbeat(self) -> None:
        """Balance once now, then every interval from a daemon thread."""
        if self._beater is not None and self._beater.is_alive():
            return
        self.balance()
        self._closing.clear()
        if not self._exit_hook:
            # A worker that exits normally (SIGTERM through `dbtrigger run`) gives
            # its partitions back at once instead of after the member TTL.
            atexit.register(self._leave_at_exit)
            self._exit_hook = True
        self._beater = threading.Thread(
            target=self._beat, name=f"dbtrigger-balance-{self.name}", daemon=True
        )
        self._beater.start()

    def _leave_at_exit(self) -> None:
        with contextlib.suppress(DbTriggerError):
            self.leave()

    def _beat(self) -> None:
        while not self._closing.wait(self._delay()):
            try:
                self.balance()
            except DbTriggerError as exc:
                # The partitions' own leases keep processing safe meanwhile; the
                # next cycle tries again, and others see us dead only after the TTL.
                log.warning(
                    "balance cycle of %s failed: %s",
                    self.member_id,
                    exc,
                    extra={"event": "balance_failed", "poller": self.name},
                )
            except Exception:
                # Not ours to swallow silently, but a dead balance thread would stop
                # this member from ever rebalancing: log it whole and keep cycling.
                log.exception(
                    "balance cycle of %s failed unexpectedly",
                    self.member_id,
                    extra={"event": "balance_failed", "poller": self.name},
                )

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
        self, handler: Handler, *, should_stop: Callable[[], bool] | None = None
    ) -> TickResult:
        """Balance if due, then one tick of every owned partition (in rotating order).

        A partition that fails does not stop the others; the first error (an
        operator error before any other) is raised after all had their turn.
        """
        if self.background:
            self._start_heartbeat()
        else:
            self._balance_if_due()
        owned = list(self.owned)
        if owned:
            self._turn = (self._turn + 1) % len(owned)
            owned = owned[self._turn :] + owned[: self._turn]
        rows = batches = 0
        more = False
        outcomes: set[str] = set()
        errors: list[DbTriggerError] = []
        for pid in owned:
            if should_stop is not None and should_stop():
                break
            if not self.background:
                self._balance_if_due()
            trigger = self._triggers.get(pid)
            if trigger is None or pid not in self.owned:
                continue  # given up or regrouped since the round began
            try:
                result = trigger.tick_result(handler, should_stop=should_stop)
            except DbTriggerError as exc:
                errors.append(exc)
                continue
            rows += result.rows
            batches += result.batches
            more = more or result.more
            outcomes.add(result.outcome)
        if errors:
            raise next((e for e in errors if isinstance(e, OperatorError)), errors[0])
        outcome = (
            "committed" if rows else ("idle" if "idle" in outcomes or not owned else "lease_busy")
        )
        self.last_result = TickResult(rows, batches, outcome, more=more)  # type: ignore[arg-type]
        return self.last_result

    def tick(self, handler: Handler, *, should_stop: Callable[[], bool] | None = None) -> int:
        return self.tick_result(handler, should_stop=should_stop).rows

    def run(self, *, timer: Any = None, handler: Handler) -> int:
        del timer
        return self.tick(handler)

    def drain(self, handler: Handler, *, max_ticks: int | None = None) -> int:
        """Tick the owned partitions until a round commits nothing."""
        total = ticks = 0
        while max_ticks is None or ticks < max_ticks:
            result = self.tick_result(handler)
            ticks += 1
            total += result.rows
            if result.rows == 0 and not result.more:
                break
        return total

    def rows_behind(self) -> int | None:
        """Not counted across partitions (``status()`` counts each one's lag)."""
        return None

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        """The worker's idle sleep: up to ``seconds``, ended early by ``stop``."""
        stop.wait(seconds)
        return False

    def close(self) -> None:
        """Release the partition triggers' threads (lanes, heartbeats). Membership
        is kept: :meth:`leave` gives the partitions back."""
        for trigger in list(self._triggers.values()):
            trigger.close()

    def leave(self) -> None:
        """Give up every partition now (shutdown), so others need not wait for the TTL."""
        self._closing.set()
        if self._beater is not None:
            self._beater.join(timeout=self.interval * 2)
            self._beater = None
        if self.membership is not None:
            self.balance(leaving=True)
            self.owned = ()

    # --- inspection --------------------------------------------------------------------

    def status(self, *, lag: bool = True) -> list[PartitionState]:
        """Every partition with its owner, checkpoint and (with ``lag``) rows pending."""
        doc, _ = self.load_membership()
        if self._generation != doc.generation:
            self._rebuild(doc)
            self._generation = doc.generation
        out = []
        for p in doc.partitions:
            trigger = self._triggers[p.id]
            state = trigger.read_state()
            position = state.position if state else None
            pending = None
            if lag:
                source = trigger.source
                assert isinstance(source, PartitionSource)  # noqa: S101 - built by _rebuild
                pending = source.count_after(position if position is not None else BEGINNING)
            out.append(
                PartitionState(
                    p.id,
                    p.lo,
                    p.hi,
                    doc.owner_of(p.id),
                    position.cursor if position else None,
                    pending,
                )
            )
        return out
