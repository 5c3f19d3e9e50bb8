"""The file store over files a person changed by hand: typed errors naming the file.

A directory where a document belongs (an unpacked backup, a mistyped ``mkdir``)
made a write or a delete fail with a bare ``IsADirectoryError`` out of the
store, which the runtime does not sort as a store error; a read already said
which file it could not read. A document saved with a byte-order mark (Windows
editors) is still a state document.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore
from dbtrigger._files import write_synced as real_write_synced
from dbtrigger.errors import CasConflictError, StoreError, StoreUnavailableError
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import new_document
from dbtrigger.state.stores import file as file_store


def test_a_directory_in_place_of_the_document_is_a_store_error_naming_it(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    (tmp_path / "orders.json").mkdir()
    for op in (
        lambda: store.read("orders"),
        lambda: store.write("orders", b"{}", if_match=None),
        lambda: store.write("orders", b"{}", if_match='"x"'),
        lambda: store.delete("orders"),
    ):
        with pytest.raises(StoreError, match=r"orders\.json"):
            op()
    assert (tmp_path / "orders.json").is_dir()  # nothing replaced or removed


def test_a_document_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    text = docmod.dumps(new_document("orders", "sha256:x"))
    (tmp_path / "orders.json").write_bytes(b"\xef\xbb\xbf" + text)
    stored = store.read("orders")
    assert stored is not None
    assert docmod.loads(stored.data).poller_name == "orders"


def test_a_document_copied_over_by_hand_is_never_overwritten_unseen(tmp_path: Path) -> None:
    """``cp backup.json orders.json`` (a restore by hand, the etag file left as it
    was) while a poller holds the etag it read: its compare-and-swap must lose, as
    against any other write, not overwrite the restored document unseen."""
    store = FileCheckpointStore(tmp_path)
    etag = store.write("orders", b'{"v": 1}', if_match=None)
    (tmp_path / "orders.json").write_bytes(b'{"v": "restored"}')  # in place, as cp does
    with pytest.raises(CasConflictError):
        store.write("orders", b'{"v": 2}', if_match=etag)
    stored = store.read("orders")
    assert stored is not None
    assert stored.data == b'{"v": "restored"}'
    assert stored.etag != etag
    assert store.write("orders", b'{"v": 3}', if_match=stored.etag)  # seen, then replaced


@pytest.mark.parametrize("failing", [1, 2])
def test_a_full_disk_mid_write_leaves_the_old_document_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    """Out of space at the etag (1) or at the document (2) of a write: the write is
    StoreUnavailableError, the document read is the old one, no temporary file stays,
    and a writer that re-reads gets through once there is room again."""
    store = FileCheckpointStore(tmp_path)
    etag = store.write("orders", b'{"v": 1}', if_match=None)
    calls = []

    def full(fh: Any, data: bytes) -> None:
        calls.append(data)
        if len(calls) == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_synced(fh, data)

    monkeypatch.setattr(file_store, "write_synced", full)
    with pytest.raises(StoreUnavailableError, match="No space left"):
        store.write("orders", b'{"v": 2}', if_match=etag)
    monkeypatch.undo()
    stored = store.read("orders")
    assert stored is not None
    assert stored.data == b'{"v": 1}'
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    store.write("orders", b'{"v": 3}', if_match=stored.etag)
    assert store.read("orders").data == b'{"v": 3}'  # type: ignore[union-attr]
