"""A worker waiting on a lease says "lease held by X until T" with T the lease's
expiry as it stands on that tick: after its holder renews, the line (the runner's
first INFO, its DEBUG repeats and its "still ..." reminders alike) says the new
expiry, not the one first seen. A guard: a new user's walk reported the time as
stale; every path that says the line was found to read it afresh.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.runtime.quiet import QuietCadence
from dbtrigger.state import document as docmod
from dbtrigger.testing import MemorySource
from tests.test_event_outcomes import Clock


def test_the_lease_line_says_the_expiry_the_holder_renewed_to() -> None:
    store = InMemoryCheckpointStore()
    clock = Clock()
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    waiting = PollTrigger(
        name="orders", source=source, checkpoint_store=store, owner_id="standby", clock=clock
    )
    assert waiting.tick(lambda events: None) == 1  # a document, its lease released

    def renewed_until(seconds: float) -> str:
        """The holder "web-2" renews: its lease now ends ``seconds`` from now."""
        current = store.read("orders")
        assert current is not None
        doc = docmod.loads(current.data)
        assert doc.lease is not None
        lease = dataclasses.replace(
            doc.lease,
            owner_id="web-2",
            released=False,
            heartbeat_at=clock(),
            expires_at=clock() + dt.timedelta(seconds=seconds),
        )
        store.write(
            "orders", docmod.dumps(dataclasses.replace(doc, lease=lease)), if_match=current.etag
        )
        return f"{lease.expires_at:%Y-%m-%dT%H:%M:%SZ}"

    cadence = QuietCadence(every=60, clock=lambda: clock().timestamp())
    seen = []
    for _ in range(4):
        until = renewed_until(100)
        result = waiting.tick_result(lambda events: None)
        assert result.outcome == "lease_busy"
        level, text, fields = cadence.line(result, 5)
        assert f"lease held by web-2 until {until}" in text, text
        assert fields["lease_until"] == (clock() + dt.timedelta(seconds=100)).isoformat()
        seen.append((level, until))
        clock.advance(40)  # past the first T: the holder renewed twice meanwhile
    assert len({until for _, until in seen}) == 4
