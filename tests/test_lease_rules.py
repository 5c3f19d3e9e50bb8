"""The pure lease and checkpoint transitions, table by table, with no fakes."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest

from dbtrigger import LostLeaseError
from dbtrigger.cursor import Position
from dbtrigger.errors import FingerprintMismatchError
from dbtrigger.state import lease as L
from dbtrigger.state.document import Lease, StateDocument

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TTL = dt.timedelta(seconds=120)
S = dt.timedelta(seconds=1)


def doc_with(lease: Lease | None, fingerprint: str = "fp") -> StateDocument:
    return StateDocument(poller_name="p", source_fingerprint=fingerprint, lease=lease)


def held(
    owner: str = "a", token: int = 5, expires: dt.datetime = T0 + TTL, released: bool = False
) -> Lease:
    return Lease(owner, token, T0, T0, expires, released)


def acquire(
    doc: StateDocument | None, owner: str, now: dt.datetime, ttl: dt.timedelta = TTL
) -> L.Acquired | L.Busy:
    return L.decide_acquire(doc, poller="p", fingerprint="fp", owner=owner, now=now, ttl=ttl)


@pytest.mark.parametrize(
    ("ttl", "grace"),
    [
        (dt.timedelta(seconds=120), dt.timedelta(seconds=5)),
        (dt.timedelta(seconds=10), dt.timedelta(seconds=5)),
        (dt.timedelta(seconds=6), dt.timedelta(seconds=3)),
        (dt.timedelta(seconds=1), dt.timedelta(milliseconds=500)),
    ],
)
def test_grace_window_is_half_ttl_capped_at_five_seconds(
    ttl: dt.timedelta, grace: dt.timedelta
) -> None:
    assert L.grace_window(ttl) == grace


# (description, lease in the document, who asks, when, expected: token acquired or "busy")
ACQUIRE_TABLE = [
    ("no document yet", None, "b", T0, 1),
    ("document without lease", "no-lease", "b", T0, 1),
    ("live lease, other owner", held(), "b", T0 + 10 * S, "busy"),
    ("live lease, same owner (overlapping tick)", held(), "a", T0 + 10 * S, "busy"),
    (
        "live lease, one microsecond before expiry",
        held(),
        "b",
        T0 + TTL - dt.timedelta(microseconds=1),
        "busy",
    ),
    ("expired, other owner, inside grace", held(), "b", T0 + TTL + 4 * S, "busy"),
    ("expired, other owner, at grace end", held(), "b", T0 + TTL + 5 * S, 6),
    ("expired, same owner, no grace needed", held(), "a", T0 + TTL, 6),
    ("released, other owner, immediately", held(released=True, expires=T0), "b", T0, 6),
    ("released, same owner, immediately", held(released=True, expires=T0), "a", T0, 6),
]


@pytest.mark.parametrize(
    ("why", "lease", "owner", "now", "expected"), ACQUIRE_TABLE, ids=[r[0] for r in ACQUIRE_TABLE]
)
def test_acquire_table(
    why: str, lease: Lease | str | None, owner: str, now: dt.datetime, expected: int | str
) -> None:
    doc = None if lease is None else doc_with(None if lease == "no-lease" else lease)  # type: ignore[arg-type]
    decision = acquire(doc, owner, now)
    if expected == "busy":
        assert isinstance(decision, L.Busy), why
        assert decision.holder == "a"
        return
    assert isinstance(decision, L.Acquired), why
    assert decision.fencing_token == expected
    new = decision.document.lease
    assert new is not None
    assert (new.owner_id, new.fencing_token, new.released) == (owner, expected, False)
    assert (new.acquired_at, new.heartbeat_at, new.expires_at) == (now, now, now + TTL)


def test_acquire_keeps_checkpoint_and_fingerprint() -> None:
    doc = replace(doc_with(held(released=True)), checkpoint=None)
    decision = acquire(doc, "b", T0)
    assert isinstance(decision, L.Acquired)
    assert decision.document.source_fingerprint == "fp"
    assert decision.document.poller_name == "p"


def test_busy_says_when_it_frees_up() -> None:
    live = acquire(doc_with(held()), "b", T0)
    assert isinstance(live, L.Busy)
    assert live.free_at == T0 + TTL
    grace = acquire(doc_with(held()), "b", T0 + TTL + S)
    assert isinstance(grace, L.Busy)
    assert grace.free_at == T0 + TTL + 5 * S


def test_fingerprint_check() -> None:
    L.check_fingerprint(doc_with(None), "fp")
    with pytest.raises(FingerprintMismatchError, match="source definition changed") as info:
        L.check_fingerprint(doc_with(None, fingerprint="sha256:old"), "sha256:new")
    assert info.value.fields["stored_fingerprint"] == "sha256:old"
    assert info.value.fields["configured_fingerprint"] == "sha256:new"


POS = Position(10, {"id": 3})

# (description, lease in the document, committer, token, expected)
COMMIT_TABLE = [
    ("holder commits", held(), "a", 5, "ok"),
    (
        "holder commits after its lease expired, nobody took over",
        held(expires=T0 - S),
        "a",
        5,
        "ok",
    ),
    ("other owner", held(), "b", 5, "lost"),
    ("stale token, same owner", held(token=6), "a", 5, "lost"),
    ("released lease", held(released=True), "a", 5, "lost"),
    ("no lease", None, "a", 5, "lost"),
]


@pytest.mark.parametrize(
    ("why", "lease", "owner", "token", "expected"), COMMIT_TABLE, ids=[r[0] for r in COMMIT_TABLE]
)
@pytest.mark.parametrize("release", [False, True])
def test_commit_table(
    why: str, lease: Lease | None, owner: str, token: int, expected: str, release: bool
) -> None:
    doc = doc_with(lease)
    now = T0 + 30 * S

    def commit() -> StateDocument:
        return L.decide_commit(
            doc,
            owner=owner,
            token=token,
            position=POS,
            batch_id="b1",
            row_count=3,
            now=now,
            ttl=TTL,
            release=release,
            journal_entry={"type": "commit"},
        )

    if expected == "lost":
        with pytest.raises(LostLeaseError):
            commit()
        return
    new = commit()
    assert new.checkpoint is not None
    assert new.checkpoint.position == POS
    assert new.checkpoint.last_successful_batch_id == "b1"
    assert new.checkpoint.row_count == 3
    assert new.checkpoint.updated_at == now
    assert new.lease is not None
    assert new.lease.fencing_token == token
    assert new.lease.released is release
    assert new.lease.expires_at == (now if release else now + TTL)
    assert new.journal[-1] == {"type": "commit"}
    assert new.failure is None


def test_commit_clears_failure_record() -> None:
    doc = L.decide_failure(doc_with(held()), owner="a", token=5, now=T0, error="boom", batch_id="b")
    assert doc.failure is not None
    reacquired = acquire(doc, "a", T0)
    assert isinstance(reacquired, L.Acquired)
    committed = L.decide_commit(
        reacquired.document,
        owner="a",
        token=6,
        position=POS,
        batch_id="b2",
        row_count=1,
        now=T0,
        ttl=TTL,
        release=True,
    )
    assert committed.failure is None


def test_failure_records_count_attempts_and_release() -> None:
    doc = doc_with(held())
    first = L.decide_failure(doc, owner="a", token=5, now=T0, error="E1", batch_id="b1")
    assert first.failure is not None
    assert (first.failure.attempts, first.failure.first_failed_at, first.failure.last_error) == (
        1,
        T0,
        "E1",
    )
    assert first.lease is not None
    assert first.lease.released
    again = acquire(first, "b", T0 + S)
    assert isinstance(again, L.Acquired)
    second = L.decide_failure(
        again.document, owner="b", token=6, now=T0 + 2 * S, error="E2", batch_id="b2"
    )
    assert second.failure is not None
    assert second.failure.attempts == 2
    assert second.failure.first_failed_at == T0
    assert second.failure.last_failed_at == T0 + 2 * S
    with pytest.raises(LostLeaseError):
        L.decide_failure(second, owner="b", token=6, now=T0, error="E3", batch_id=None)


def test_heartbeat_extends_only_for_the_holder() -> None:
    doc = doc_with(held())
    beat = L.decide_heartbeat(doc, owner="a", token=5, now=T0 + 50 * S, ttl=TTL)
    assert beat.lease is not None
    assert beat.lease.expires_at == T0 + 50 * S + TTL
    assert beat.lease.heartbeat_at == T0 + 50 * S
    assert beat.lease.acquired_at == T0
    with pytest.raises(LostLeaseError):
        L.decide_heartbeat(doc, owner="b", token=5, now=T0, ttl=TTL)
    with pytest.raises(LostLeaseError):
        L.decide_heartbeat(doc, owner="a", token=4, now=T0, ttl=TTL)


def test_release_only_by_holder() -> None:
    doc = doc_with(held())
    released = L.decide_release(doc, owner="a", token=5, now=T0 + S)
    assert released is not None
    assert released.lease is not None
    assert released.lease.released
    assert released.lease.expires_at == T0 + S
    assert L.decide_release(doc, owner="b", token=5, now=T0) is None
    assert L.decide_release(doc, owner="a", token=4, now=T0) is None
    assert L.decide_release(released, owner="a", token=5, now=T0) is None


def test_fencing_token_strictly_increases_across_owners() -> None:
    doc: StateDocument | None = None
    tokens = []
    now = T0
    for owner in ["a", "b", "a", "c", "c"]:
        decision = acquire(doc, owner, now)
        assert isinstance(decision, L.Acquired)
        tokens.append(decision.fencing_token)
        doc = L.decide_release(
            decision.document, owner=owner, token=decision.fencing_token, now=now
        )
        now += S
    assert tokens == [1, 2, 3, 4, 5]


def test_describe_lease() -> None:
    assert L.describe_lease(None, T0) == "no lease"
    assert L.describe_lease(held(), T0).startswith("live, held by a (token 5)")
    assert L.describe_lease(held(), T0 + TTL).startswith("expired")
    assert L.describe_lease(held(released=True), T0).startswith("released by a")
