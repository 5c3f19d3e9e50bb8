"""Taking a partition over from a member that died holding its lease.

A member killed in the middle of a batch leaves that partition's lease live
until the lease TTL runs out (120 s by default, renewed while the handler
ran). Ownership moves sooner - after the member TTL, when the group declares
the member dead because its heartbeat counter stood still on the observers'
own clocks - but the new owner would still find the lease busy. So the new
owner fences that lease out: a released operator lease with the fencing token
+ 1, journaled in the partition's state document with the reason. If the
member was only stalled rather than dead, its commit is refused (its token is
stale) and its batch is delivered again: duplicates, never a loss, the
at-least-once rule.

Only leases held by members the group has dropped are touched. A live
member's lease (a clean handover: it finishes its batch in flight and
releases), an operator's (a regroup in progress) and released ones are left
alone.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping

from dbtrigger.errors import CasConflictError, DbTriggerError
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.partitions")


def fence_dead_holders(
    store: CheckpointStore,
    keys: Mapping[str, str],
    gone: frozenset[str],
    *,
    actor: str,
    now: dt.datetime,
    poller: str,
) -> list[str]:
    """Fence the live leases held by ``gone`` members on the partitions ``keys``
    (partition id -> state document key); returns the partitions fenced.

    Never raises for the store: a lease that cannot be fenced frees itself
    when its TTL runs out, which is what happened before this existed.
    """
    fenced: list[str] = []
    for pid, key in keys.items():
        try:
            stored = store.read(key)
            if stored is None:
                continue
            doc = docmod.loads(stored.data)
            lease = ops.live_lease(doc, now)
            if lease is None or lease.owner_id not in gone:
                continue
            released = ops.release_lease(
                doc,
                now=now,
                actor=actor,
                reason=f"member {lease.owner_id} stopped heartbeating; partition taken over",
                force=True,
            )
            store.write(key, docmod.dumps(released), if_match=stored.etag)
        except CasConflictError:
            continue  # it moved meanwhile: its holder was alive after all, or it was fenced
        except DbTriggerError as exc:
            log.warning(
                "could not fence out the lease of a dead member on %s: %s (it frees itself "
                "when its lease TTL runs out)",
                key,
                exc,
                extra={"event": "fence_failed", "poller": poller, "partition": pid},
            )
            continue
        fenced.append(pid)
        log.info(
            "partition %s: fenced out the lease of %s, which stopped heartbeating",
            pid,
            lease.owner_id,
            extra={"event": "partition_lease_fenced", "poller": poller, "partition": pid},
        )
    return fenced
