"""A replication slot dropped and created again by hand under the poller's slot name.

The new slot starts at the server's WAL position of its creation, so what was
committed between the drop and the creation was never in any slot this poller
read. Read on, it would be skipped without a word; the source records how far
it ever let the slot advance (written before each advance) and refuses a slot
whose confirmed position is past that.
"""

from __future__ import annotations

from typing import Any

import pytest

from dbtrigger import PollTrigger, RowChange
from dbtrigger.cdc import PgLogicalSource
from dbtrigger.cdc.pgoutput import parse_lsn
from dbtrigger.errors import ConfigurationError, SlotLostError
from tests.cdc_servers import CdcDatabase, drop_slot
from tests.test_cdc_pg import poller as cdc_poller
from tests.test_cdc_pg import wait_for


def poller(db: CdcDatabase, **kw: Any) -> tuple[PollTrigger, PgLogicalSource]:
    """test_cdc_pg's poller on table ``t``, its stream read returning at once."""
    return cdc_poller(db, ["t"], stream_wait_seconds=0, **kw)


def drain(trigger: PollTrigger) -> list[int]:
    got: list[RowChange] = []
    trigger.drain(got.extend)
    return [e.pk["id"] for e in got]


def recreate_by_hand(db: CdcDatabase, slot: str, skipped: int = 2) -> None:
    with db.connect() as conn:
        # A stream's walsender outlives its closed connection for a moment: drop when free.
        drop_slot(conn, slot)
        conn.execute("INSERT INTO t VALUES (%s)", (skipped,))  # in no slot: the one skipped
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))


@pytest.mark.parametrize(("mode", "restarted"), [("poll", True), ("poll", False), ("stream", True)])
def test_a_slot_created_again_by_hand_is_a_slot_lost_error_not_a_skip(
    cdc_db: CdcDatabase, mode: str, restarted: bool
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    trigger, source = poller(cdc_db, mode=mode)
    assert drain(trigger) == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    assert drain(trigger) == [1]
    if restarted:
        source.close()  # the worker stops; a new process makes the first contact
    recreate_by_hand(cdc_db, source.slot)
    cdc_db.execute("INSERT INTO t VALUES (3)")
    with pytest.raises(SlotLostError, match=r"created again.*cdc recreate") as caught:
        drain(trigger)
    assert "poller" in str(caught.value)
    status = source.admin().status()
    assert not status["healthy"]
    assert "created again by hand" in status["warnings"][0]
    # What the error says to run brings back what the hand-made slot skipped.
    source.admin().recreate(snapshot=True)
    assert sorted(drain(trigger)) == [1, 2, 3]
    source.close()


def test_a_poller_that_caught_up_restarts_without_an_error(cdc_db: CdcDatabase) -> None:
    # The slot is advanced past the checkpoint (WAL of other tables, heartbeats): that is
    # this poller's own doing, recorded before the advance, never taken for a new slot.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE other (v int)")
    trigger, source = poller(cdc_db)
    assert drain(trigger) == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    got: list[RowChange] = []
    trigger.drain(got.extend)
    commit = parse_lsn(str(got[0].cursor).split("#")[0])
    cdc_db.execute("INSERT INTO other SELECT generate_series(1, 100)")
    assert drain(trigger) == []
    confirmed = cdc_db.scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        (source.slot,),
    )
    assert parse_lsn(confirmed) > commit  # ahead of the checkpoint, by this poller
    source.close()
    cdc_db.execute("INSERT INTO t VALUES (2)")
    assert drain(trigger) == [2]
    source.close()


def test_a_stream_moved_on_by_keepalives_restarts_without_an_error(cdc_db: CdcDatabase) -> None:
    # psycopg2 moves the flush position it reports to a keepalive's WAL end by itself
    # (when everything received was confirmed): the slot then confirms WAL this poller
    # never released explicitly. The stream records that bound before any feedback.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE other (v int)")
    trigger, source = poller(cdc_db, mode="stream")
    assert drain(trigger) == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    assert drain(trigger) == [1]
    for _ in range(5):  # WAL of another table: keepalives only, then a fetch's reply
        cdc_db.execute("INSERT INTO other SELECT generate_series(1, 100)")
        assert drain(trigger) == []
    source.close()
    confirmed = parse_lsn(
        cdc_db.scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (source.slot,),
        )
    )
    bound = parse_lsn(
        cdc_db.scalar(
            "SELECT released_lsn::text FROM dbtrigger_cdc_slots WHERE slot = %s", (source.slot,)
        )
    )
    assert confirmed <= bound
    cdc_db.execute("INSERT INTO t VALUES (2)")
    assert drain(trigger) == [2]
    source.close()


def test_a_control_table_of_an_earlier_version_gains_the_bound_in_place(
    cdc_db: CdcDatabase,
) -> None:
    # Made before released_lsn existed: the dry run lists the ALTER, the next start adds
    # the column, records the slot's position as the bound, and delivery goes on.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    trigger, source = poller(cdc_db)
    assert drain(trigger) == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    assert drain(trigger) == [1]
    source.close()
    cdc_db.execute("ALTER TABLE dbtrigger_cdc_slots DROP COLUMN released_lsn")
    plan = source.admin().plan()
    assert any("ADD COLUMN IF NOT EXISTS released_lsn" in s for s in plan.statements)
    cdc_db.execute("INSERT INTO t VALUES (2)")
    assert drain(trigger) == [2]
    bound = cdc_db.scalar(
        "SELECT released_lsn::text FROM dbtrigger_cdc_slots WHERE slot = %s", (source.slot,)
    )
    assert bound is not None
    source.close()
    recreate_by_hand(cdc_db, source.slot, skipped=3)
    with pytest.raises(SlotLostError, match="created again"):
        drain(trigger)
    source.close()


def slot_lsns(db: CdcDatabase, slot: str) -> tuple[int, int]:
    """The slot's confirmed position and the bound the control row records."""
    confirmed = db.scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    )
    bound = db.scalar("SELECT released_lsn::text FROM dbtrigger_cdc_slots WHERE slot = %s", (slot,))
    return parse_lsn(confirmed), parse_lsn(bound)


def test_a_reply_the_server_asks_for_never_confirms_past_the_recorded_bound(
    cdc_db: CdcDatabase,
) -> None:
    # A walsender that heard nothing for wal_sender_timeout/2 (or that shuts down) sends
    # a keepalive asking for a reply; psycopg2 answers it inside read_message, and moved
    # the flush position it reports on to that keepalive's WAL end before the stream's
    # loop could record it as the bound: the next start was a false SlotLostError (and
    # its advice, recreate and read every table again). A short wal_sender_timeout, set
    # once the stream runs, makes the server ask every half second of silence.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE other (v int)")
    trigger, source = poller(cdc_db, mode="stream")
    assert drain(trigger) == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    assert drain(trigger) == [1]
    cdc_db.server.set_config("wal_sender_timeout", "1s")
    try:
        cdc_db.execute("INSERT INTO other SELECT generate_series(1, 100)")
        written = parse_lsn(cdc_db.scalar("SELECT pg_current_wal_flush_lsn()::text"))
        sender = (
            "SELECT r.sent_lsn::text, r.reply_time, now() FROM pg_stat_replication r "
            "JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = %s"
        )
        # The walsender sent past the write, then a reply came (the one it asked for:
        # the stream's own status messages are ten seconds apart).
        with cdc_db.connect() as conn:
            since: list[Any] = []

            def replied_after_the_write() -> bool:
                row = conn.execute(sender, (source.slot,)).fetchone()
                assert row is not None
                sent, replied, now = row
                if not since and parse_lsn(sent) >= written:
                    since.append(now)
                return bool(since) and replied is not None and replied > since[0]

            wait_for(replied_after_the_write, "a reply after the walsender sent past the write")
        confirmed, bound = slot_lsns(cdc_db, source.slot)
        assert confirmed <= bound
        source.close()
        cdc_db.execute("INSERT INTO t VALUES (2)")
        assert drain(trigger) == [2]  # a new stream: no SlotLostError
        source.close()
    finally:
        cdc_db.server.set_config("wal_sender_timeout", None)


def test_recreate_while_a_stream_reads_says_to_stop_the_workers_then_works_twice(
    cdc_db: CdcDatabase,
) -> None:
    # `cdc recreate` (another process) while a worker streams from the slot: the server
    # refuses to drop a slot in use. That said "the next tick retries", which no tick
    # of the operator's command does; it now says to stop the workers, and changes
    # nothing. Once they are stopped, two recreates in a row lose nothing: the last
    # one's snapshot reads the table again.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    trigger, source = poller(cdc_db, mode="stream")
    assert drain(trigger) == []
    cdc_db.execute("INSERT INTO t VALUES (1)")
    assert drain(trigger) == [1]
    operator = PgLogicalSource(cdc_db.url, ["t"], slot=source.slot, snapshot="never")
    for _ in range(2):
        with pytest.raises(ConfigurationError, match=r"being read right now.*Stop the poller"):
            operator.admin().recreate(snapshot=True)
    cdc_db.execute("INSERT INTO t VALUES (2)")
    assert drain(trigger) == [2]  # the slot was left alone
    source.close()  # the workers stop
    for key in (3, 4):
        operator.admin().recreate(snapshot=True)
        cdc_db.execute("INSERT INTO t VALUES (%s)", (key,))
    operator.close()
    # A worker started again: the last recreate's snapshot holds every row (3 was
    # committed into the slot the second recreate dropped), then the change of 4.
    again = PgLogicalSource(cdc_db.url, ["t"], slot=source.slot, snapshot="never")
    restarted = PollTrigger(name=trigger.name, source=again, checkpoint_store=trigger.store)
    got: list[RowChange] = []
    restarted.drain(got.extend)
    assert sorted(e.pk["id"] for e in got if e.metadata["snapshot"]) == [1, 2, 3, 4]
    again.close()
