"""Snapshots in chunks through the log: existing rows first, no gap at the hand-over, resumable."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import UNCHANGED, PgLogicalSource
from dbtrigger.cdc.snapshots import add_request
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import SourceDefinitionError
from tests.cdc_servers import CdcDatabase
from tests.test_cdc_pg import wait_for


def make(db: CdcDatabase, state: Any, name: str, **kw: Any) -> tuple[PollTrigger, PgLogicalSource]:
    kw.setdefault("snapshot_chunk_size", 1000)
    source = PgLogicalSource(db.url, ["t"], **kw)
    trigger = PollTrigger(
        name=name,
        source=source,
        checkpoint_store=FileCheckpointStore(state),
        batch_size=300,
        max_batches_per_tick=2,
        retry=RetryPolicy.none(),
    )
    return trigger, source


def apply(state: dict[int, dict[str, Any]], events: list[RowChange]) -> None:
    """What a consumer keeping a copy of the table does with the events."""
    for e in events:
        key = e.pk["id"]
        if e.op == "delete":
            state.pop(key, None)
            continue
        assert e.after is not None
        row = dict(e.after)
        for column, value in row.items():
            if value is UNCHANGED:
                row[column] = state[key][column]
        state[key] = row


def table(db: CdcDatabase) -> dict[int, dict[str, Any]]:
    with db.connect() as conn:
        return {
            r[0]: {"id": r[0], "v": r[1]} for r in conn.execute("SELECT id, v FROM t").fetchall()
        }


def test_initial_snapshot_then_the_stream_with_no_gap_while_writers_write(
    cdc_db: CdcDatabase, tmp_path: Any
) -> None:
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL);"
        "INSERT INTO t SELECT g, 0 FROM generate_series(1, 2500) g"
    )
    trigger, source = make(cdc_db, tmp_path, f"snap_{uuid.uuid4().hex[:6]}")
    copy: dict[int, dict[str, Any]] = {}
    delivered: list[RowChange] = []

    def handle(events: list[RowChange]) -> None:
        delivered.extend(events)
        apply(copy, events)

    writes = 0
    with cdc_db.connect() as conn:
        for round_ in range(40):
            trigger.tick(handle)
            # Writers touch rows already read, rows not read yet, and new rows.
            conn.execute("UPDATE t SET v = v + 1 WHERE id %% 97 = %s", (round_ % 97,))
            conn.execute("UPDATE t SET v = v + 1 WHERE id = %s", (2500 - round_ * 50,))
            conn.execute("INSERT INTO t VALUES (%s, 1)", (3000 + round_,))
            conn.execute("DELETE FROM t WHERE id = %s", (round_ * 60 + 1,))
            writes += 1
    trigger.drain(handle)
    assert copy == table(cdc_db), "the copy built from the events is the table"
    snapshot_rows = [e for e in delivered if e.metadata["snapshot"]]
    assert {e.op for e in snapshot_rows} == {"upsert"}
    keys = [e.pk["id"] for e in snapshot_rows]
    assert keys == sorted(keys), "chunks come in key order"
    assert set(keys) <= set(range(1, 2501)) | set(range(3000, 3040))
    status = source.admin().status()
    assert [(s["table"], s["done"]) for s in status["snapshots"]] == [("public.t", True)]
    assert status["snapshots"][0]["chunks"] >= 3
    source.close()


def test_an_interrupted_snapshot_resumes_at_the_next_chunk(
    cdc_db: CdcDatabase, tmp_path: Any
) -> None:
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL);"
        "INSERT INTO t SELECT g, 0 FROM generate_series(1, 2500) g"
    )
    name = f"snap_{uuid.uuid4().hex[:6]}"
    trigger, source = make(cdc_db, tmp_path, name)
    first: list[RowChange] = []
    trigger.tick(first.extend)  # creates the slot and reads the first chunk into the log
    assert 0 < len(first) <= 600
    source.close()  # the worker dies
    again, source2 = make(cdc_db, tmp_path, name)
    rest: list[RowChange] = []
    again.drain(rest.extend)
    keys = [e.pk["id"] for e in first + rest]
    assert sorted(set(keys)) == list(range(1, 2501))
    assert len(keys) == 2500, "no chunk read twice, none skipped"
    row = source2.admin().status()["snapshots"][0]
    assert (row["chunks"], row["rows"], row["done"]) == (3, 2500, True)
    source2.close()


def test_a_table_or_key_range_can_be_read_again_while_streaming(
    cdc_db: CdcDatabase, tmp_path: Any
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    trigger, source = make(cdc_db, tmp_path, f"snap_{uuid.uuid4().hex[:6]}", snapshot="never")
    trigger.drain(lambda events: None)
    cdc_db.execute("INSERT INTO t SELECT g, 5 FROM generate_series(1, 300) g")
    source.admin().request_snapshot("t", where="id <= 10")
    cdc_db.execute("UPDATE t SET v = 6 WHERE id = 1")
    events: list[RowChange] = []
    trigger.drain(events.extend)
    inserts = [e for e in events if e.op == "insert"]
    again = [e for e in events if e.metadata["snapshot"]]
    assert len(inserts) == 300
    assert [e.pk["id"] for e in again] == list(range(1, 11))
    copy: dict[int, dict[str, Any]] = {}
    apply(copy, events)
    assert copy == table(cdc_db)
    source.close()


def test_a_table_without_a_key_cannot_be_snapshotted_in_chunks(
    cdc_db: CdcDatabase, tmp_path: Any
) -> None:
    # FULL: publishable without a key (one without FULL is refused before it is published)
    cdc_db.execute(
        "CREATE TABLE t (id int, v int); ALTER TABLE t REPLICA IDENTITY FULL;"
        "INSERT INTO t VALUES (1, 1)"
    )
    trigger, source = make(cdc_db, tmp_path, f"snap_{uuid.uuid4().hex[:6]}")
    with pytest.raises(SourceDefinitionError, match=r"no primary key.*snapshot='never'"):
        trigger.tick(lambda events: None)
    source.close()


def test_stream_mode_reads_the_initial_snapshot_too(cdc_db: CdcDatabase, tmp_path: Any) -> None:
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL);"
        "INSERT INTO t SELECT g, 1 FROM generate_series(1, 1500) g"
    )
    name = f"snap_{uuid.uuid4().hex[:6]}"
    trigger, source = make(cdc_db, tmp_path, name, mode="stream", stream_wait_seconds=0)
    events: list[RowChange] = []
    trigger.drain(events.extend)
    cdc_db.execute("UPDATE t SET v = 2 WHERE id = 1")
    trigger.drain(events.extend)
    copy: dict[int, dict[str, Any]] = {}
    apply(copy, events)
    assert copy == table(cdc_db)
    assert sum(1 for e in events if e.metadata["snapshot"]) == 1500
    assert source.admin().status()["snapshots"][0]["done"] is True
    source.close()


def test_a_chunk_whose_lock_is_not_granted_waits_for_the_next_read(
    cdc_db: CdcDatabase, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL);"
        "INSERT INTO t SELECT g, 1 FROM generate_series(1, 50) g"
    )
    name = f"snap_{uuid.uuid4().hex[:6]}"
    trigger, source = make(cdc_db, tmp_path, name, snapshot_lock_timeout_seconds=0.2)
    source.admin().install()  # the slot and its snapshot request, before the writer's lock
    with cdc_db.connect() as writer, writer.transaction():
        writer.execute("UPDATE t SET v = 2 WHERE id = 1")  # ROW EXCLUSIVE until it commits
        with caplog.at_level(logging.INFO, logger="dbtrigger.cdc"):
            assert source.fetch(BEGINNING, 100) == []  # not a failed read
    assert any(r.__dict__.get("event") == "cdc_snapshot_lock_wait" for r in caplog.records)
    events: list[RowChange] = []
    trigger.drain(events.extend)
    copy: dict[int, dict[str, Any]] = {}
    apply(copy, events)
    assert copy == table(cdc_db)
    assert sum(1 for e in events if e.metadata["snapshot"]) == 50
    source.close()


def test_a_snapshot_requested_while_a_chunk_is_saved_is_not_lost(
    cdc_db: CdcDatabase, tmp_path: Any
) -> None:
    # `dbtrigger cdc snapshot` (or `cdc recreate`, which writes fresh requests) in another
    # process while the poller writes a chunk: the chunk's transaction saved the request
    # list it had read before, over the new request, which was then never worked off.
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL);"
        "CREATE TABLE u (id int PRIMARY KEY, v int NOT NULL);"
        "INSERT INTO t SELECT g, 1 FROM generate_series(1, 20) g;"
        "INSERT INTO u SELECT g, 2 FROM generate_series(1, 5) g"
    )
    source = PgLogicalSource(cdc_db.url, ["t", "u"], snapshot="never")
    trigger = PollTrigger(
        name=f"snap_{uuid.uuid4().hex[:6]}",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path),
    )
    trigger.drain(lambda events: None)  # the slot, nothing to read
    source.admin().request_snapshot("t")
    operator = PgLogicalSource(cdc_db.url, ["t", "u"], snapshot="never", slot=source.slot)
    events: list[RowChange] = []
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    with cdc_db.connect() as conn, conn.transaction():
        add_request(operator, conn, "public.u", None, reader="the operator")  # locks the row
        ticking = threading.Thread(target=lambda: trigger.tick(events.extend), daemon=True)
        ticking.start()
        wait_for(lambda: cdc_db.scalar(waiting) == 1, "the chunk waiting for the control row")
    ticking.join(60)
    assert not ticking.is_alive()
    trigger.drain(events.extend)
    snapshot_rows = sorted(
        (e.metadata["table"], e.pk["id"]) for e in events if e.metadata["snapshot"]
    )
    assert snapshot_rows == [("public.t", i) for i in range(1, 21)] + [
        ("public.u", i) for i in range(1, 6)
    ]
    source.close()
    operator.close()


def test_a_snapshot_after_a_column_was_dropped_in_the_worker_started_before(
    cdc_db: CdcDatabase, tmp_path: Any
) -> None:
    # The worker read the table's columns when it started; its snapshot chunks selected
    # the dropped column ("column w does not exist") until the process restarted.
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL, w int)")
    trigger, source = make(cdc_db, tmp_path, f"snap_{uuid.uuid4().hex[:6]}", snapshot="never")
    got: list[RowChange] = []
    trigger.drain(got.extend)
    cdc_db.execute("INSERT INTO t VALUES (1, 10, 100); ALTER TABLE t DROP COLUMN w")
    source.admin().request_snapshot("public.t")
    trigger.drain(got.extend)
    snapshot = {e.pk["id"]: dict(e.after or {}) for e in got if e.op == "upsert"}
    assert snapshot == {1: {"id": 1, "v": 10}}
    source.close()
