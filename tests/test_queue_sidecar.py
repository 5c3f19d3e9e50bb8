"""Sidecar mode: the user table untouched, a feeder filling the claims table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, FileCheckpointStore, QueueTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue import SidecarFeeder
from tests.databases import TestDatabase


def args(db: TestDatabase) -> list[str]:
    return [
        "--url", db.url, "--table", "items", "--mode", "sidecar",
        *(["--schema", db.schema] if db.schema else []),
    ]  # fmt: skip


@pytest.fixture
def items(db: TestDatabase) -> Iterator[ClaimSource]:
    db.execute(
        f"CREATE TABLE {db.qualified('items')} "
        "(id integer PRIMARY KEY, version bigint NOT NULL, payload varchar(40))"
    )
    db.execute(
        f"INSERT INTO {db.qualified('items')} VALUES (:i, :i, :p)",
        [{"i": i, "p": f"item {i}"} for i in range(1, 11)],
    )
    src = ClaimSource(
        url=db.url,
        table="items",
        schema=db.schema,
        pk_columns=["id"],
        mode="sidecar",
        cursor_column="version",
    )
    yield src
    src.close()


def claims(db: TestDatabase) -> list[dict[str, Any]]:
    with db.engine.connect() as conn:
        result = conn.execute(
            sa.text(f"SELECT * FROM {db.qualified('dbtrigger_claims')} ORDER BY item_cursor")
        )
        return [dict(r) for r in result.mappings()]


def test_feeder_and_workers(db: TestDatabase, items: ClaimSource, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="--mode sidecar --yes"):
        items.counts()
    assert main(["queue", "install", *args(db), "--yes"]) == 0
    feeder = SidecarFeeder(
        name="items-feeder", source=items, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    assert feeder.drain() == 10
    assert len(claims(db)) == 10
    assert sorted(json.loads(c["item_key"])["id"][1] for c in claims(db)) == list(range(1, 11))
    seen: list[tuple[str, Any, Any]] = []

    def handle(events: list[RowChange]) -> None:
        for e in events:
            seen.append((e.op, e.pk["id"], e.after["payload"] if e.after else None))
            assert e.cursor == e.pk["id"] or e.op == "delete" or e.pk["id"] == 3

    queue = QueueTrigger(name="items", source=items, batch_size=4)
    assert queue.drain(handle) == 10
    assert sorted(seen) == [("upsert", i, f"item {i}") for i in range(1, 11)]
    assert {c["dbt_status"] for c in claims(db)} == {"done"}
    with db.engine.connect() as conn:
        columns = [c["name"] for c in sa.inspect(conn).get_columns("items", schema=db.schema)]
    assert columns == ["id", "version", "payload"]  # the user table is untouched

    # A redelivered feeder batch changes nothing; an update is a new job; a
    # row deleted before it was handled arrives as a delete.
    db.execute(f"UPDATE {db.qualified('items')} SET version = 11, payload = 'new' WHERE id = 3")
    db.execute(f"INSERT INTO {db.qualified('items')} VALUES (12, 12, 'gone')")
    assert feeder.drain() == 2
    db.execute(f"DELETE FROM {db.qualified('items')} WHERE id = 12")
    seen.clear()
    assert queue.drain(handle) == 2
    assert sorted(seen, key=str) == sorted([("upsert", 3, "new"), ("delete", 12, None)], key=str)
    assert len(claims(db)) == 12
    feeder.close()


def test_feeding_is_idempotent(db: TestDatabase, items: ClaimSource, tmp_path: Path) -> None:
    assert main(["queue", "install", *args(db), "--yes"]) == 0
    feeder = SidecarFeeder(
        name="items-feeder", source=items, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    events = [
        RowChange(
            event_id=f"e{i}", op="upsert", source="s", cursor=i, pk={"id": i},
            before=None, after={"id": i},
        )
        for i in (1, 2)
    ]  # fmt: skip
    feeder.handle(events)
    feeder.handle(events)
    assert len(claims(db)) == 2
    assert main(["queue", "status", *args(db), "--json"]) == 0
    feeder.close()


def test_feeder_needs_a_sidecar_source(db: TestDatabase, tmp_path: Path) -> None:
    db.execute(f"CREATE TABLE {db.qualified('items')} (id integer PRIMARY KEY, version bigint)")
    src = ClaimSource(url=db.url, table="items", schema=db.schema, pk_columns=["id"])
    with pytest.raises(ConfigurationError, match="mode='sidecar' and a cursor_column"):
        SidecarFeeder(name="f", source=src, checkpoint_store=FileCheckpointStore(tmp_path))
    src.close()


def has_claims_table(db: TestDatabase) -> bool:
    with db.engine.connect() as conn:
        return sa.inspect(conn).has_table("dbtrigger_claims", schema=db.schema)


def test_uninstall_removes_the_queue_then_the_claims_table(
    db: TestDatabase, items: ClaimSource, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dry run by default; pending work is refused unless --discard-pending; the
    claims table is dropped only once no queue uses it; the user table stays."""
    assert main(["queue", "install", *args(db), "--yes"]) == 0
    feeder = SidecarFeeder(
        name="items-feeder", source=items, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    assert feeder.drain() == 10
    feeder.close()
    db.execute(
        f"INSERT INTO {db.qualified('dbtrigger_claims')} (queue, item_key, item_cursor) "
        "VALUES (:q, '{}', '1')",
        {"q": db.qualified("others")},
    )  # a second queue shares the claims table
    capsys.readouterr()

    assert main(["queue", "uninstall", *args(db)]) == 0
    out = capsys.readouterr().out
    assert "ready 10" in out
    assert "DELETE FROM" in out
    assert "DROP TABLE" not in out
    assert "1 other queue(s) still use it" in out
    assert "--discard-pending" in out
    assert "dry run" in out
    assert len(claims(db)) == 11  # nothing changed

    assert main(["queue", "uninstall", *args(db), "--yes"]) != 0  # 10 rows not done
    assert "10 row(s) of queue" in capsys.readouterr().err
    assert len(claims(db)) == 11

    queue = QueueTrigger(name="items", source=items, batch_size=10)
    assert queue.drain(lambda events: None) == 10
    assert main(["queue", "uninstall", *args(db), "--yes"]) == 0
    assert [c["queue"].rsplit(".")[-1] for c in claims(db)] == ["others"]
    assert has_claims_table(db)

    others = [
        "--url", db.url, "--table", "others", "--mode", "sidecar",
        *(["--schema", db.schema] if db.schema else []),
    ]  # fmt: skip
    db.execute(f"CREATE TABLE {db.qualified('others')} (id integer PRIMARY KEY)")
    assert main(["queue", "uninstall", *others, "--yes", "--discard-pending"]) == 0
    assert "DROP TABLE" in capsys.readouterr().out
    assert not has_claims_table(db)
    assert main(["queue", "uninstall", *others, "--yes"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    with db.engine.connect() as conn:
        count = conn.execute(sa.text(f"SELECT count(*) FROM {db.qualified('items')}"))
        assert count.scalar_one() == 10  # the user table is untouched
