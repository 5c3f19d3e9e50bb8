"""The operator's ways out of a stuck poller, end to end on the file store and Azurite:
``skip-batch`` skips exactly the batch that failed (or refuses), and
``reset --accept-source`` adopts a changed source definition.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from dbtrigger import HandlerError, PollTrigger, SqlAlchemySource
from dbtrigger.cursor import Position
from dbtrigger.errors import CorruptStateError, FingerprintMismatchError
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import decide_acquire
from tests.databases import TestDatabase
from tests.test_cli_state import (  # noqa: F401 - fixtures used by name
    App,
    Backend,
    backend,
    make_app,
    run,
)


@pytest.fixture
def app(
    sqlite_db: TestDatabase,
    backend: Backend,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[App]:
    app = make_app(sqlite_db, backend, tmp_path, monkeypatch)
    app.db = sqlite_db  # type: ignore[attr-defined]
    yield app
    app.close()


def _fail_once_at(app: App, row: int) -> None:
    app.tick()  # rows 1..10 committed: checkpoint (100, id=10)
    app.fail_on = {row}
    with pytest.raises(HandlerError):
        app.tick()  # batch 11..20 fails


def _insert(app: App, id_: int, seq: int) -> None:
    app.db.execute(  # type: ignore[attr-defined]
        "INSERT INTO events (id, seq) VALUES (:id, :seq)", {"id": id_, "seq": seq}
    )


def _skip(app: App, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    return run(
        capsys,
        app.cli(
            "skip-batch", "orders", "--source", f"{app.module}:trigger",
            "--reason", "row 15 is corrupt", *extra,
        ),
    )  # fmt: skip


def test_the_failure_record_names_the_failed_batch(app: App) -> None:
    _fail_once_at(app, 15)
    failure = app.doc().failure
    assert failure is not None
    assert failure.batch_end == Position(200, {"id": 20})
    assert failure.batch_rows == 10
    assert failure.batch_digest is not None
    assert failure.batch_digest.startswith("sha256:")


def test_skip_batch_skips_the_failed_batch_even_when_rows_were_added_after_it(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    _fail_once_at(app, 15)
    # More rows arrive after the failure; the batch a skip re-reads must not grow.
    app.trigger.batch_size = 25  # and the trigger's batch size changed since
    code, out, err = _skip(app, capsys, "--yes")
    assert code == 0, out + err
    doc = app.doc()
    assert doc.position == Position(200, {"id": 20})
    entry = doc.journal[-1]
    assert entry["skipped_rows"] == 10
    assert entry["skipped_keys"] == [{"id": i} for i in range(11, 21)]
    app.fail_on = set()
    app.seen.clear()
    app.tick()
    assert app.seen[:10] == list(range(21, 31))


def test_skip_batch_refuses_when_a_row_no_handler_saw_lies_inside_the_batch(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    _fail_once_at(app, 15)
    _insert(app, 1000, 155)  # committed late, between rows 15 and 16: never delivered
    before = app.raw()
    code, _, err = _skip(app, capsys, "--yes")
    assert code == 2
    assert "no longer holds exactly the failed batch" in err
    assert app.raw() == before  # nothing written


def test_skip_batch_refuses_when_the_batch_changed_with_the_same_count(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    _fail_once_at(app, 15)
    app.db.execute("DELETE FROM events WHERE id = 13")  # type: ignore[attr-defined]
    _insert(app, 1000, 155)  # same count, same last row, one unseen row
    code, _, err = _skip(app, capsys, "--yes")
    assert code == 2
    assert "no longer holds exactly the failed batch" in err


def test_skip_batch_refuses_without_a_recorded_batch(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.tick()
    code, _, err = _skip(app, capsys)
    assert code == 2
    assert "no failing batch" in err

    _fail_once_at(app, 25)
    # A record written by an older dbtrigger: no batch_end / batch_rows.
    data, etag = app.raw()
    raw = json.loads(data)
    for key in ("batch_end", "batch_rows", "batch_digest"):
        del raw["failure"][key]
    app.backend.store.write("orders", json.dumps(raw).encode(), if_match=etag)
    code, _, err = _skip(app, capsys, "--yes")
    assert code == 2
    assert "does not say where the failing batch ended" in err


# --- reset --accept-source --------------------------------------------------------------------


def test_fingerprint_error_names_the_command_and_the_command_works(
    app: App, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app.tick()
    stored_before = app.doc()
    new = _new_trigger(app, monkeypatch)
    with pytest.raises(FingerprintMismatchError) as info:
        new.tick(app.handler)
    message = str(info.value)
    spec = f"{app.module}:changed"
    # The trigger is a global of an imported module: the command names it.
    command = (
        f"dbtrigger reset orders --accept-source {spec} --reason 'source definition changed' --yes"
    )
    assert command in message
    assert "<module>" not in message
    # Dry run first: nothing written.
    code, out, _ = run(
        capsys, app.cli("reset", "orders", "--accept-source", spec, "--reason", "new filter")
    )
    assert code == 0, out
    assert "dry run" in out
    assert app.doc() == stored_before

    code, out, err = run(
        capsys,
        app.cli("reset", "orders", "--accept-source", spec, "--reason", "new filter", "--yes"),
    )
    assert code == 0, out + err
    doc = app.doc()
    assert doc.source_fingerprint == new.source.fingerprint()
    assert doc.position == stored_before.position  # the checkpoint is kept
    entry = doc.journal[-1]
    assert entry["operation"] == "accept_source"
    assert entry["fingerprint_before"] == stored_before.source_fingerprint
    assert entry["fingerprint_after"] == new.source.fingerprint()
    assert list(app.backups.iterdir())  # the previous document was saved

    app.seen.clear()
    new.tick(app.handler)
    assert app.seen[:10] == list(range(11, 21))


def test_accept_source_with_a_move_and_under_a_live_lease(
    app: App, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app.tick()
    new = _new_trigger(app, monkeypatch)
    spec = f"{app.module}:changed"
    # A live lease held by someone else refuses the change unless --force.
    data, etag = app.raw()
    doc = docmod.loads(data)
    live = decide_acquire(
        doc,
        poller="orders",
        fingerprint=doc.source_fingerprint,
        owner="someone-else",
        now=dt.datetime.now(dt.timezone.utc),
        ttl=dt.timedelta(minutes=10),
    )
    app.backend.store.write("orders", docmod.dumps(live.document), if_match=etag)
    argv = ["reset", "orders", "--accept-source", spec, "--to-beginning", "--reason", "r"]
    code, _, err = run(capsys, app.cli(*argv, "--yes"))
    assert code == 2
    assert "leased by someone-else" in err
    code, out, err = run(capsys, app.cli(*argv, "--yes", "--force"))
    assert code == 0, out + err
    after = app.doc()
    assert after.source_fingerprint == new.source.fingerprint()
    assert after.checkpoint is None  # moved to the beginning
    assert after.journal[-1]["fenced"]["owner_id"] == "someone-else"

    code, _, err = run(capsys, app.cli("reset", "orders", "--reason", "r"))
    assert code == 2
    assert "--accept-source" in err


def _new_trigger(app: App, monkeypatch: pytest.MonkeyPatch) -> PollTrigger:
    """A redeployed trigger over a changed source definition, importable as MODULE:changed."""
    source = SqlAlchemySource(
        url=app.db.url,  # type: ignore[attr-defined]
        table="events",
        cursor_column="seq",
        pk_columns=["id"],
        where="seq > 0",
        visibility="none",
    )
    assert source.fingerprint() != app.source.fingerprint()
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=app.backend.store, batch_size=10
    )
    monkeypatch.setattr(sys.modules[app.module], "changed", trigger, raising=False)
    return trigger


# --- a state document nobody can read --------------------------------------------------


def test_a_corrupt_document_is_named_and_replaced_only_from_a_backup_with_force(
    app: App, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    app.tick()  # rows 1..10 committed
    good, etag = app.raw()
    saved = tmp_path / "orders.backup.json"
    saved.write_bytes(good)
    truncated = good[: len(good) // 2]
    app.backend.store.write("orders", truncated, if_match=etag)

    # Every command names the poller, the store and the way out; nothing is written.
    for argv in (["history", "orders"], ["reset", "orders", "--to-beginning", "--force"]):
        code, _, err = run(capsys, app.cli(*argv))
        assert code == 2
        assert "poller 'orders'" in err
        assert "not valid JSON" in err
        assert "--from-file BACKUP --force" in err
        assert "Traceback" not in err
    restore = ["reset", "orders", "--from-file", str(saved), "--reason", "corrupt", "--yes"]
    code, _, err = run(capsys, app.cli(*restore))  # without --force: refused
    assert code == 2
    assert "--force" in err
    assert app.raw()[0] == truncated

    code, out, err = run(capsys, app.cli(*restore, "--force"))
    assert code == 0, err
    assert "replacing an unreadable state document" in out
    assert "to undo" not in out  # the unreadable bytes are kept, not offered back
    restored, original = app.doc().checkpoint, docmod.loads(good).checkpoint
    assert restored is not None
    assert original is not None
    assert restored.position == original.position
    (kept,) = app.backups.iterdir()
    assert kept.read_bytes() == truncated
    app.tick()  # the poller carries on from the restored checkpoint
    assert app.seen == list(range(1, 21))


def test_a_corrupt_backup_file_is_named(
    app: App, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    app.tick()
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1')
    code, _, err = run(capsys, app.cli("reset", "orders", "--from-file", str(broken)))
    assert code == 2
    assert f"{broken} is not a usable backup" in err


def test_with_no_backup_a_corrupt_document_is_replaced_by_a_reset_naming_the_trigger(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.tick()  # rows 1..10 committed
    good, etag = app.raw()
    app.backend.store.write("orders", b'{"version": 1, "poller_name"', if_match=etag)
    start_over = ["reset", "orders", "--to-beginning", "--reason", "corrupt", "--yes", "--force"]
    code, _, err = run(capsys, app.cli(*start_over))  # the fingerprint is unknown: refused
    assert code == 2
    assert "--to-beginning --source MODULE:ATTR --force" in err
    code, out, err = run(capsys, app.cli(*start_over, "--source", f"{app.module}:trigger"))
    assert code == 0, err
    assert "replacing an unreadable state document" in out
    doc = app.doc()
    assert doc.checkpoint is None
    assert doc.source_fingerprint == docmod.loads(good).source_fingerprint
    app.tick()  # delivered again from the beginning, no fingerprint mismatch
    assert app.seen == list(range(1, 11)) * 2


def test_with_no_backup_the_history_names_the_reset_that_resumes_where_it_stood(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corrupt document and no backup: the way out offered was --to-beginning (every row
    delivered again), and `dbtrigger history`, which holds the last position committed,
    refused to run like every other command. It now shows the records and the reset
    --to-cursor after the last of them; pasted, it resumes there with no row twice."""
    app.tick()
    app.tick()  # rows 1..20 committed
    _, etag = app.raw()
    app.backend.store.write("orders", b'{"version": 1, "poller_name"', if_match=etag)
    with pytest.raises(CorruptStateError, match="dbtrigger history orders"):
        app.tick()
    source = ["--source", f"{app.module}:trigger"]
    code, out, err = run(capsys, app.cli("history", "orders", *source))
    assert code == 2  # the document is still unreadable: said on stderr as before
    assert "not valid JSON" in err
    assert "batch_" in out  # the records are shown
    assert "resume       after 200 id=20, the last position recorded" in out
    command = out.rsplit("\n  ", 1)[1].strip().split(" && ")[-1]
    assert command.startswith("dbtrigger reset orders --to-cursor 200 --pk id=20 ")
    # The same store named explicitly: run in this process, the command would close the
    # trigger's own store on its way out, as its process ending does.
    code, _, err = run(capsys, [*shlex.split(command)[1:], *app.backend.args])
    assert code == 0, err
    app.tick()
    assert app.seen == list(range(1, 31))  # on from row 21: nothing lost, nothing twice


def test_accepting_a_new_key_moves_the_checkpoint_or_is_refused(
    app: App, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key columns changed (pk_columns ["id"] -> ["id", "note"]): the mismatch error
    prints `reset --accept-source ... --yes`, which kept the checkpoint with its old key,
    and every tick after it failed with "checkpoint tiebreaker lacks primary-key column
    'note'", naming no poller and no way out. accept-source alone is now refused, saying
    to move the checkpoint in the same command; with --to-cursor and the new key it runs."""
    app.tick()  # rows 1..10 committed: checkpoint (100, id=10)
    app.db.execute("UPDATE events SET note = 'n'")  # type: ignore[attr-defined]
    source = SqlAlchemySource(
        url=app.db.url,  # type: ignore[attr-defined]
        table="events",
        schema=app.db.schema,  # type: ignore[attr-defined]
        cursor_column="seq",
        pk_columns=["id", "note"],
        visibility="none",
    )
    rekeyed = PollTrigger(
        name="orders", source=source, checkpoint_store=app.backend.store, batch_size=10
    )
    module = types.ModuleType(f"{app.module}_rekeyed")
    module.trigger = rekeyed  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(FingerprintMismatchError, match="--accept-source"):
        rekeyed.tick(app.handler)
    accept = ["reset", "orders", "--accept-source", f"{module.__name__}:trigger"]
    code, _, err = run(capsys, app.cli(*accept, "--reason", "new key", "--yes"))
    assert code == 2
    assert "the key columns changed (id -> id, note)" in err
    assert "--to-cursor VALUE --pk id=VALUE --pk note=VALUE" in err
    moved = ["--to-cursor", "100", "--pk", "id=10", "--pk", "note=n", "--reason", "r", "--yes"]
    code, _, err = run(capsys, app.cli(*accept, *moved))
    assert code == 0, err
    assert rekeyed.tick(app.handler) == 10
    assert app.seen == list(range(1, 21))  # on from row 11, nothing twice
    source.close()


def test_a_hand_edited_key_in_the_checkpoint_is_named_and_repaired_by_the_command_it_prints(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose tiebreaker lost the key column (edited by hand: "id" -> "idx")
    failed every tick with "checkpoint tiebreaker lacks primary-key column 'id'", naming
    no poller, store or way out, and the reset --to-cursor that would repair it was refused
    ("the checkpoint's key is ['idx'], got --pk for ['id']"). The tick's error now names
    the poller and the reset; with --source that reset takes the source's key, and the
    poller carries on after the row it names, nothing lost, nothing twice."""
    app.tick()  # rows 1..10 committed: checkpoint (100, id=10)
    data, etag = app.raw()
    raw = json.loads(data)
    raw["checkpoint"]["cursor"]["tiebreaker"] = {"idx": 10}
    raw["checkpoint"]["cursor"]["tiebreaker_kinds"] = {"idx": "int"}
    app.backend.store.write("orders", json.dumps(raw).encode(), if_match=etag)
    with pytest.raises(CorruptStateError) as caught:
        app.tick()
    message = str(caught.value)
    assert "the checkpoint of poller 'orders' in " in message
    assert "lacks primary-key column 'id'; it has ['idx']" in message
    assert (
        f"dbtrigger reset orders --to-cursor VALUE --pk NAME=VALUE --source {app.module}:trigger"
        in message
    )
    repair = ["--to-cursor", "100", "--pk", "id=10", "--source", f"{app.module}:trigger"]
    code, _, err = run(capsys, app.cli("reset", "orders", *repair, "--reason", "r", "--yes"))
    assert code == 0, err
    assert app.doc().position == Position(100, {"id": 10})
    app.tick()
    assert app.seen == list(range(1, 21))  # on from row 11: nothing lost, nothing twice


def test_another_pollers_document_under_this_name_is_named_by_status_and_replaced(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """A document copied under this poller's name (its poller_name says 'invoices'): every
    tick refuses it, but `dbtrigger status` showed it as healthy (exit 0), and the reset
    the tick's error prints applied to it (a reset keeps the document's poller name) while
    every tick after it kept failing. The CLI now refuses it as the ticks do, so the reset
    with --force replaces it and the poller runs again."""
    app.tick()  # rows 1..10 committed
    data, etag = app.raw()
    raw = json.loads(data)
    raw["poller_name"] = "invoices"
    app.backend.store.write("orders", json.dumps(raw).encode(), if_match=etag)
    with pytest.raises(CorruptStateError, match="belongs to poller 'invoices'"):
        app.tick()
    code, out, err = run(capsys, app.cli("status", "orders"))
    assert code != 0
    assert "belongs to poller 'invoices'" in out + err
    resume = ["--to-cursor", "100", "--pk", "id=10", "--source", f"{app.module}:trigger"]
    code, out, err = run(capsys, app.cli("reset", "orders", *resume, "--reason", "r", "--yes"))
    assert code == 2  # not without --force: nothing in it can be checked
    assert "belongs to poller 'invoices'" in err
    code, out, err = run(
        capsys, app.cli("reset", "orders", *resume, "--force", "--reason", "r", "--yes")
    )
    assert code == 0, err
    assert "replacing an unreadable state document" in out
    assert app.doc().poller_name == "orders"
    app.tick()
    assert app.seen == list(range(1, 21))  # on from row 11: nothing lost, nothing twice


def test_status_with_the_trigger_named_prints_the_ways_out_ready_to_paste(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dbtrigger status --source app:trigger` on an unreadable document printed the ways
    out with `--source MODULE:ATTR` to fill in, while the tick's own error names the
    trigger; the status now names it too (only for that trigger's own poller)."""
    app.tick()
    good, etag = app.raw()
    app.backend.store.write("orders", good[: len(good) // 2], if_match=etag)
    spec = f"{app.module}:trigger"
    for argv in (["status"], ["status", "orders"]):
        code, out, err = run(capsys, app.cli(*argv, "--source", spec))
        assert code == 1
        assert f"dbtrigger reset orders --to-beginning --source {spec} --force" in out + err
        assert "MODULE:ATTR" not in out + err
