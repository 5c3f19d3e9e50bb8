"""A partitioned poller's membership and balancing: the membership document read,
one balance cycle (heartbeat, claim, steal, release, by one CAS write), the
fence on steal, and the per-partition triggers of the current layout.

A mixin of :class:`~dbtrigger.partitions.member.PartitionedPoller`, which
declares the state it works on (annotated here) and ticks the partitions.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from dbtrigger.errors import CasConflictError, CorruptStateError, FingerprintMismatchError
from dbtrigger.partitions import cadence, layout
from dbtrigger.partitions.handover import fence_dead_holders
from dbtrigger.partitions.layout import BalanceDecision, Floor, Membership, Partition
from dbtrigger.partitions.loop import BalanceLoop
from dbtrigger.partitions.recovery import read_membership
from dbtrigger.partitions.report import GroupReport
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.subscribers import FanOut
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.partitions")

#: CAS rounds for one balance write before the cycle is skipped.
MAX_BALANCE_ROUNDS = 5


def membership_key(poller: str) -> str:
    return f"{poller}.members"


def partition_poller(poller: str, partition_id: str) -> str:
    return f"{poller}.{partition_id}"


_PARTITION_ID = re.compile(r"p(\d{3})-(\d{3})")


def partition_of(poller: str, name: str) -> Partition | None:
    """The partition whose poller ``name`` is (``orders.p000-064`` of ``orders``), or None.

    Read from the name alone, so a partition of an earlier layout (before a
    split or merge) is found too: what it dead-lettered or journaled outlives it.
    """
    group, dot, pid = name.rpartition(".")
    match = _PARTITION_ID.fullmatch(pid)
    if not dot or group != poller or match is None:
        return None
    lo, hi = int(match[1]), int(match[2])
    return Partition(lo, hi) if lo < hi else None


class Balancing:
    """Membership and balancing of one member (see the module docstring)."""

    name: str
    source: SqlAlchemySource
    store: CheckpointStore
    partitions: int
    member_id: str
    host: str
    join_window: float
    min_hold: int
    options: dict[str, Any]
    clock: Callable[[], dt.datetime]
    monotonic: Callable[[], float]
    membership: Membership | None
    owned: tuple[str, ...]
    last_decision: BalanceDecision | None
    _metrics_inner: Any
    _triggers: dict[str, PollTrigger]
    _generation: int | None
    _liveness: cadence.Liveness
    _join_until: float | None
    _joined: bool
    _was_joining: bool
    _loop: BalanceLoop
    _wake: threading.Event
    _lock: threading.RLock
    _report: GroupReport
    _view_at: float

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint()

    @property
    def key(self) -> str:
        return membership_key(self.name)

    def load_membership(self) -> tuple[Membership, str | None]:
        stored = self.store.read(self.key)
        if stored is None:
            return layout.new_membership(self.name, self.fingerprint, self.partitions), None
        doc = read_membership(self.store, self.name, self.key, stored.data)
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

    @property
    def joining(self) -> bool:
        """True while the last cycle was in the join window (heartbeat, no claims)."""
        return self._was_joining

    def _joins_now(self, doc: Membership) -> bool:
        """Whether this cycle sits in the join window.

        Only while the group is forming - no other member owns anything - and
        for ``join_window`` after this member's first cycle: members started
        together then see each other before anyone claims, and each takes its
        share instead of the first taking all and shedding. A member joining
        a working group claims at once (the others shed for it).
        """
        if self._joined:
            return False
        now = self.monotonic()
        if self._join_until is None:
            self._join_until = now + self.join_window
        forming = not any(m.owns for name, m in doc.members.items() if name != self.member_id)
        return forming and now < self._join_until

    def balance(self, *, leaving: bool = False) -> BalanceDecision | None:
        """One balance cycle: heartbeat, claim/steal/release; None if every CAS round lost."""
        with self._lock:
            decision = self._balance(leaving=leaving)
            if not leaving:
                self._loop.schedule(decision, self.membership, joining=self.joining)
            return decision

    def _balance(self, *, leaving: bool) -> BalanceDecision | None:
        for _ in range(MAX_BALANCE_ROUNDS):
            doc, etag = self.load_membership()
            self._view_at = self.monotonic()
            joining = not leaving and self._joins_now(doc)
            live = self._liveness.observe(doc, self.member_id)
            decision = layout.balance(
                doc,
                me=self.member_id,
                live=live,
                min_hold_beats=self.min_hold,
                now=self.clock(),
                leaving=leaving,
                joining=joining,
                host=self.host,
            )
            assert decision.document is not None  # noqa: S101 - balance always writes a beat
            try:
                self.store.write(self.key, layout.dumps(decision.document), if_match=etag)
            except CasConflictError:
                continue
            self._loop.written()
            self._was_joining = joining
            self._joined = self._joined or not joining
            before = self.membership
            self._applied(decision.document, decision)
            self._fence_the_gone(before, decision)
            return decision
        log.warning(
            "balance cycle of %s skipped: the membership document kept changing",
            self.member_id,
            extra={"event": "balance_skipped", "poller": self.name},
        )
        return None

    def _applied(self, doc: Membership, decision: BalanceDecision) -> None:
        self.membership = doc
        self.last_decision = decision
        gained = bool(set(decision.owned) - set(self.owned))
        self.owned = decision.owned
        if gained:
            self._wake.set()  # an idle worker loop ticks the new partitions at once
        if doc.generation != self._generation:
            self._rebuild(doc)
        self._report.cycle(doc, decision, joining=self.joining, first=self._generation is None)
        self._generation = doc.generation

    def _fence_the_gone(self, before: Membership | None, decision: BalanceDecision) -> None:
        """Fence out the partition leases of members that died holding them (see
        :func:`~dbtrigger.partitions.handover.fence_dead_holders`), on every
        partition this member owns: one stolen from a member that was declared
        dead only later (workers restarted after a crash steal before the TTL)
        would otherwise wait for that lease's own TTL."""
        gone = set(decision.dead)
        if before is not None and self.membership is not None:
            gone |= set(before.members) - set(self.membership.members)
        gone.discard(self.member_id)
        if gone:
            fence_dead_holders(
                self.store,
                {pid: self._triggers[pid].name for pid in decision.owned if pid in self._triggers},
                frozenset(gone),
                actor=self.member_id,
                now=self.clock(),
                poller=self.name,
            )

    def confirm_ownership(self, max_age: float = 0.0) -> tuple[str, ...]:
        """Re-read the membership document (unless the view is under ``max_age``
        seconds old) and stop owning what it no longer gives this member.

        The fence on steal: the balance thread learns of a steal only at its
        next cycle (seconds away once settled), so a member would otherwise
        start the handler on a partition another member took meanwhile. Only
        removes: gaining partitions is a balance cycle's job (a claim is a
        write). A member the others dropped as dead owns nothing here until its
        next cycle rejoins. Returns the partitions given up.
        """
        with self._lock:
            if self.membership is None or self.monotonic() - self._view_at < max_age:
                return ()
            doc, _ = self.load_membership()
            self._view_at = self.monotonic()
            mine = doc.members.get(self.member_id)
            lost = tuple(p for p in self.owned if mine is None or p not in mine.owns)
            if lost:
                self.owned = tuple(p for p in self.owned if p not in lost)
                log.info(
                    "member %s no longer owns partition(s) %s: %s",
                    self.member_id,
                    ", ".join(lost),
                    "the group dropped it as dead" if mine is None else "taken by another member",
                    extra={"event": "partitions_lost", "poller": self.name, "partitions": lost},
                )
            return lost

    def _floors_of(self, partition: Partition) -> Callable[[], tuple[Floor, ...]]:
        """The floors the stored layout gives ``partition`` now (kept if it was regrouped)."""

        def floors() -> tuple[Floor, ...]:
            stored = self.store.read(self.key)
            doc = read_membership(self.store, self.name, self.key, stored.data) if stored else None
            current = doc.partition(partition.id) if doc is not None else None
            return partition.floors if current is None else current.floors

        return floors

    def partition_trigger(self, partition: Partition) -> PollTrigger:
        """The PollTrigger of one partition, as a member ticks it: its own name,
        bucket range, state document and the group's options.

        Also for a partition that is not in the current layout any more (the
        dead-letter commands replay what one dead-lettered before a split).
        """
        trigger = PollTrigger(
            name=partition_poller(self.name, partition.id),
            source=PartitionSource(
                self.source, partition, poller=self.name, floors_now=self._floors_of(partition)
            ),
            checkpoint_store=self.store,
            owner_id=self.member_id,
            metrics=self._metrics_inner,
            clock=self.clock,
            **self.options,
        )
        delivery = trigger._driver.reader.delivery
        if isinstance(delivery, FanOut):
            # A subscriber whose call hung in one partition is busy in all of them: it
            # was called again (one more hung thread) and waited for in each partition.
            delivery.abandoned = self.__dict__.setdefault("_hung_calls", {})
            if self.__dict__.get("_under_timer"):
                delivery.under_timer()
        return trigger

    def timer_fired(self, timer: object) -> None:
        """``run(timer=...)``: a Functions invocation drives the rounds. A fan-out
        ack timeout left at its default is cut for every partition, as a poller's is
        (:meth:`dbtrigger.runtime.subscribers.FanOut.under_timer`)."""
        if timer is None or self.options.get("ack_timeout_seconds") is not None:
            return
        self.__dict__["_under_timer"] = True
        for trigger in list(self._triggers.values()):
            trigger._driver.reader.delivery.under_timer()

    def _rebuild(self, doc: Membership) -> None:
        """One PollTrigger per partition of the current layout."""
        self._triggers = {p.id: self.partition_trigger(p) for p in doc.partitions}


__all__ = [
    "MAX_BALANCE_ROUNDS",
    "Balancing",
    "membership_key",
    "partition_of",
    "partition_poller",
]
