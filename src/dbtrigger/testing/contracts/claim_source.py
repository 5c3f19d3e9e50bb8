"""The claim-source contract, run against every implementation and mode.

What :class:`~dbtrigger.QueueTrigger` relies on, and so what a claim source
must do (see :mod:`dbtrigger.queue.source`):

* **disjoint claims**: a row is held by one claim at a time; claims that run
  at once (threads, processes) never share a row, and every claimable row is
  taken by some claim;
* **attempts**: each claim of a row counts one attempt, the first being 1,
  except that an outcome shared by several rows is nobody's: a retry of a
  *group* (:class:`RetryItem` ``group``, a handler failure that fell on several
  rows) gives the attempt back and its rows wait together, claimed as one
  claim, never mixed with other rows; the half of an expired claim of several
  rows is claimed on the attempt it had;
* **fencing**: ``extend`` and ``settle`` act only on rows still held by the
  token, and say exactly which rows they changed - a claim that expired and
  was taken over changes nothing and learns so;
* **settle counts**: ``settle`` reports per outcome the keys it wrote
  (done, retried, dead); ``counts()`` then shows them;
* **expiry**: a claim neither settled nor extended within its visibility
  timeout gives its rows back, claimable again (its attempt counted when it
  held one row, given back when it held several, above);
  a retry's delay hides its row until the delay has passed; done and dead
  rows are never claimed again.

The suite works on a queue of rows with integer ids (the key column ``id``).
Subclass :class:`ClaimSourceContract` and provide a ``claim_harness``
fixture returning a :class:`ClaimSourceHarness`::

    class TestMyQueue(ClaimSourceContract):
        @pytest.fixture
        def claim_harness(self) -> MyHarness:
            return MyHarness(...)

Expiry is waited for, not slept: a claim is taken with a visibility of a
fraction of a second and the suite claims again every 50 ms (for up to 30 s)
until the rows come back, so a loaded machine is slower, never red.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import pytest

from dbtrigger.queue.layout import Claim, ClaimedRow
from dbtrigger.queue.operations import QueueCounts
from dbtrigger.queue.statements import DeadItem, Key, RetryItem, Settled
from dbtrigger.testing.contracts._threads import run_together

#: Visibility of a claim the suite lets expire, in seconds.
SHORT = 0.3
#: Visibility of a claim the suite keeps.
LONG = 600.0
#: Bound of every wait for an expiry.
PATIENCE = 30.0


@runtime_checkable
class ClaimPort(Protocol):
    """The claim source's side the trigger uses (a :class:`~dbtrigger.ClaimSource`)."""

    @property
    def name(self) -> str: ...

    def claim_batch(self, *, limit: int, token: str, worker: str, visibility: float) -> Claim: ...

    def extend(self, *, token: str, visibility: float) -> int: ...

    def settle(
        self,
        *,
        token: str,
        done: Sequence[Key],
        retry: Sequence[RetryItem] = (),
        dead: Sequence[DeadItem] = (),
    ) -> Settled: ...

    def counts(self) -> QueueCounts: ...

    def close(self) -> None: ...


@runtime_checkable
class ClaimSourceHarness(Protocol):
    """What the claim suite needs to drive one claim source."""

    def put(self, ids: Sequence[int]) -> None:
        """Queue new rows with these ids, claimable now once ``put`` returns."""
        ...

    def open(self) -> ClaimPort:
        """A claim source over the harness's queue (a new one on every call)."""
        ...


def token() -> str:
    return uuid.uuid4().hex


def ids_of(rows: Sequence[ClaimedRow]) -> list[int]:
    return sorted(int(r.pk["id"]) for r in rows)


def claim(source: ClaimPort, limit: int, *, visibility: float = LONG, worker: str = "w") -> Claim:
    return source.claim_batch(limit=limit, token=token(), worker=worker, visibility=visibility)


def claim_as(
    source: ClaimPort, tok: str, limit: int = 100, *, visibility: float = LONG
) -> list[ClaimedRow]:
    return source.claim_batch(limit=limit, token=tok, worker="w", visibility=visibility).rows


def claim_back(source: ClaimPort, wanted: set[int]) -> list[tuple[str, ClaimedRow]]:
    """Claim every 50 ms until the rows ``wanted`` have all come back (bounded by
    :data:`PATIENCE`); each row with the token that took it. The rows of an
    expired claim may come back over several claims (in halves)."""
    deadline = time.monotonic() + PATIENCE
    got: list[tuple[str, ClaimedRow]] = []
    while {int(r.pk["id"]) for _, r in got} < wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"rows {sorted(wanted)} did not come back within {PATIENCE:g}s")
        tok = token()
        rows = claim_as(source, tok)
        got += [(tok, r) for r in rows]
        if not rows:
            time.sleep(0.05)
    return got


class ClaimSourceContract:
    """The claim-source contract: inherit and define a ``claim_harness`` fixture."""

    @pytest.fixture
    def claim_harness(self) -> ClaimSourceHarness:
        raise NotImplementedError("define a claim_harness fixture returning a ClaimSourceHarness")

    @pytest.fixture
    def queue(self, claim_harness: ClaimSourceHarness) -> Any:
        source = claim_harness.open()
        yield source
        source.close()

    # --- identity -------------------------------------------------------------------

    def test_is_a_claim_port_and_an_empty_queue_claims_nothing(self, queue: ClaimPort) -> None:
        assert isinstance(queue, ClaimPort)
        assert queue.name
        got = claim(queue, 10)
        assert got.rows == []
        assert not got.more
        assert queue.counts().claimable_now == 0

    # --- disjoint claims ----------------------------------------------------------------

    def test_claims_take_each_ready_row_once_first_attempt_first(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put(range(1, 11))
        first = claim(queue, 4)
        assert len(first.rows) == 4
        assert first.more, "a full claim says claim again at once"
        rest = claim(queue, 100)
        assert len(rest.rows) == 6
        assert not set(ids_of(first.rows)) & set(ids_of(rest.rows))
        assert sorted(ids_of(first.rows) + ids_of(rest.rows)) == list(range(1, 11))
        assert {r.attempt for r in first.rows + rest.rows} == {1}
        keys = [r.key for r in first.rows + rest.rows]
        assert len(set(keys)) == 10, "a key (opaque to the trigger) names one row"
        assert claim(queue, 100).rows == [], "every row is held"
        assert queue.counts().claimable_now == 0

    def test_concurrent_claims_never_share_a_row(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put(range(1, 61))
        workers = [claim_harness.open() for _ in range(4)]
        taken: list[list[int]] = [[] for _ in workers]

        def work(index: int) -> None:
            source = workers[index]
            while True:
                tok = token()
                rows = claim_as(source, tok, 5)
                if not rows:
                    return
                taken[index].extend(ids_of(rows))
                settled = source.settle(token=tok, done=[r.key for r in rows])
                assert settled.done == {r.key for r in rows}

        errors = run_together(len(workers), work, timeout=PATIENCE * 4)
        for source in workers:
            source.close()
        assert errors == []
        everything = [i for part in taken for i in part]
        assert sorted(everything) == list(range(1, 61)), "each row claimed exactly once"
        assert queue.counts().by_status.get("done", 0) == 60

    # --- settle counts and fencing --------------------------------------------------------

    def test_settle_reports_exactly_what_it_wrote(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put(range(1, 7))
        tok = token()
        rows = {int(r.pk["id"]): r.key for r in claim_as(queue, tok, 5)}
        other = claim_as(queue, token())
        assert len(rows) == 5
        assert len(other) == 1, "the sixth row went to another claim"
        ids = sorted(rows)
        settled = queue.settle(
            token=tok,
            done=[rows[ids[0]], rows[ids[1]], other[0].key],  # the last is not this claim's
            retry=[RetryItem(rows[ids[2]], 3600, "later")],
            dead=[DeadItem(rows[ids[3]], "hopeless")],
        )
        assert settled.done == {rows[ids[0]], rows[ids[1]]}
        assert settled.retried == {rows[ids[2]]}
        assert settled.dead == {rows[ids[3]]}
        counts = queue.counts()
        assert counts.by_status.get("done", 0) == 2
        assert counts.by_status.get("dead", 0) == 1
        assert counts.delayed == 1
        assert counts.claimable_now == 0
        again = queue.settle(token=tok, done=[rows[ids[0]]], dead=[DeadItem(rows[ids[2]], "x")])
        assert (again.done, again.dead) == (frozenset(), frozenset()), "settled once only"

    def test_extend_and_settle_act_only_on_rows_the_token_holds(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put(range(1, 4))
        tok = token()
        held = claim_as(queue, tok)
        assert len(held) == 3
        assert queue.extend(token=tok, visibility=LONG) == 3
        assert queue.extend(token=token(), visibility=LONG) == 0, "an unknown token holds nothing"
        queue.settle(token=tok, done=[held[0].key])
        assert queue.extend(token=tok, visibility=LONG) == 2
        stranger = queue.settle(token=token(), done=[r.key for r in held])
        assert stranger.done == frozenset(), "another token cannot settle these rows"
        assert queue.counts().by_status.get("done", 0) == 1

    def test_an_expired_claim_is_taken_over_and_fenced_out(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put([1])
        stale = token()
        (row,) = claim_as(queue, stale, visibility=SHORT)
        assert row.attempt == 1
        ((fresh, again),) = claim_back(queue, {1})
        assert again.attempt == 2, "a claim that expired counted its attempt"
        assert queue.extend(token=stale, visibility=LONG) == 0
        lost = queue.settle(token=stale, done=[row.key])
        assert lost.done == frozenset(), "the stale claim writes nothing"
        won = queue.settle(token=fresh, done=[again.key])
        assert won.done == {again.key}
        assert queue.counts().by_status.get("done", 0) == 1

    # --- expiry, delays and terminal rows -----------------------------------------------------

    def test_extend_sets_the_claims_expiry(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put([1, 2])
        tok = token()
        assert len(claim_as(queue, tok, visibility=LONG)) == 2
        assert claim(queue, 10).rows == []
        # Extended to a short visibility, the claim expires then: the heartbeat's
        # extension is what keeps a claim, from now on.
        assert queue.extend(token=tok, visibility=SHORT) == 2
        back = claim_back(queue, {1, 2})
        assert sorted(int(r.pk["id"]) for _, r in back) == [1, 2], "each row once"
        assert {r.attempt for _, r in back} == {1}, "a shared expiry gives its attempt back"

    def test_a_retry_waits_its_delay_and_counts_an_attempt(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put([1, 2])
        tok = token()
        rows = {int(r.pk["id"]): r for r in claim_as(queue, tok)}
        queue.settle(
            token=tok,
            done=[],
            retry=[RetryItem(rows[1].key, 0, "now"), RetryItem(rows[2].key, 3600, "later")],
        )
        again = claim_as(queue, token())
        assert ids_of(again) == [1], "a zero delay is claimable at once, a long one hidden"
        assert again[0].attempt == 2
        assert queue.counts().delayed == 1

    def test_a_group_retry_waits_together_and_gives_its_attempt_back(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put([1, 2, 3, 4])
        tok = token()
        rows = {int(r.pk["id"]): r.key for r in claim_as(queue, tok)}
        split = [RetryItem(rows[i], 0, "shared", "g1" if i < 3 else "g2") for i in rows]
        settled = queue.settle(token=tok, done=[], retry=split)
        assert settled.retried == set(rows.values())
        claim_harness.put([5])
        claims = [claim_as(queue, token()) for _ in range(3)]
        assert sorted(ids_of(c) for c in claims) == [[1, 2], [3, 4], [5]], "groups never mixed"
        assert {r.attempt for c in claims for r in c} == {1}, "the shared failure not counted"

    def test_done_and_dead_rows_are_never_claimed_again(
        self, claim_harness: ClaimSourceHarness, queue: ClaimPort
    ) -> None:
        claim_harness.put([1, 2, 3])
        tok = token()
        rows = {int(r.pk["id"]): r.key for r in claim_as(queue, tok)}
        queue.settle(
            token=tok,
            done=[rows[1]],
            retry=[RetryItem(rows[3], 0, "again")],
            dead=[DeadItem(rows[2], "bad")],
        )
        claim_harness.put([4])
        later = claim_as(queue, token())
        assert ids_of(later) == [3, 4]
        assert claim(queue, 10).rows == []
        counts = queue.counts()
        assert counts.by_status.get("done", 0) == 1
        assert counts.by_status.get("dead", 0) == 1


__all__ = ["ClaimPort", "ClaimSourceContract", "ClaimSourceHarness"]
