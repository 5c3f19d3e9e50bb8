"""The HistoryStore contract, run against every adapter: memory, JSON-lines files,
SQL tables (SQLite, PostgreSQL, MariaDB), append blobs and Table entities (Azurite).

Numbers are given once and in order (a second writer of a number conflicts and
stores nothing), tails and reads come back in order, retention never removes
the last record, and the file adapter survives a torn last line.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from azure.data.tables import TableClient
from azure.storage.blob import BlobServiceClient

from dbtrigger.errors import CasConflictError, StoreUnavailableError
from dbtrigger.history import FileHistory, HistoryStore, MemoryHistory, Retention, SqlHistory
from dbtrigger.history.blob import BlobHistory
from dbtrigger.history.table import TableHistory
from dbtrigger.state.document import format_time
from tests.azurite import Azurite
from tests.databases import make_database

T = TypeVar("T")

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
KINDS = [
    "memory",
    "file",
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.postgresql),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("blob", marks=pytest.mark.azurite),
    pytest.param("table", marks=pytest.mark.azurite),
]


def _blob(azurite: Azurite, **options: Any) -> Iterator[BlobHistory]:
    container = f"h{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    try:
        yield BlobHistory(service.get_container_client(container), app="shop", **options)
    finally:
        service.delete_container(container)
        service.close()


def _table(azurite: Azurite) -> Iterator[TableHistory]:
    name = f"h{uuid.uuid4().hex[:20]}"
    client = TableClient.from_connection_string(azurite.connection_string, name)
    client.create_table()
    try:
        yield TableHistory(client, app="shop")
    finally:
        client.delete_table()
        client.close()


@pytest.fixture(params=KINDS)
def history(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HistoryStore]:
    kind = request.param
    if kind == "memory":
        yield MemoryHistory()
    elif kind == "file":
        yield FileHistory(tmp_path / "state")
    elif kind in ("sqlite", "postgresql", "mariadb"):
        for db in make_database(kind, tmp_path):
            yield SqlHistory(db.engine, schema=db.schema)
    elif kind == "blob":
        yield from _blob(request.getfixturevalue("azurite"))
    else:
        yield from _table(request.getfixturevalue("azurite"))


def rec(n: int, at: dt.datetime | None = None) -> dict[str, Any]:
    return {
        "id": f"r{n}",
        "at": format_time(at or T0 + dt.timedelta(minutes=n)),
        "type": "commit",
        "batch_id": f"b{n}",
        "rows": n,
    }


def seqs(history: HistoryStore, poller: str = "orders", since: int = 0) -> list[int]:
    return [int(r["seq"]) for r in history.read(poller, since_seq=since)]


def test_records_are_numbered_in_order_and_read_back(history: HistoryStore) -> None:
    assert history.tail("orders", 5) == []
    assert seqs(history) == []
    history.append("orders", [rec(1), rec(2)], after_seq=0)
    history.append("orders", [rec(3)], after_seq=2)
    history.append("other", [rec(9)], after_seq=0)  # pollers do not share numbers
    assert seqs(history) == [1, 2, 3]
    assert seqs(history, since=1) == [2, 3]
    assert [r["id"] for r in history.tail("orders", 2)] == ["r2", "r3"]
    assert [r["batch_id"] for r in history.tail("orders", 10)] == ["b1", "b2", "b3"]
    assert [r["seq"] for r in history.read("other")] == [1]


def test_a_wrong_last_number_conflicts_and_stores_nothing(history: HistoryStore) -> None:
    history.append("orders", [rec(1)], after_seq=0)
    with pytest.raises(CasConflictError):
        history.append("orders", [rec(2)], after_seq=0)  # someone appended 1 meanwhile
    with pytest.raises(CasConflictError):
        history.append("orders", [rec(5)], after_seq=4)  # would leave a hole
    assert seqs(history) == [1]


def test_concurrent_writers_never_give_a_number_twice(history: HistoryStore) -> None:
    """Writers that read the tail and append race; every number is given once."""
    errors: list[BaseException] = []

    def writer(tag: str) -> None:
        for i in range(6):
            for _ in range(60):
                tail = history.tail("orders", 1)
                after = int(tail[0]["seq"]) if tail else 0
                try:
                    history.append("orders", [{**rec(i), "id": f"{tag}{i}"}], after_seq=after)
                    break
                except CasConflictError:
                    continue
                except BaseException as exc:
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert seqs(history) == list(range(1, 13))
    assert len({r["id"] for r in history.read("orders")}) == 12


def test_retention_by_age_and_size_keeps_the_last_record(history: HistoryStore) -> None:
    for n in range(1, 6):
        history.append("orders", [rec(n, T0 + dt.timedelta(days=n))], after_seq=n - 1)
    now = T0 + dt.timedelta(days=40)
    history.prune("orders", Retention(max_age_days=30, max_bytes=None), now)
    kept = seqs(history)
    assert kept[-1] == 5  # all are older than 30 days; the last always stays
    assert set(kept) <= {1, 2, 3, 4, 5}
    history.append("orders", [rec(6, now)], after_seq=5)  # numbering goes on
    assert seqs(history)[-1] == 6
    history.prune("orders", Retention(max_age_days=None, max_bytes=1024), now)
    assert seqs(history)[-1] == 6


def test_retention_removes_the_oldest_records_never_one_in_the_middle(
    history: HistoryStore,
) -> None:
    """Record 4 was written by an instance whose clock was behind: it looks older
    than record 3. Retention may drop it, but only with everything before it -
    the records kept are always the last ones, numbered without a hole."""
    days = [1, 2, 38, 3, 39]
    for n, day in enumerate(days, start=1):
        history.append("orders", [rec(n, T0 + dt.timedelta(days=day))], after_seq=n - 1)
    history.prune("orders", Retention(max_age_days=30, max_bytes=None), T0 + dt.timedelta(days=40))
    kept = seqs(history)
    assert kept == list(range(kept[0], 6))


def until_ok(call: Callable[[], T]) -> T:
    """``call()``, again while the store is busy, for at most a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return call()
        except StoreUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_pruning_while_a_writer_appends_loses_no_number(history: HistoryStore) -> None:
    """Retention runs in one thread while another appends: every append lands with
    the next number, and what is kept is always the newest records, no hole. (A
    prune that finds the store busy fails like any housekeeping, and the runtime
    prunes again later: history_prune_failed.)"""
    stop = threading.Event()
    errors: list[BaseException] = []

    def pruner() -> None:
        while not stop.is_set():
            try:
                history.prune("orders", Retention(max_age_days=None, max_bytes=1024), T0)
            except StoreUnavailableError:
                time.sleep(0.01)  # SQLite: "database is locked"; the runtime prunes later
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=pruner)
    thread.start()
    try:
        for n in range(1, 41):
            # SQLite may answer "database is locked" while a prune holds it (the
            # runtime counts that and fills the hole from the journal), and a read
            # racing a prune may be told to read again (HistoryPrunedError): try
            # again until an outcome, within a bound that load cannot reach.
            until_ok(lambda n=n: history.append("orders", [rec(n)], after_seq=n - 1))
            kept = until_ok(lambda: seqs(history))
            assert kept == list(range(kept[0], n + 1))
    finally:
        stop.set()
        thread.join(60)
    assert not errors
    assert history.tail("orders", 1)[0]["seq"] == 40


def test_retention_leaves_young_records(history: HistoryStore) -> None:
    for n in range(1, 4):
        history.append("orders", [rec(n)], after_seq=n - 1)
    history.prune("orders", Retention(), T0 + dt.timedelta(days=1))
    assert seqs(history) == [1, 2, 3]


def test_file_segments_roll_over_and_prune_whole(tmp_path: Path) -> None:
    history = FileHistory(tmp_path, segment_bytes=1024)
    for n in range(1, 41):
        history.append("orders", [rec(n, T0 + dt.timedelta(days=n))], after_seq=n - 1)
    segments = sorted(tmp_path.glob("orders.history.*.jsonl"))
    assert len(segments) > 3
    assert seqs(history) == list(range(1, 41))
    assert seqs(history, since=25) == list(range(26, 41))
    removed = history.prune("orders", Retention(max_age_days=10), T0 + dt.timedelta(days=35))
    assert removed > 0
    left = seqs(history)
    assert left == list(range(left[0], 41))  # whole segments went, oldest first
    assert left[0] <= 25  # nothing younger than the cutoff went


def test_file_torn_last_line_is_skipped_and_cut_by_the_next_append(tmp_path: Path) -> None:
    history = FileHistory(tmp_path)
    history.append("orders", [rec(1), rec(2)], after_seq=0)
    [segment] = tmp_path.glob("orders.history.*.jsonl")
    with segment.open("ab") as fh:
        fh.write(b'{"seq":3,"id":"torn"')  # a writer killed mid-line
    assert seqs(history) == [1, 2]
    assert history.tail("orders", 1)[0]["seq"] == 2
    history.append("orders", [rec(3)], after_seq=2)
    assert [r["id"] for r in history.read("orders")] == ["r1", "r2", "r3"]
    assert segment.read_bytes().endswith(b"\n")


@pytest.mark.azurite
def test_blob_segments_roll_over(azurite: Azurite) -> None:
    for history in _blob(azurite, segment_bytes=1024):
        for n in range(1, 31):
            history.append("orders", [rec(n)], after_seq=n - 1)
        names = [b.name for b in history.client.list_blobs(name_starts_with="state/shop/")]
        assert len(names) > 2
        assert all(n.startswith("state/shop/orders.history/") for n in names)
        assert seqs(history) == list(range(1, 31))
        assert seqs(history, since=20) == list(range(21, 31))
        # A second writer (another process: its own view of the segment) conflicts.
        other = BlobHistory(history.client, app="shop", segment_bytes=1024)
        other.append("orders", [rec(31)], after_seq=30)
        with pytest.raises(CasConflictError):
            history.append("orders", [rec(99)], after_seq=30)
        assert seqs(history)[-1] == 31


@pytest.mark.azurite
def test_blob_writers_that_differ_on_rolling_over_never_fork_the_history(
    azurite: Azurite,
) -> None:
    """Whether a segment is full is a fact of the segment, not of what one writer is
    about to append: a writer whose append would pass the size rolls over to a new
    segment, and another writer, still at the old segment's end with a smaller
    append, must not go on writing the same numbers there."""
    for history in _blob(azurite, segment_bytes=1024):
        small = history
        big = BlobHistory(history.client, app="shop", segment_bytes=1024)
        n = 0
        while True:  # fill the first segment to just under its size
            n += 1
            small.append("orders", [rec(n)], after_seq=n - 1)
            [segment] = list(small.client.list_blobs(name_starts_with="state/shop/"))
            if int(segment.size) + 2 * len(str(rec(0))) > 1024:
                break
        large = {**rec(n + 1), "note": "x" * 600}
        big.append("orders", [large], after_seq=n)  # too big for the segment: a new one
        with pytest.raises(CasConflictError):
            small.append("orders", [rec(n + 1)], after_seq=n)  # it holds n + 1 already
        assert seqs(history) == list(range(1, n + 2))
        assert [r["id"] for r in history.read("orders")][-1] == large["id"]


@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ],
)
def test_sql_reads_never_create_the_history_table(kind: str, tmp_path: Path) -> None:
    """``dbtrigger history tail`` pointed at a mistyped schema or database must
    say there is nothing there, not leave an empty history table behind; the
    first append creates it."""
    for db in make_database(kind, tmp_path):
        history = SqlHistory(db.engine, schema=db.schema)

        def exists(engine: sa.Engine = db.engine, schema: str | None = db.schema) -> bool:
            with engine.connect() as conn:
                return sa.inspect(conn).has_table("dbtrigger_state_history", schema=schema)

        assert history.tail("orders", 5) == []
        assert list(history.read("orders")) == []
        assert history.prune("orders", Retention(max_age_days=1), T0) == 0
        assert not exists()
        history.append("orders", [rec(1)], after_seq=0)
        assert exists()
        assert seqs(history) == [1]


def test_a_prune_by_size_holds_no_read_lock_through_its_deletes_on_sqlite(tmp_path: Path) -> None:
    """SQLite: the size scan stops part-way (``break``); a statement left half-read keeps
    its read lock until it is collected, so every other connection's commit waited behind
    the prune's deletes for its whole lock timeout (an append racing a prune: 5-85 s)."""
    path = tmp_path / "history.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    history = SqlHistory(engine)
    for n in range(1, 21):
        history.append("orders", [rec(n)], after_seq=n - 1)
    refused: list[str] = []

    def commit_elsewhere(*args: Any) -> None:
        if not str(args[2]).lstrip().upper().startswith("DELETE"):
            return
        other = sqlite3.connect(path, timeout=0.2, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("CREATE TABLE IF NOT EXISTS probe (x INTEGER)")
            other.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            refused.append(str(exc))
        finally:
            other.close()

    sa.event.listen(engine, "before_cursor_execute", commit_elsewhere)
    try:
        removed = history.prune("orders", Retention(max_age_days=None, max_bytes=1024), T0)
    finally:
        sa.event.remove(engine, "before_cursor_execute", commit_elsewhere)
        engine.dispose()
    assert removed > 0
    assert refused == []
