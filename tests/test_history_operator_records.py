"""Where an operator's state command records itself: the trigger's own history.

``dbtrigger reset|rewind|bookmark|skip-batch|...`` and ``dbtrigger dead-letter
replay|discard`` given the trigger (``--trigger MODULE:TRIGGER``) append their
record to the history that trigger keeps (``history=``), none with
``history=False``; given only a store, they use the history beside it only if
it already holds the poller's records, and otherwise say that none was written
to rather than starting one there.
"""

from __future__ import annotations

import json
import sys
import types
import uuid
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.history import FileHistory, history_for
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.testing import MemorySource


def _trigger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: object) -> str:
    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        for event in events:
            if int(event.pk["id"]) == 3:
                ctx.reject(event, "downstream refused it")

    trigger = PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i} for i in range(1, 11)], cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
        batch_size=5,
        **options,  # type: ignore[arg-type]
    )
    trigger.handler(handler)
    trigger.drain(handler)
    module = f"records_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    return f"{module}:trigger"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def _beside(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "state").glob("*.history.*"))


def test_a_reset_and_a_discard_are_recorded_in_the_trigger_s_own_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    own = FileHistory(tmp_path / "elsewhere")
    spec = _trigger(tmp_path, monkeypatch, history=own)
    change = ("--trigger", spec, "--reason", "r", "--yes")
    code, out = _cli(capsys, "reset", "orders", "--to-beginning", *change)
    assert code == 0, out
    assert [r.get("operation") for r in own.read("orders")][-1] == "reset"
    code, out = _cli(capsys, "dead-letter", "list", "orders", "--trigger", spec, "--json")
    [letter] = json.loads(out)
    code, out = _cli(
        capsys, "dead-letter", "discard", "orders", "--id", letter["event_id"], *change
    )
    assert code == 0, out
    assert [r.get("operation") for r in own.read("orders")][-1] == "dead_letter_discard"
    assert not _beside(tmp_path)  # no stray history beside the store
    assert "not recorded" not in out


def test_with_history_false_a_reset_starts_no_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _trigger(tmp_path, monkeypatch, history=False)
    code, out = _cli(
        capsys, "reset", "orders", "--to-beginning", "--trigger", spec, "--reason", "r", "--yes"
    )
    assert code == 0, out
    assert not _beside(tmp_path)
    assert "not recorded" not in out  # the trigger said: none


def test_without_the_trigger_a_store_without_the_poller_s_history_is_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    own = FileHistory(tmp_path / "elsewhere")
    _trigger(tmp_path, monkeypatch, history=own)
    store = str(tmp_path / "state")
    code, out = _cli(
        capsys, "reset", "orders", "--to-beginning", "--store", store, "--reason", "r", "--yes"
    )
    assert code == 0, out
    assert not _beside(tmp_path)
    assert "not recorded in a history" in out
    assert "--trigger MODULE:TRIGGER" in out
    assert "reset" in [e.get("operation") for e in _journal(tmp_path)]  # the journal keeps it


def test_without_the_trigger_the_default_history_beside_the_store_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _trigger(tmp_path, monkeypatch)  # the default: a history beside the store
    store = str(tmp_path / "state")
    code, out = _cli(
        capsys, "reset", "orders", "--to-beginning", "--store", store, "--reason", "r", "--yes"
    )
    assert code == 0, out
    history = history_for(FileCheckpointStore(tmp_path / "state"))
    assert history is not None
    assert [r.get("operation") for r in history.read("orders")][-1] == "reset"
    assert "not recorded" not in out


def _journal(tmp_path: Path) -> list[dict[str, object]]:
    from dbtrigger.state import document as docmod  # noqa: PLC0415

    stored = FileCheckpointStore(tmp_path / "state").read("orders")
    assert stored is not None
    return [dict(e) for e in docmod.loads(stored.data).journal]
