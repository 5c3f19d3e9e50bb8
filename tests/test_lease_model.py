"""The lease/checkpoint protocol against a model small enough to be obviously right.

Hypothesis drives several owners through random sequences of acquire,
heartbeat, commit, release, fail, crash and clock moves, against the real
pure transitions, the real :class:`LeaseSession` (CAS loop, ambiguity
resolution, retries) and an :class:`InMemoryCheckpointStore` behind a
:class:`FaultyStore` that injects CAS conflicts, timeouts (landed or not) and
outages into the owners' writes. After every step:

* never two live holders: at most one owner believes it holds an unexpired lease;
* the fencing token strictly increases with every acquisition;
* the checkpoint never regresses;
* a stale owner's commit (or heartbeat, release, failure record) is always
  rejected and leaves the stored document untouched;
* the stored document equals the model.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dbtrigger import CommitError, InMemoryCheckpointStore, LostLeaseError
from dbtrigger.cursor import Position
from dbtrigger.faults import Fault, FaultPlan, FaultyStore
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.document import StateDocument

KEY = "model"
FINGERPRINT = "sha256:model"
OWNERS = ("a", "b", "c")
TTL = dt.timedelta(seconds=10)
GRACE = leasemod.grace_window(TTL)
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
RETRY = RetryPolicy(attempts=3, sleep=lambda _: None)


@dataclass
class Belief:
    """What one session thinks it holds, from its own last successful write.

    An owner can have several sessions (overlapping ticks in one process, or a
    session left over from before it re-acquired), so sessions, not owners,
    are what the rules pick from.
    """

    owner: str
    session: LeaseSession
    expires_at: dt.datetime


class LeaseModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.inner = InMemoryCheckpointStore()
        self.plan = FaultPlan()
        self.store = FaultyStore(self.inner, self.plan)
        self.now = T0
        self.beliefs: list[Belief] = []
        # the model
        self.token = 0
        self.holder: str | None = None
        self.expires_at = T0
        self.released = True
        self.checkpoint = 0
        self.attempts = 0
        self.acquisitions: list[int] = []
        self.checkpoints_seen: list[int] = [0]

    # --- helpers --------------------------------------------------------------------

    def stored(self) -> tuple[StateDocument | None, str | None, bytes | None]:
        got = self.inner.read(KEY)
        if got is None:
            return None, None, None
        return docmod.loads(got.data), got.etag, got.data

    def pick(self, index: int) -> Belief | None:
        return self.beliefs[index % len(self.beliefs)] if self.beliefs else None

    def current(self, belief: Belief) -> bool:
        """The model's view: may this session still write?"""
        return (
            self.holder == belief.owner and belief.session.token == self.token and not self.released
        )

    def attempt(self, belief: Belief, transition: leasemod.Transition, what: str) -> bool:
        """Run ``transition`` through the session; check accept/reject against the model."""
        expected = self.current(belief)
        _, _, before = self.stored()
        try:
            belief.session.update(transition, what=what)
        except LostLeaseError:
            assert not expected, f"{what} by the current holder {belief.owner} was refused"
            assert self.stored()[2] == before, f"a refused {what} changed the document"
            self.beliefs.remove(belief)
            return False
        except CommitError:
            # Injected faults outlasted the retries: nothing landed, the owner may try again.
            assert self.stored()[2] == before, f"a failed {what} changed the document"
            return False
        assert expected, (
            f"stale {what} by {belief.owner} (token {belief.session.token}) accepted; "
            f"the lease is {self.holder} token {self.token}"
        )
        return True

    # --- rules ------------------------------------------------------------------------

    @rule(owner=st.sampled_from(OWNERS))
    def acquire(self, owner: str) -> None:
        doc, etag, _ = self.stored()
        decision = leasemod.decide_acquire(
            doc, poller=KEY, fingerprint=FINGERPRINT, owner=owner, now=self.now, ttl=TTL
        )
        free_at = self.expires_at if self.holder == owner else self.expires_at + GRACE
        model_free = self.released or self.now >= free_at
        assert isinstance(decision, leasemod.Acquired) == model_free, (decision, self.holder)
        if not isinstance(decision, leasemod.Acquired):
            return
        new_etag = self.inner.write(KEY, docmod.dumps(decision.document), if_match=etag)
        assert decision.fencing_token == self.token + 1, "fencing token did not step up by one"
        self.token = decision.fencing_token
        self.acquisitions.append(self.token)
        self.holder, self.released = owner, False
        self.expires_at = self.now + TTL
        session = LeaseSession(
            self.store,
            KEY,
            decision.document,
            new_etag,
            owner=owner,
            token=self.token,
            retry=RETRY,
        )
        self.beliefs.append(Belief(owner, session, self.expires_at))

    @rule(index=st.integers(0, 7))
    def heartbeat(self, index: int) -> None:
        belief = self.pick(index)
        if belief is None:
            return
        owner, token, now = belief.owner, belief.session.token, self.now
        if self.attempt(
            belief,
            lambda d: leasemod.decide_heartbeat(d, owner=owner, token=token, now=now, ttl=TTL),
            "heartbeat",
        ):
            self.expires_at = belief.expires_at = now + TTL

    @rule(index=st.integers(0, 7), advance=st.integers(1, 5), release=st.booleans())
    def commit(self, index: int, advance: int, release: bool) -> None:
        belief = self.pick(index)
        if belief is None:
            return
        owner, token, now = belief.owner, belief.session.token, self.now
        # A session advances from the checkpoint it last saw (a stale one saw an old one).
        target = int(belief.session.document.position.cursor or 0) + advance
        ok = self.attempt(
            belief,
            lambda d: leasemod.decide_commit(
                d,
                owner=owner,
                token=token,
                position=Position(cursor=target, pk={"id": target}),
                batch_id=f"b{target}",
                row_count=advance,
                now=now,
                ttl=TTL,
                release=release,
            ),
            "commit",
        )
        if ok:
            assert target > self.checkpoint
            self.checkpoint = target
            self.attempts = 0
            self.expires_at = belief.expires_at = now if release else now + TTL
            self.released = release
            if release:
                self.beliefs.remove(belief)

    @rule(index=st.integers(0, 7))
    def release(self, index: int) -> None:
        belief = self.pick(index)
        if belief is None:
            return
        owner, token, now = belief.owner, belief.session.token, self.now

        def transition(doc: StateDocument) -> StateDocument:
            out = leasemod.decide_release(doc, owner=owner, token=token, now=now)
            if out is None:
                raise LostLeaseError("not ours")
            return out

        if self.attempt(belief, transition, "release"):
            self.released, self.expires_at = True, now
            self.beliefs.remove(belief)

    @rule(index=st.integers(0, 7))
    def fail(self, index: int) -> None:
        belief = self.pick(index)
        if belief is None:
            return
        owner, token, now = belief.owner, belief.session.token, self.now
        if self.attempt(
            belief,
            lambda d: leasemod.decide_failure(
                d, owner=owner, token=token, now=now, error="boom", batch_id="b"
            ),
            "failure record",
        ):
            self.released, self.expires_at = True, now
            self.attempts += 1
            self.beliefs.remove(belief)

    @rule(index=st.integers(0, 7))
    def crash(self, index: int) -> None:
        belief = self.pick(index)
        if belief is not None:
            self.beliefs.remove(belief)  # the process is gone; its lease just expires

    @rule(seconds=st.sampled_from([0.5, 2, 4, 6, 10, 16]))
    def clock_moves(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)

    @rule(
        fault=st.sampled_from(
            [Fault.CONFLICT, Fault.AMBIGUOUS_LANDED, Fault.AMBIGUOUS_LOST, Fault.UNAVAILABLE]
        )
    )
    def storage_misbehaves_on_the_next_write(self, fault: Fault) -> None:
        self.plan.add("write", fault)

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def never_two_live_holders(self) -> None:
        live = [(b.owner, b.session.token) for b in self.beliefs if self.now < b.expires_at]
        assert len(live) <= 1, f"live holders {live} at {self.now}"

    @invariant()
    def tokens_strictly_increase(self) -> None:
        assert self.acquisitions == sorted(set(self.acquisitions))

    @invariant()
    def checkpoint_never_regresses(self) -> None:
        self.checkpoints_seen.append(self.checkpoint)
        assert self.checkpoints_seen == sorted(self.checkpoints_seen)

    @invariant()
    def store_matches_model(self) -> None:
        doc, _, _ = self.stored()
        if doc is None:
            assert self.token == 0
            return
        assert doc.lease is not None
        assert (doc.lease.owner_id, doc.lease.fencing_token) == (self.holder, self.token)
        assert doc.lease.released == self.released
        assert doc.lease.expires_at == self.expires_at
        stored_cp = int(doc.position.cursor) if doc.checkpoint is not None else 0
        assert stored_cp == self.checkpoint
        assert (doc.failure.attempts if doc.failure else 0) == self.attempts


LeaseModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLeaseModel = LeaseModel.TestCase
