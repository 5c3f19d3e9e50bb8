"""What a claim says about the rows it took from a claim that expired without an outcome.

A worker that dies holding a claim (``os._exit``, an OOM kill, a segfault, a
hang past the visibility timeout) writes nothing; the next claim of those
rows is the first to know (:mod:`dbtrigger.queue.pick`). So each such death
is said there, once, at WARNING: ``queue_claim_bisected`` when the expired
claim held several rows (it is halved), ``queue_claim_expired`` when it held
one row alone (claimed alone again, an attempt counted). The claim that finds
such a row has had ``max_attempts`` attempts makes it ``dead`` without a
handler call and says so at ERROR (``queue_crash_loop``): a row no worker
survives needs a person, as the poller's ``crash_loop`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dbtrigger.queue.layout import Claim, ClaimedRow


def say_expired(
    emit: Callable[..., None],
    name: str,
    token: str,
    claim: Claim,
    given_up: Sequence[ClaimedRow],
    max_attempts: int,
) -> None:
    """One record for each claim expired under a dead (or hung) worker that this
    claim took rows of; ``given_up``: those rows it makes dead for it."""
    if claim.bisected is not None:
        emit(
            "queue_claim_bisected",
            "queue %s: a claim of %d row(s) expired without an outcome (its worker "
            "crashed or hung); claiming %d of them as %s and the rest next, halving "
            "again until the row that kills its worker is alone",
            name,
            claim.bisected[0],
            claim.bisected[1],
            token,
            batch_id=token,
            rows=claim.bisected[1],
        )
    for row in claim.rows:
        if not row.isolated:
            continue
        if row in given_up:
            emit(
                "queue_crash_loop",
                "queue %s: row %s is dead without a handler call: its claim expired "
                "without an outcome %d time(s) while it was the only row in it (max_attempts="
                "%d): each worker holding it crashed, was killed or hung past the visibility "
                "timeout. Find why in the handler's own logs for this row; once fixed, run it "
                "again with: dbtrigger queue retry --dead --reason TEXT --yes (and the "
                "queue's --url/--table)",
                name,
                row.key,
                row.attempt - 1,
                max_attempts,
                batch_id=token,
            )
            continue
        emit(
            "queue_claim_expired",
            "queue %s: the claim of row %s expired again without an outcome while it was "
            "the only row in it (its worker crashed, was killed or hung); claimed alone as "
            "%s, attempt %d of max_attempts=%d (after those, a claim of it that expires "
            "makes it dead without a handler call)",
            name,
            row.key,
            token,
            row.attempt,
            max_attempts,
            batch_id=token,
        )


__all__ = ["say_expired"]
