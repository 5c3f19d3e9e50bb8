"""Partitioned polling on every database: buckets, members, rebalancing, no row lost."""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import (
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions import PartitionedPoller, bucket_of, partition_ddl
from dbtrigger.partitions.buckets import key_text, sql_bucket
from dbtrigger.partitions.source import _register_sqlite_function
from dbtrigger.state.stores.base import CheckpointStore
from tests.databases import TestDatabase, admin_engine


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(db: TestDatabase, rows: int, *, start: int = 1) -> str:
    table = db.qualified("orders")
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {table} (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, "
        "note VARCHAR(20))"
    )
    insert(db, range(start, start + rows))
    return table


def insert(db: TestDatabase, ids: range) -> None:
    table = db.qualified("orders")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq, note) VALUES (:id, :seq, 'x')"),
            [{"id": i, "seq": i} for i in ids],
        )


def source(db: TestDatabase) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url,
        table="orders",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",
    )


def member(
    db: TestDatabase, store: CheckpointStore, name: str, clock: Clock, **options: Any
) -> PartitionedPoller:
    return PartitionedPoller(
        name="orders",
        source=source(db),
        checkpoint_store=store,
        partitions=options.pop("partitions", 4),
        balance_interval_seconds=1,
        member_ttl_seconds=3,
        join_window_seconds=options.pop("join_window_seconds", 0),
        member_id=name,
        monotonic=clock,
        background=False,  # the test moves the clock and balances by hand
        batch_size=options.pop("batch_size", 50),
        max_batches_per_tick=options.pop("max_batches_per_tick", 4),
        **options,
    )


@pytest.mark.parametrize(
    "keys",
    [
        [[1], [2], [255], [10_000_000_000], [-7]],
        [["a"], ["Ünïcode ✓"], [""], ["x|y"]],
        [[str(uuid.UUID(int=5))], [str(uuid.uuid4())]],
        [[1, "a"], [2, "b"]],
    ],
)
def test_sql_bucket_equals_python_bucket(db: TestDatabase, keys: list[list[Any]]) -> None:
    types = ["BIGINT" if isinstance(v, int) else "VARCHAR(60)" for v in keys[0]]
    names = [f"k{i}" for i in range(len(types))]
    table = db.qualified("keys")
    columns = ", ".join(f"{n} {t}" for n, t in zip(names, types, strict=True))
    db.execute(f"CREATE TABLE {table} ({columns})")
    if db.kind == "mariadb":
        db.execute(f"ALTER TABLE {table} CONVERT TO CHARACTER SET utf8mb4")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} VALUES ({', '.join(':' + n for n in names)})"),
            [dict(zip(names, key, strict=True)) for key in keys],
        )
    _register_sqlite_function(db.engine)
    expr = sql_bucket(db.kind, names, db.engine.dialect.identifier_preparer.quote)
    with db.engine.connect() as conn:
        got = conn.execute(sa.text(f"SELECT {', '.join(names)}, {expr} FROM {table}")).all()
    assert len(got) == len(keys)
    for row in got:
        assert int(row[-1]) == bucket_of(list(row[:-1])), row


def test_one_member_drains_every_partition_once(db: TestDatabase, tmp_path: Path) -> None:
    make_table(db, 600)
    clock = Clock()
    poller = member(db, FileCheckpointStore(tmp_path / "state"), "m1", clock)
    seen: list[int] = []
    assert poller.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 600
    assert sorted(seen) == list(range(1, 601))
    assert len(poller.owned) == 4
    # Each partition delivered only keys of its own bucket range, in cursor order.
    status = {s.id: s for s in poller.status()}
    assert sum(1 for s in status.values() if s.lag_rows == 0) == 4
    assert {s.owner for s in status.values()} == {"m1"}
    insert(db, range(601, 701))
    assert poller.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 100
    assert Counter(seen).most_common(1)[0][1] == 1


def test_the_table_is_reflected_once_for_every_partition(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A cold member's first round reflected the table once per partition (about
    ten catalog queries each on PostgreSQL): the partitions share one shape."""
    make_table(sqlite_db, 40)
    reflected: list[str] = []

    def on_column(inspector: Any, table: sa.Table, column: dict[str, Any]) -> None:
        if column["name"] == "seq":
            reflected.append(table.name)

    sa.event.listen(sa.Table, "column_reflect", on_column)
    try:
        poller = member(sqlite_db, FileCheckpointStore(tmp_path / "state"), "m1", Clock())
        assert poller.drain(lambda events: None) == 40
    finally:
        sa.event.remove(sa.Table, "column_reflect", on_column)
    assert reflected == ["orders"]


def test_event_ids_do_not_depend_on_the_partition(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    make_table(sqlite_db, 20)
    clock = Clock()
    four: list[RowChange] = []
    member(sqlite_db, InMemoryCheckpointStore(), "m", clock).drain(four.extend)
    plain: list[RowChange] = []
    PollTrigger(
        name="orders",
        source=source(sqlite_db),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=100,
    ).drain(plain.extend)
    assert {e.event_id for e in four} == {e.event_id for e in plain}


def test_members_share_the_partitions_and_take_over_a_dead_one(
    db: TestDatabase, tmp_path: Path
) -> None:
    make_table(db, 400)
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    a = member(db, store, "a", clock)
    b = member(db, store, "b", clock)
    seen: list[int] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend(e.pk["id"] for e in events)

    a.balance()
    assert len(a.owned) == 4
    for _ in range(3):  # b joins; a sheds and b steals until each holds its share
        clock.now += 1
        b.balance()
        a.balance()
    assert sorted([len(a.owned), len(b.owned)]) == [2, 2]
    assert not set(a.owned) & set(b.owned)
    a.tick(handle)
    b.tick(handle)

    # a dies: it stops heartbeating. After the TTL on b's own clock, b takes all.
    for _ in range(4):
        clock.now += 1
        b.balance()
    assert len(b.owned) == 4
    insert(db, range(401, 451))
    b.drain(handle)
    assert sorted(set(seen)) == list(range(1, 451))


def test_a_stale_owner_cannot_double_process(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """Ownership is only the spread: two members ticking one partition never both commit it."""
    make_table(sqlite_db, 200)
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    a = member(sqlite_db, store, "a", clock, partitions=1)
    b = member(sqlite_db, store, "b", clock, partitions=1)
    a.balance()
    b.balance()
    (pid,) = a.owned
    seen: list[int] = []

    def handle(events: list[RowChange]) -> None:
        seen.extend(e.pk["id"] for e in events)
        # While a's tick runs, b (a stale view: it thinks it may tick too) tries.
        if len(seen) <= 50:
            assert b.trigger(pid).tick(lambda ev: seen.extend(e.pk["id"] for e in ev)) == 0

    a.trigger(pid).drain(handle)
    assert sorted(seen) == list(range(1, 201))


def test_leave_frees_partitions_at_once(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    make_table(sqlite_db, 10)
    store = InMemoryCheckpointStore()
    clock = Clock()
    a = member(sqlite_db, store, "a", clock)
    b = member(sqlite_db, store, "b", clock)
    a.balance()
    b.balance()
    a.leave()
    clock.now += 0.5  # far below the TTL
    b.balance()
    assert len(b.owned) == 4


def test_only_sqlalchemy_sources_and_sane_timings(sqlite_db: TestDatabase) -> None:
    with pytest.raises(ConfigurationError, match="SqlAlchemySource"):
        PartitionedPoller(name="o", source=object(), checkpoint_store=InMemoryCheckpointStore())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="at least twice"):
        PartitionedPoller(
            name="o",
            source=source(sqlite_db),
            checkpoint_store=InMemoryCheckpointStore(),
            balance_interval_seconds=10,
            member_ttl_seconds=15,
        )


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_stored_bucket_column_is_used_and_agrees(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    make_table(db, 300)
    quote = db.engine.dialect.identifier_preparer.quote
    for statement in partition_ddl(db.kind, "orders", ["id"], "seq", quote, schema=db.schema):
        db.execute(statement)
    poller = member(db, InMemoryCheckpointStore(), "m", Clock())
    seen: list[int] = []
    assert poller.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 300
    assert sorted(seen) == list(range(1, 301))
    trigger = poller.trigger(poller.owned[0])
    inner = trigger.source._inner  # type: ignore[attr-defined]
    compiled = str(inner._keyset.statement(BEGINNING, 10))
    assert "dbt_bucket" in compiled
    assert "md5" not in compiled.lower()


def test_poll_trigger_with_partitions_is_a_member(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """The old spelling still builds a member and delegates to it, and warns
    (PartitionedPoller is the constructor: issue #21)."""
    make_table(sqlite_db, 120)
    with pytest.warns(DeprecationWarning, match=r"PollTrigger\(partitions=N\) is deprecated"):
        trigger = PollTrigger(
            name="orders",
            source=source(sqlite_db),
            checkpoint_store=FileCheckpointStore(tmp_path / "state"),
            partitions=4,
            batch_size=10,
            max_batches_per_tick=3,
        )
    assert trigger.partitioned is not None
    seen: list[int] = []
    assert trigger.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 120
    assert sorted(seen) == list(range(1, 121))
    assert trigger.partitioned.owned == ("p000-064", "p064-128", "p128-192", "p192-256")
    assert trigger.last_result is not None
    assert trigger.last_result.outcome == "idle"


@pytest.mark.parametrize("stored", [False, True], ids=["hashed", "dbt_bucket"])
def test_a_postgresql_char_key_is_delivered_once(
    pg: TestDatabase, tmp_path: Path, stored: bool
) -> None:
    """A ``char(n)`` key reaches Python padded to n, while PostgreSQL's text of
    it (what the bucket is the hash of) drops the padding: every partition
    refused its first such row ('the database put key ... in buckets'), the
    poller stuck on a supported key type. The padding is not part of a char(n)
    value, so the check hashes the key without it."""
    table = pg.qualified("codes")
    pg.execute(f"CREATE TABLE {table} (code char(8) PRIMARY KEY, seq integer NOT NULL)")
    codes = ["ab", "abcdefgh", "ü", "x y", *(f"k{i}" for i in range(60))]
    with pg.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (code, seq) VALUES (:code, :seq)"),
            [{"code": c, "seq": i} for i, c in enumerate(codes)],
        )
    if stored:
        quote = pg.engine.dialect.identifier_preparer.quote
        for statement in partition_ddl(
            "postgresql", "codes", ["code"], "seq", quote, schema=pg.schema
        ):
            pg.execute(statement)
    poller = PartitionedPoller(
        name="codes",
        source=SqlAlchemySource(
            url=pg.url, table="codes", schema=pg.schema, cursor_column="seq", pk_columns=["code"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        join_window_seconds=0,
        background=False,
    )
    seen: list[str] = []
    assert poller.drain(lambda events: seen.extend(e.pk["code"] for e in events)) == len(codes)
    assert sorted(seen) == sorted(c.ljust(8) for c in codes)


def test_text_keys_of_a_latin1_postgresql_database_are_delivered(tmp_path: Path) -> None:
    """PostgreSQL's md5(text) hashes the bytes of the database's encoding and
    Python hashes UTF-8: on a LATIN1 database every partition refused its first
    key with a non-ASCII character ('the key's text differs'), the group stuck.
    The fetch hashes the key's UTF-8 form there."""
    admin = admin_engine("postgresql")
    name = f"dbtrigger_latin1_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(
            sa.text(
                f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
                "TEMPLATE template0"
            )
        )
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    engine = sa.create_engine(url)
    try:
        keys = ["é", "Ünïcode", "abc", "ß", *(f"k{i}ä" for i in range(40))]
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE codes (code text PRIMARY KEY, seq int NOT NULL)"))
            conn.execute(
                sa.text("INSERT INTO codes (code, seq) VALUES (:code, :seq)"),
                [{"code": k, "seq": i} for i, k in enumerate(keys)],
            )
        poller = PartitionedPoller(
            name="codes",
            source=SqlAlchemySource(
                url=url, table="codes", cursor_column="seq", pk_columns=["code"]
            ),
            checkpoint_store=FileCheckpointStore(tmp_path / "state"),
            join_window_seconds=0,
            background=False,
        )
        seen: list[str] = []
        assert poller.drain(lambda events: seen.extend(e.pk["code"] for e in events)) == len(keys)
        assert sorted(seen) == sorted(keys)
        poller.source.close()
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_the_bucket_index_of_a_key_that_is_its_own_cursor_is_created(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """``cursor_column="id", pk_columns=["id"]`` (an AUTO_INCREMENT key as the
    cursor): the index listed ``id`` twice, which MariaDB refuses ('Duplicate
    column name'), so the printed DDL failed halfway, the column added and no index."""
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    make_table(db, 50)
    quote = db.engine.dialect.identifier_preparer.quote
    for statement in partition_ddl(db.kind, "orders", ["id"], "id", quote, schema=db.schema):
        db.execute(statement)
    poller = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=db.url, table="orders", schema=db.schema, cursor_column="id", pk_columns=["id"]
        ),
        checkpoint_store=InMemoryCheckpointStore(),
        join_window_seconds=0,
        background=False,
    )
    seen: list[int] = []
    assert poller.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 50
    assert sorted(seen) == list(range(1, 51))


@pytest.mark.parametrize("stored", [False, True], ids=["hashed", "dbt_bucket"])
def test_a_zerofill_key_on_mariadb_is_delivered_once(
    mariadb: TestDatabase, tmp_path: Path, stored: bool
) -> None:
    """``INT(6) ZEROFILL``: MariaDB's text of 42 is '000042' while Python gets 42,
    so every partition refused its first row ('the key's text differs'). The
    bucket is taken of the number's own digits, in the fetch and in the DDL."""
    table = mariadb.qualified("codes")
    mariadb.execute(
        f"CREATE TABLE {table} (id INT(6) UNSIGNED ZEROFILL PRIMARY KEY, seq INT NOT NULL)"
    )
    with mariadb.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (:id, :id)"),
            [{"id": i} for i in range(1, 61)],
        )
    if stored:
        quote = mariadb.engine.dialect.identifier_preparer.quote
        for statement in partition_ddl(
            "mysql", "codes", ["id"], "seq", quote, schema=mariadb.schema, zerofill=["id"]
        ):
            mariadb.execute(statement)
    poller = PartitionedPoller(
        name="codes",
        source=SqlAlchemySource(
            url=mariadb.url,
            table="codes",
            schema=mariadb.schema,
            cursor_column="seq",
            pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        join_window_seconds=0,
        background=False,
    )
    seen: list[int] = []
    assert poller.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 60
    assert sorted(seen) == list(range(1, 61))


def test_a_numeric_key_is_delivered_once(server_db: TestDatabase, tmp_path: Path) -> None:
    """A ``NUMERIC``/``DECIMAL`` key (a NUMBER(10) carried over from Oracle) reaches
    Python as a Decimal: partitioning refused every row of it, and str() of a small
    one is '1E-7' where the database's text is '0.0000001'. A decimal is hashed by
    its plain digits, as PostgreSQL and MariaDB write it."""
    table = server_db.qualified("codes")
    server_db.execute(f"CREATE TABLE {table} (id NUMERIC(20, 7) PRIMARY KEY, seq INT NOT NULL)")
    keys = ["1", "42", "0.0000001", "-3.5", "12345678.5", *(str(i * 7) for i in range(40))]
    with server_db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (CAST(:id AS DECIMAL(20, 7)), :seq)"),
            [{"id": k, "seq": i} for i, k in enumerate(dict.fromkeys(keys))],
        )
    poller = PartitionedPoller(
        name="codes",
        source=SqlAlchemySource(
            url=server_db.url,
            table="codes",
            schema=server_db.schema,
            cursor_column="seq",
            pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        join_window_seconds=0,
        background=False,
    )
    seen: list[Decimal] = []
    expected = len(dict.fromkeys(keys))
    assert poller.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == expected
    assert sorted(seen) == sorted(Decimal(k) for k in dict.fromkeys(keys))


def test_key_types_whose_text_differs_are_refused_saying_what_to_do() -> None:
    with pytest.raises(ConfigurationError, match=r"datetime key value .*max_concurrency="):
        bucket_of([dt.datetime(2020, 1, 1)])
    assert key_text([Decimal("0.0000001"), 1]) == "0.0000001|1"
