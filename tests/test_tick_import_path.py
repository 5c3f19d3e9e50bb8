"""A tick that reads a good state document does not look for its trigger's import path.

The path (``module:attribute``, pasted into the commands an unreadable
document's error prints) is found by walking the globals of every imported
module: about half of a one-batch tick's CPU in an application that imports
SQLAlchemy and a driver. It is looked for when that error is made, and then
still named in it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.errors import CorruptStateError
from dbtrigger.runtime import poller as pollermod
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state.stores.base import StoredDocument

MODULE = "tick_import_path_app"  # (not dbtrigger*: the lookup skips those)


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PollTrigger, list[object]]]:
    """A trigger held by an importable module's global, and the import-path lookups made."""
    source = MemorySource(
        [{"id": i, "seq": i} for i in range(1, 8)], cursor_column="seq", pk_columns=("id",)
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=2,
        history=False,
    )
    module = types.ModuleType(MODULE)
    module.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, module)
    looked: list[object] = []
    real = pollermod.import_path_of

    def counting(obj: object) -> str | None:
        looked.append(obj)
        return real(obj)

    monkeypatch.setattr(pollermod, "import_path_of", counting)
    try:
        yield trigger, looked
    finally:
        trigger.close()


def test_ticks_over_a_good_document_never_look_for_the_import_path(
    app: tuple[PollTrigger, list[object]],
) -> None:
    trigger, looked = app
    seen: list[int] = []
    for _ in range(5):  # the first creates the document; each later one reads it
        trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events))
    assert seen == [1, 2, 3, 4, 5, 6, 7]
    assert looked == []


def test_an_unreadable_document_still_names_the_import_path(
    app: tuple[PollTrigger, list[object]],
) -> None:
    trigger, looked = app
    trigger.tick(lambda events: None)
    store = trigger.store
    assert isinstance(store, InMemoryCheckpointStore)
    stored = store.read("orders")
    assert isinstance(stored, StoredDocument)
    store.write("orders", b"{not json", if_match=stored.etag)
    with pytest.raises(CorruptStateError) as raised:
        trigger.tick(lambda events: None)
    assert f"--source {MODULE}:trigger" in str(raised.value)
    assert looked == [trigger]
