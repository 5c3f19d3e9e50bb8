"""A transaction larger than one read, in poll mode: decoded once, not once per read.

``pg_logical_slot_peek_binary_changes`` decodes from the slot's restart point,
and the slot cannot pass a transaction that is only partly delivered. A reader
that stopped inside a large transaction and peeked again for the rest made
the server decode the whole transaction again for every ``read_ahead``
changes: quadratic in its size (a 1M-row bulk UPDATE took 20 decodes, 3.8 GB
spilled to disk). The count of decodes is read from the server
(``pg_stat_replication_slots.total_bytes``: the bytes of changes it decoded
for the slot), so no clock is involved.
"""

from __future__ import annotations

import uuid
from typing import Any

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import PgLogicalSource
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import DecodeBacklogError
from tests.cdc_servers import CdcDatabase

ROWS = 10_000
READ_AHEAD = 1_000
BATCH = 500


def decoded_bytes(db: CdcDatabase, slot: str) -> int:
    """What the server decoded for ``slot`` so far (updated as each decode ends)."""
    value = db.scalar(
        "SELECT total_bytes FROM pg_stat_replication_slots WHERE slot_name = %s", (slot,)
    )
    return int(value or 0)


def one_decode(db: CdcDatabase, slot: str) -> int:
    """The bytes one decode of what the slot holds now costs (a peek by hand)."""
    before = decoded_bytes(db, slot)
    with db.connect() as conn:
        conn.execute(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)",
            (slot, slot),
        )
    return decoded_bytes(db, slot) - before


def poller(
    db: CdcDatabase, store: InMemoryCheckpointStore, name: str
) -> tuple[PollTrigger, PgLogicalSource]:
    source = PgLogicalSource(
        db.url, ["t"], slot=name, snapshot="never", read_ahead=READ_AHEAD,
        heartbeat_interval_seconds=0,
    )  # fmt: skip
    trigger = PollTrigger(
        name=name,
        source=source,
        checkpoint_store=store,
        batch_size=BATCH,
        max_batches_per_tick=1,
        retry=RetryPolicy.none(),
    )
    return trigger, source


def big_transaction(db: CdcDatabase) -> None:
    db.execute("INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, %s) g", (ROWS,))


def test_a_transaction_of_many_reads_is_decoded_once_and_delivered_in_order(
    cdc_db: CdcDatabase,
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    name = f"big_{uuid.uuid4().hex[:8]}"
    trigger, source = poller(cdc_db, InMemoryCheckpointStore(), name)
    trigger.tick(lambda events: None)  # set up: slot and publication
    big_transaction(cdc_db)
    per_decode = one_decode(cdc_db, name)
    assert per_decode > 0
    start = decoded_bytes(cdc_db, name)
    got: list[int] = []
    held: list[int] = []

    def handle(events: list[RowChange]) -> None:
        got.extend(e.pk["id"] for e in events)
        held.append(source.buffer.changes)

    for _ in range(ROWS // BATCH * 3):
        if len(got) >= ROWS:
            break
        trigger.tick(handle)
    assert got == list(range(1, ROWS + 1))
    decodes = (decoded_bytes(cdc_db, name) - start) / per_decode
    # Once for the transaction, and at most once more to read on after it (a read that
    # stopped at its size bound starts again from the checkpoint); before: once per read.
    assert decodes < 2.5, f"the transaction was decoded {decodes:.1f} times"
    assert max(held) <= READ_AHEAD + 1, "the client keeps at most read_ahead changes"
    source.close()


def test_a_worker_stopped_inside_it_delivers_every_row_after_it_restarts(
    cdc_db: CdcDatabase,
) -> None:
    """The read held inside the transaction goes with the process; the next one reads
    the transaction again from the slot and goes on at the checkpoint's ordinal."""
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    name = f"big_{uuid.uuid4().hex[:8]}"
    store = InMemoryCheckpointStore()
    trigger, source = poller(cdc_db, store, name)
    trigger.tick(lambda events: None)
    big_transaction(cdc_db)
    got: list[int] = []

    def handle(events: list[RowChange]) -> None:
        got.extend(e.pk["id"] for e in events)

    for _ in range(5):  # 2,500 rows: into the third read
        trigger.tick(handle)
    assert got == list(range(1, 2501))
    source.drop_connection()  # as a killed worker's: its held read is gone with it
    source.close()
    trigger, source = poller(cdc_db, store, name)
    for _ in range(ROWS // BATCH * 3):
        if len(got) >= ROWS:
            break
        trigger.tick(handle)
    assert got == list(range(1, ROWS + 1))
    source.close()


def test_a_read_held_inside_it_survives_a_lost_session_or_cursor(cdc_db: CdcDatabase) -> None:
    """The held read lives on the source's session: a session dropped (after a failed
    release, say), or its cursor gone (a session reset by a pooler), is read again
    from the checkpoint, nothing skipped."""
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    name = f"big_{uuid.uuid4().hex[:8]}"
    trigger, source = poller(cdc_db, InMemoryCheckpointStore(), name)
    trigger.tick(lambda events: None)
    big_transaction(cdc_db)
    got: list[int] = []

    def handle(events: list[RowChange], *_: Any) -> None:
        got.extend(e.pk["id"] for e in events)
        if len(got) in (1500, 6000):
            source.drop_connection()
        if len(got) == 3500:
            source.connection().execute("CLOSE ALL")

    for _ in range(ROWS // BATCH * 3):
        if len(got) >= ROWS:
            break
        trigger.tick(handle)
    assert got == list(range(1, ROWS + 1))
    source.close()


def test_a_transaction_too_large_to_decode_in_time_says_to_raise_the_read_timeout(
    cdc_db: CdcDatabase,
) -> None:
    """Windows of WAL cannot split a transaction: once the smallest window with its
    commit still times out, every read would, and the error says what to change
    (before, it kept pointing at transactions left open, and nothing moved)."""
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    source = PgLogicalSource(
        cdc_db.url, ["t"], slot=f"slow_{uuid.uuid4().hex[:8]}", snapshot="never",
        read_timeout_seconds=60.0, backlog_step_mb=1, heartbeat_interval_seconds=0,
    )  # fmt: skip
    # The slot is made, and its first (empty) read decoded, under a timeout no load
    # can break; only the reads of the big transaction run under 1 ms.
    assert source.fetch(BEGINNING, 10) == []
    source.read_timeout = 0.001
    cdc_db.execute("INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, 50000) g")
    said: list[str] = []
    for _ in range(200):  # windows step through the transaction's WAL to its commit
        try:
            source.fetch(BEGINNING, 10)
        except DecodeBacklogError as exc:
            said.append(str(exc))
            if "Raise read_timeout_seconds" in said[-1]:
                break
    assert said, "the reads never timed out"
    assert "Raise read_timeout_seconds" in said[-1], said[-1]
    assert "0.001 now" in said[-1]
    source.read_timeout = 60.0  # what the error says to do
    rows = source.fetch(BEGINNING, 10)
    assert [r["pk"]["id"] for r in rows] == list(range(1, 11))
    source.close()
