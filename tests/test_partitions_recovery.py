"""A partitions membership document that cannot be read: every member stops with an
error naming the poller, the store key and ``dbtrigger partitions reset-layout``,
which rebuilds it from the partitions' own state documents (the current ones,
over the whole bucket space exactly once; merge floors dropped, so rows may be
delivered again but none is skipped)."""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore
from dbtrigger.cli import main
from dbtrigger.errors import CasConflictError, CorruptStateError
from dbtrigger.partitions import PartitionedPoller, bucket_of, regroup
from dbtrigger.partitions.buckets import BUCKETS
from dbtrigger.partitions.layout import Partition
from dbtrigger.partitions.recovery import _Candidate, _cover
from tests.databases import TestDatabase
from tests.test_partitions_poller import insert, make_table, source


@pytest.fixture
def made() -> Iterator[list[PartitionedPoller]]:
    out: list[PartitionedPoller] = []
    yield out
    for member in out:
        with contextlib.suppress(Exception):
            member.leave()


def _member(db: TestDatabase, store: FileCheckpointStore, made: list[PartitionedPoller]) -> Any:
    member = PartitionedPoller(
        name="orders",
        source=source(db),
        checkpoint_store=store,
        partitions=4,
        balance_interval_seconds=0.2,
        member_ttl_seconds=1.0,
        min_hold_cycles=1,
        join_window_seconds=0,
        member_id=f"m{len(made)}",
        batch_size=20,
    )
    made.append(member)
    return member


def _corrupt(store: FileCheckpointStore) -> None:
    """Truncate the membership document; a member's balance cycle may write it between
    our read and our write (every 0.2 s here): read it again then, a bounded number of
    times."""
    for _ in range(100):
        stored = store.read("orders.members")
        assert stored is not None
        try:
            store.write(
                "orders.members", b'{"kind": "dbtrigger-membership", "partit', if_match=stored.etag
            )
        except CasConflictError:
            continue
        return
    raise AssertionError("the membership document kept changing under the test")


def test_a_corrupt_membership_rebuilt_from_the_partition_documents_skips_no_row(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    made: list[PartitionedPoller],
) -> None:
    make_table(sqlite_db, 200)
    store = FileCheckpointStore(tmp_path / "state")
    member = _member(sqlite_db, store, made)
    member.balance()
    member.drain(lambda events: None)
    insert(sqlite_db, range(201, 204))  # the parents' checkpoints now differ: floors
    member.drain(lambda events: None)
    regroup.apply(member, 2, actor="t", reason="r", wait_seconds=5)  # 4 retired, 2 current
    member.balance()
    assert any(p.floors for p in member.membership.partitions)
    insert(sqlite_db, range(204, 261))  # not delivered yet
    _corrupt(store)

    with pytest.raises(CorruptStateError) as caught:
        member.balance()
    text = str(caught.value)
    assert "'orders.members'" in text
    assert "poller 'orders'" in text
    assert "dbtrigger partitions reset-layout --trigger MODULE:ATTR --from-state --force" in text

    module = f"parts_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = member  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    # the state commands point at reset-layout, and never write a state document there
    capsys.readouterr()
    assert main(["status", "--store", str(tmp_path / "state")]) == 1
    assert "partitions reset-layout" in capsys.readouterr().out
    corrupt = store.read("orders.members")
    reset = ["reset", "orders.members", "--to-beginning", "--store", str(tmp_path / "state")]
    assert main([*reset, "--force", "--yes", "--reason", "r"]) == 2
    assert "partitions reset-layout" in capsys.readouterr().err
    assert store.read("orders.members") == corrupt

    args = ["partitions", "reset-layout", "--trigger", f"{module}:trigger", "--from-state"]
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dry run" in out
    assert "p000-128" in out
    assert "p128-256" in out
    assert "p000-064" not in out
    assert main([*args, "--reason", "corrupt", "--yes"]) == 2  # --force is required
    assert main([*args, "--reason", "corrupt", "--yes", "--force", "--backup-dir", "bk"]) == 0
    assert len(list((tmp_path / "bk").iterdir())) == 1  # the unreadable bytes, kept

    member.balance()  # the stopped member goes on with the rebuilt layout
    assert member.membership is not None
    assert [p.id for p in member.membership.partitions] == ["p000-128", "p128-256"]
    assert sorted(member.owned) == ["p000-128", "p128-256"]
    assert all(not p.floors for p in member.membership.partitions)
    delivered: list[int] = []
    member.drain(lambda events: delivered.extend(e.pk["id"] for e in events))
    assert set(range(204, 261)) <= set(delivered)  # nothing skipped
    assert set(delivered) <= set(range(1, 261))
    assert main([*args, "--reason", "again", "--yes", "--force"]) == 2  # readable: refused


def test_the_rebuilt_ranges_cover_every_bucket_once_current_documents_first() -> None:
    def doc(lo: int, hi: int, *, retired: bool = False, updated: str = "") -> _Candidate:
        return _Candidate(Partition(lo, hi), retired, updated, "x")

    def ranges(found: list[_Candidate | Partition]) -> list[tuple[int, int]]:
        return [
            (c.lo, c.hi) if isinstance(c, Partition) else (c.partition.lo, c.partition.hi)
            for c in found
        ]

    # current children beat the retired parent of the same buckets
    chosen = _cover([doc(0, 128, retired=True), doc(0, 64), doc(64, 128), doc(128, 256)])
    assert ranges(chosen) == [(0, 64), (64, 128), (128, 256)]
    assert not any(isinstance(c, _Candidate) and c.retired for c in chosen)
    # a retired document is used where nothing current covers the rest
    assert ranges(_cover([doc(0, 128, retired=True), doc(0, 96), doc(128, 256)])) == [
        (0, 128),
        (128, 256),
    ]
    # buckets no document covers get fresh partitions (from the beginning), never a gap
    assert ranges(_cover([doc(64, 128)])) == [(0, 64), (64, 128), (128, BUCKETS)]
    assert ranges(_cover([])) == [(0, BUCKETS)]
    for found in (_cover([doc(0, 96), doc(32, 200), doc(96, 256)]), _cover([doc(10, 20)])):
        spans = ranges(found)
        assert spans[0][0] == 0
        assert spans[-1][1] == BUCKETS
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert bucket_of([1]) < BUCKETS


def test_a_membership_backup_of_an_earlier_layout_is_put_back_and_said_so(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    made: list[PartitionedPoller],
) -> None:
    make_table(sqlite_db, 40)
    store = FileCheckpointStore(tmp_path / "state")
    member = _member(sqlite_db, store, made)
    member.balance()
    member.drain(lambda events: None)
    done = regroup.apply(member, 8, actor="t", reason="r", wait_seconds=5)
    backup = tmp_path / "members.json"
    backup.write_bytes(done.backups["orders.members"])  # the 4-partition layout
    member.balance()
    before = member.membership.generation
    _corrupt(store)
    module = f"parts_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = member  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    args = ["partitions", "reset-layout", "--trigger", f"{module}:trigger"]
    capsys.readouterr()
    with pytest.raises(SystemExit):  # one of them
        main([*args, "--from-file", str(backup), "--from-state"])
    assert main(args) == 2
    capsys.readouterr()
    assert main([*args, "--from-file", str(tmp_path / "missing.json")]) == 2
    assert "cannot read " in capsys.readouterr().err  # not a FileNotFoundError traceback
    assert main([*args, "--from-file", str(backup)]) == 0
    assert "retired by a later regroup" in capsys.readouterr().out
    assert main([*args, "--from-file", str(backup), "--reason", "r", "--yes", "--force"]) == 0
    member.balance()
    assert [p.id for p in member.membership.partitions] == [
        "p000-064",
        "p064-128",
        "p128-192",
        "p192-256",
    ]
    assert member.membership.generation > before
