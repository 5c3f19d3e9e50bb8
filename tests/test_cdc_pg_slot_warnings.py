"""A running PgLogicalSource says in the worker's log when its slot holds too much WAL
or is about to be invalidated.

Both were told only by ``dbtrigger check`` and the ``cdc_*`` gauges: a worker back
after a long stop, or falling behind, logged nothing until its slot was lost.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.cdc import PgLogicalSource, health, pg_admin, pg_setup
from tests.cdc_servers import CdcDatabase


def test_a_slot_that_retains_too_much_or_is_unreserved_is_warned_about_once_each(
    cdc_db: CdcDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(health, "REPORT_SECONDS", 0.0)  # measure at every read
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=PgLogicalSource(cdc_db.url, ["t"], snapshot="never"),
        checkpoint_store=InMemoryCheckpointStore(),
    )

    def warned() -> list[str]:
        kinds = ("cdc_wal_retained", "cdc_slot_unreserved")
        events = [getattr(r, "event", None) for r in caplog.records]
        return [str(e) for e in events if e in kinds]

    def read() -> None:
        trigger.drain(lambda events: None)

    caplog.set_level(logging.WARNING, logger="dbtrigger.cdc")
    read()
    assert warned() == []
    monkeypatch.setattr(pg_admin, "RETAINED_WARNING", -1)
    read()
    read()
    assert warned() == ["cdc_wal_retained"]
    assert "is the poller running and keeping up?" in caplog.records[-1].getMessage()
    real = pg_setup.slot_state

    def unreserved(conn: object, slot: str) -> pg_setup.SlotState | None:
        state = real(conn, slot)  # type: ignore[arg-type]
        return None if state is None else dataclasses.replace(state, wal_status="unreserved")

    monkeypatch.setattr(pg_setup, "slot_state", unreserved)
    read()
    read()
    assert warned() == ["cdc_wal_retained", "cdc_slot_unreserved"]
    assert "about to remove WAL the slot needs" in caplog.records[-1].getMessage()
    monkeypatch.setattr(pg_admin, "RETAINED_WARNING", 2**62)  # cleared...
    read()
    monkeypatch.setattr(pg_admin, "RETAINED_WARNING", -1)  # ... and back: told again
    read()
    trigger.source.close()
    assert warned() == ["cdc_wal_retained", "cdc_slot_unreserved", "cdc_wal_retained"]
