"""Clock skew: a lease written by a clock running ahead, table by table (pure rules),
then end to end through the poller on a real store.

The case: an owner whose clock runs an hour ahead takes the lease and dies.
Its ``expires_at`` is an hour past ours plus the TTL; believed as written, it
would lock every other instance out for that hour.
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as L
from dbtrigger.state.document import Lease, StateDocument
from tests.databases import TestDatabase

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TTL = dt.timedelta(seconds=120)
S = dt.timedelta(seconds=1)
HOUR = dt.timedelta(hours=1)
GRACE = L.grace_window(TTL)


def lease_written_at(clock: dt.datetime, owner: str = "ahead", ttl: dt.timedelta = TTL) -> Lease:
    """The lease an owner writes when its own clock reads ``clock``."""
    return Lease(owner, 7, clock, clock, clock + ttl)


def decide(
    lease: Lease, now: dt.datetime, first_seen: dt.datetime | None, owner: str = "b"
) -> L.Acquired | L.Busy:
    doc = StateDocument(poller_name="p", source_fingerprint="fp", lease=lease)
    return L.decide_acquire(
        doc, poller="p", fingerprint="fp", owner=owner, now=now, ttl=TTL, first_seen=first_seen
    )


# (description, lease, our now, first seen, expected: "busy" / "acquired", free_at if busy)
SKEW_TABLE = [
    (
        "honest owner, live: busy until its expiry",
        lease_written_at(T0),
        T0 + 10 * S,
        T0,
        "busy",
        T0 + TTL,
    ),
    (
        "honest owner 20 s ahead (ordinary skew): its expiry is believed",
        lease_written_at(T0 + 20 * S),
        T0,
        T0,
        "busy",
        T0 + 20 * S + TTL,
    ),
    (
        "owner an hour ahead, just seen: busy for its span from now, not for an hour",
        lease_written_at(T0 + HOUR),
        T0,
        T0,
        "busy",
        T0 + TTL,
    ),
    (
        "owner an hour ahead, unchanged for its span: grace window",
        lease_written_at(T0 + HOUR),
        T0 + TTL + S,
        T0,
        "busy",
        T0 + TTL + GRACE,
    ),
    (
        "owner an hour ahead, unchanged for span + grace: taken over",
        lease_written_at(T0 + HOUR),
        T0 + TTL + GRACE,
        T0,
        "acquired",
        None,
    ),
    (
        "owner an hour ahead, no first_seen: counts from now (never earlier)",
        lease_written_at(T0 + HOUR),
        T0 + TTL + GRACE,
        None,
        "busy",
        T0 + TTL + GRACE + TTL,
    ),
    (
        "a first_seen in the future is not trusted beyond now",
        lease_written_at(T0 + HOUR),
        T0,
        T0 + HOUR,
        "busy",
        T0 + TTL,
    ),
    (
        "a long-TTL owner an hour ahead: its own span, not ours",
        lease_written_at(T0 + HOUR, ttl=10 * TTL),
        T0 + 2 * TTL,
        T0,
        "busy",
        T0 + 10 * TTL,
    ),
]


@pytest.mark.parametrize(
    ("lease", "now", "first_seen", "expected", "free_at"),
    [pytest.param(*row[1:], id=row[0]) for row in SKEW_TABLE],
)
def test_skewed_expiry_table(
    lease: Lease,
    now: dt.datetime,
    first_seen: dt.datetime | None,
    expected: str,
    free_at: dt.datetime | None,
) -> None:
    decision = decide(lease, now, first_seen)
    if expected == "acquired":
        assert isinstance(decision, L.Acquired)
        assert decision.fencing_token == lease.fencing_token + 1
        assert decision.document.lease is not None
        assert decision.document.lease.expires_at == now + TTL
        return
    assert isinstance(decision, L.Busy)
    assert decision.free_at == free_at


def test_busy_reports_the_holders_clock_lead() -> None:
    skewed = decide(lease_written_at(T0 + HOUR), T0, T0)
    assert isinstance(skewed, L.Busy)
    assert skewed.skew == HOUR
    honest = decide(lease_written_at(T0 + 20 * S), T0, T0)
    assert isinstance(honest, L.Busy)
    assert honest.skew is None


def test_the_owner_itself_gets_no_grace_and_released_leases_are_free() -> None:
    own = decide(lease_written_at(T0 + HOUR, owner="b"), T0 + TTL, T0, owner="b")
    assert isinstance(own, L.Acquired)
    released = Lease("ahead", 7, T0 + HOUR, T0 + HOUR, T0 + HOUR, released=True)
    assert isinstance(decide(released, T0, T0), L.Acquired)


# --- end to end ---------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


def test_a_dead_owner_with_a_clock_an_hour_ahead_locks_the_poller_for_a_ttl_not_an_hour(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    metadata.create_all(sqlite_db.engine)
    with sqlite_db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "seq": i} for i in range(1, 4)])
    store = FileCheckpointStore(tmp_path)
    clock = Clock(dt.datetime.now(UTC))
    source = SqlAlchemySource(
        url=sqlite_db.url, table="events", cursor_column="seq", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        lease_ttl_seconds=120,
        clock=clock,
    )
    # The dead owner's lease, written by a clock an hour ahead of ours.
    dead = StateDocument(
        poller_name="orders",
        source_fingerprint=source.fingerprint(),
        lease=lease_written_at(clock.now + HOUR, owner="host-ahead"),
    )
    store.write("orders", docmod.dumps(dead), if_match=None)

    seen: list[RowChange] = []
    caplog.set_level(logging.WARNING)
    assert trigger.tick(seen.extend) == 0
    warnings = [r for r in caplog.records if getattr(r, "event", "") == "clock_skew_suspected"]
    assert len(warnings) == 1
    assert "host-ahead" in warnings[0].getMessage()

    clock.now += dt.timedelta(seconds=60)
    assert trigger.tick(seen.extend) == 0  # still within the lease's span
    clock.now += dt.timedelta(seconds=66)  # span (120 s) + grace (5 s) since first seen
    assert trigger.tick(seen.extend) == 3
    assert [e.pk["id"] for e in seen] == [1, 2, 3]
    warnings = [r for r in caplog.records if getattr(r, "event", "") == "clock_skew_suspected"]
    assert len(warnings) == 1  # once per lease, not on every tick
