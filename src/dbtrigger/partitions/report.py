"""What a member tells about its group: log lines and gauges, each cause said once.

A balance cycle runs every few seconds, so anything said per cycle would
drown the log. Rebalances (claimed, stolen, released) and expired members are
news each time they happen; standing conditions - fewer partitions than
members, a member that owns nothing and why, a stored layout that differs
from the configured count - are said once, and again only when their cause
changes.
"""

from __future__ import annotations

import logging

from dbtrigger.metrics import SafeMetrics
from dbtrigger.partitions import layout
from dbtrigger.partitions.layout import BalanceDecision, Membership

log = logging.getLogger("dbtrigger.partitions")


class GroupReport:
    """The log and gauges of one member's balance cycles."""

    def __init__(self, poller: str, member_id: str, configured: int, metrics: SafeMetrics) -> None:
        self.poller = poller
        self.member_id = member_id
        self.configured = configured
        self.metrics = metrics
        self._said_idle: str | None = None
        self._warned_few = False

    def cycle(
        self, doc: Membership, decision: BalanceDecision, *, joining: bool, first: bool
    ) -> None:
        """Report one applied cycle (``first``: this member's first view of the layout)."""
        if first and len(doc.partitions) != self.configured:
            log.warning(
                "poller %s is laid out in %d partitions, not the configured %d: the stored "
                "layout wins (change it with `dbtrigger partitions set`)",
                self.poller,
                len(doc.partitions),
                self.configured,
                extra={"event": "partition_count_differs", "poller": self.poller},
            )
        self.metrics.set_gauge("partitions_owned", len(decision.owned))
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
                        "poller": self.poller,
                        "partitions": pids,
                    },
                )
        if decision.dead:
            log.warning(
                "member(s) %s stopped heartbeating; their partitions are free",
                ", ".join(decision.dead),
                extra={
                    "event": "members_expired",
                    "poller": self.poller,
                    "members": decision.dead,
                },
            )
        if decision.shares:  # not when leaving
            self._few_partitions(doc)
            self._idle(doc, decision, joining=joining)

    def _few_partitions(self, doc: Membership) -> None:
        """Fewer partitions than members: once, with a count every member gets work from."""
        members, count = len(doc.members), len(doc.partitions)
        if members <= count:
            self._warned_few = False
            return
        if self._warned_few:
            return
        self._warned_few = True
        log.warning(
            "poller %s has %d partitions for %d members: %d member(s) get no work; "
            "`dbtrigger partitions set --count %d` gives each one a partition",
            self.poller,
            count,
            members,
            members - count,
            layout.suggested_count(doc.partitions, members),
            extra={
                "event": "partitions_fewer_than_members",
                "poller": self.poller,
                "partitions": count,
                "members": members,
            },
        )

    def _idle(self, doc: Membership, decision: BalanceDecision, *, joining: bool) -> None:
        """A member that owns nothing says why, at INFO, once per cause."""
        if decision.owned or joining:
            self._said_idle = None
            return
        share = decision.shares.get(self.member_id, 0)
        if share > 0:
            # Transient: members above their share release within a fast cycle, a
            # dead one's partitions free up after the member TTL.
            log.debug(
                "member %s of %s owns no partition yet: waiting for its share of %d",
                self.member_id,
                self.poller,
                share,
                extra={"event": "member_waiting", "poller": self.poller, "share": share},
            )
            return
        why = (
            f"its fair share is 0: {len(doc.partitions)} partitions for {len(doc.members)} "
            "members; it takes over when a member leaves or dies"
        )
        if why != self._said_idle:
            self._said_idle = why
            log.info(
                "member %s of %s owns no partition: %s",
                self.member_id,
                self.poller,
                why,
                extra={"event": "member_idle", "poller": self.poller, "share": share},
            )

    def batch_stuck(self, pid: str, ran: float, lease_ttl: float, waiting: list[str]) -> None:
        """WARNING: a batch of ``pid`` has run ``ran`` seconds, past its lease TTL,
        while this member owns the ``waiting`` partitions too: the round ticks them
        only after it, and the others take none of them while this member
        heartbeats, so their rows wait too (the partition's own ``handler_slow``
        line names only its batch)."""
        log.warning(
            "member %s: a batch of partition %s has run %.0fs (over its lease TTL of %gs) and "
            "not returned; the member's other partition(s) %s are not ticked until it does, "
            "and no other member takes them over while this one heartbeats; set "
            "handler_timeout_seconds to give such a call up",
            self.member_id,
            pid,
            ran,
            lease_ttl,
            ", ".join(waiting),
            extra={
                "event": "partitions_waiting",
                "poller": self.poller,
                "partition": pid,
                "partitions": tuple(waiting),
                "seconds": round(ran, 1),
            },
        )
