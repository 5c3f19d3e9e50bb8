"""Rolling upgrades and hostile documents: unknown fields survive every write,
every known field is type-checked, and no shape of input escapes the error tree.

The round trips run through the real poller on the real file store, because
what matters is that *every* transition (acquire, commit, failure record,
release, manual reset) writes back what a newer version stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, HandlerError, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.errors import CorruptStateError
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase

NEWER = {"shard": {"of": 4, "index": [1, 2]}}


def _with_unknown_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The document as a newer dbtrigger would write it: extra keys at every level."""
    raw = json.loads(json.dumps(raw))
    raw["future_top"] = NEWER
    if raw.get("checkpoint"):
        raw["checkpoint"]["future_checkpoint"] = "cp"
        raw["checkpoint"]["metadata"]["future_metadata"] = 7
    if raw.get("lease"):
        raw["lease"]["future_lease"] = [True, None]
    if raw.get("failure"):
        raw["failure"]["future_failure"] = {"x": 1}
    return raw


def _assert_unknown_fields(raw: dict[str, Any]) -> None:
    assert raw["future_top"] == NEWER
    if raw.get("checkpoint"):
        assert raw["checkpoint"]["future_checkpoint"] == "cp"
        assert raw["checkpoint"]["metadata"]["future_metadata"] == 7
    if raw.get("lease"):
        assert raw["lease"]["future_lease"] == [True, None]
    if raw.get("failure"):
        assert raw["failure"]["future_failure"] == {"x": 1}


def _events(db: TestDatabase, rows: int) -> None:
    metadata = sa.MetaData()
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
        schema=db.schema,
    )
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "seq": i} for i in range(1, rows + 1)])


def _upgrade_in_place(store: FileCheckpointStore) -> None:
    stored = store.read("orders")
    assert stored is not None
    data = json.dumps(_with_unknown_fields(json.loads(stored.data))).encode()
    store.write("orders", data, if_match=stored.etag)


def _raw(store: FileCheckpointStore) -> dict[str, Any]:
    stored = store.read("orders")
    assert stored is not None
    return json.loads(stored.data)  # type: ignore[no-any-return]


def test_unknown_fields_survive_acquire_commit_failure_release_and_reset(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _events(sqlite_db, 30)
    store = FileCheckpointStore(tmp_path / "state")
    source = SqlAlchemySource(
        url=sqlite_db.url, table="events", cursor_column="seq", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=10, max_batches_per_tick=1
    )
    fail = {"on": False}

    def handler(events: list[RowChange]) -> None:
        if fail["on"]:
            raise ValueError("boom")

    assert trigger.tick(handler) == 10
    _upgrade_in_place(store)
    assert trigger.tick(handler) == 10  # acquire + commit + release
    _assert_unknown_fields(_raw(store))

    fail["on"] = True
    with pytest.raises(HandlerError):
        trigger.tick(handler)  # acquire + failure record
    raw = _raw(store)
    assert raw["failure"] is not None
    _upgrade_in_place(store)  # now the failure record carries one too
    with pytest.raises(HandlerError):
        trigger.tick(handler)
    raw = _raw(store)
    assert raw["failure"]["attempts"] == 2
    _assert_unknown_fields(raw)

    monkeypatch.chdir(tmp_path)
    argv = ["reset", "orders", "--to-cursor", "25", "--pk", "id=25", "--reason", "t", "--yes"]
    code = main([*argv, "--store", str(tmp_path / "state")])
    capsys.readouterr()
    assert code == 0
    raw = _raw(store)
    assert raw["failure"] is None
    _assert_unknown_fields(raw)

    fail["on"] = False
    assert trigger.tick(handler) == 5
    _assert_unknown_fields(_raw(store))


def test_parsed_document_keeps_unknown_fields_exactly() -> None:
    raw = {
        "version": 1,
        "poller_name": "orders",
        "source_fingerprint": "sha256:x",
        "checkpoint": {
            "cursor": {"kind": "int+pk", "value": 5, "tiebreaker": {"id": 5}},
            "last_successful_batch_id": None,
            "updated_at": "2026-01-01T00:00:00.000000Z",
            "metadata": {"row_count": 1},
        },
        "lease": {
            "owner_id": "a",
            "fencing_token": 1,
            "acquired_at": "2026-01-01T00:00:00Z",
            "heartbeat_at": "2026-01-01T00:00:00Z",
            "expires_at": "2026-01-01T00:00:00Z",
            "released": True,
        },
        "failure": {
            "attempts": 1,
            "first_failed_at": "2026-01-01T00:00:00Z",
            "last_failed_at": "2026-01-01T00:00:00Z",
            "last_error": "x",
            "batch_id": None,
        },
        "journal": [],
    }
    upgraded = _with_unknown_fields(raw)
    out = docmod.to_json(docmod.loads(json.dumps(upgraded)))
    _assert_unknown_fields(out)
    # Known fields are not duplicated into the extras.
    assert set(out) - set(raw) == {"future_top"}


def _seed() -> dict[str, Any]:
    return {
        "version": 1,
        "poller_name": "orders",
        "source_fingerprint": "sha256:x",
        "checkpoint": {
            "cursor": {"kind": "int+pk", "value": 5, "tiebreaker": {"id": 5}},
            "last_successful_batch_id": "b",
            "updated_at": "2026-01-01T00:00:00.000000Z",
            "metadata": {"row_count": 1},
        },
        "lease": {
            "owner_id": "a",
            "fencing_token": 1,
            "acquired_at": "2026-01-01T00:00:00Z",
            "heartbeat_at": "2026-01-01T00:00:00Z",
            "expires_at": "2026-01-01T00:00:00Z",
            "released": False,
        },
        "failure": {
            "attempts": 1,
            "first_failed_at": "2026-01-01T00:00:00Z",
            "last_failed_at": "2026-01-01T00:00:00Z",
            "last_error": "x",
            "batch_id": "b",
            "done_event_ids": ["e1"],
        },
        "journal": [],
    }


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["lease", "released"], "false", "lease.released has the wrong type"),
        (["lease", "released"], 0, "lease.released has the wrong type"),
        (["checkpoint", "metadata", "row_count"], "100", "row_count has the wrong type"),
        (["checkpoint", "metadata", "row_count"], True, "row_count has the wrong type"),
        (["checkpoint", "metadata", "row_count"], -1, "row_count must not be negative"),
        (["checkpoint", "metadata"], [1], "checkpoint.metadata must be an object"),
        (["checkpoint", "last_successful_batch_id"], 7, "last_successful_batch_id has the wrong"),
        (["failure", "attempts"], "2", "failure.attempts has the wrong type"),
        (["failure", "attempts"], -2, "failure.attempts must not be negative"),
        (["failure", "last_error"], {"a": 1}, "failure.last_error has the wrong type"),
        (["failure", "batch_id"], 3, "failure.batch_id has the wrong type"),
        (["failure", "done_event_ids"], "e1", "done_event_ids must be a list"),
        (["failure", "batch_rows"], "10", "failure.batch_rows has the wrong type"),
        (["failure", "batch_end"], "x", "failure.batch_end must be an object"),
        (["failure"], [], "failure must be an object"),
        (["journal"], {"a": 1}, "journal must be a list"),
        (["journal"], [1], "journal must be a list of objects"),
    ],
)
def test_every_field_is_type_checked(path: list[str], value: object, message: str) -> None:
    raw = _seed()
    target: Any = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(CorruptStateError, match=message):
        docmod.loads(json.dumps(raw))


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_a_deeply_nested_document_is_corrupt_not_a_recursion_error(opener: str) -> None:
    depth = 200_000
    with pytest.raises(CorruptStateError, match="nested too deeply"):
        docmod.loads(opener * depth)


def test_a_deeply_nested_unknown_field_is_corrupt_not_a_recursion_error() -> None:
    raw = json.dumps(_seed())
    nested = '{"future":' + "[" * 200_000 + "]" * 200_000 + "," + raw[1:]
    with pytest.raises(CorruptStateError):
        docmod.loads(nested)


def test_status_reports_a_deeply_nested_document_as_corrupt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileCheckpointStore(tmp_path)
    store.write("orders", b"[" * 100_000, if_match=None)
    assert main(["status", "orders", "--store", str(tmp_path)]) != 0
    out, err = capsys.readouterr()
    assert "CorruptStateError: " in out + err
    assert "state document is nested too deeply" in out + err
