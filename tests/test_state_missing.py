"""A state document deleted while no worker ran (no ``start_from``): the next start
is not silent about it.

The poller starts over from the beginning, as a new one would (every row again:
at least once), but its durable history (beside the store by default) knows it is
not new: its first tick says so at WARNING, naming the history's last record and
the command that writes the document again at the last position recorded, and
``dbtrigger history`` / ``dbtrigger reset`` work on it instead of refusing with
"no state for poller".
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore
from dbtrigger.cli import main
from dbtrigger.runtime.poller import PollTrigger

APP = """
from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

trigger = PollTrigger(
    name="orders",
    source=SqlAlchemySource(
        url={url!r}, table="orders", cursor_column="updated_at", pk_columns=["id"]
    ),
    checkpoint_store=FileCheckpointStore({state!r}),
    batch_size=3,
)
"""


def _insert(url: str, keys: range) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, updated_at INTEGER)"
        )
        for key in keys:
            conn.exec_driver_sql(f"INSERT INTO orders VALUES ({key}, {key})")
    engine.dispose()


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``MODULE:trigger`` of a poller over 6 rows that delivered them all, then whose
    state document was deleted while no worker ran; row 7 was written meanwhile."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    _insert(url, range(1, 7))
    module = f"missing_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(APP.format(url=url, state=str(tmp_path / "state")))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    first = _trigger(module)
    seen: list[int] = []
    try:
        for _ in range(3):
            first.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        first.close()
    assert seen == [1, 2, 3, 4, 5, 6]
    FileCheckpointStore(tmp_path / "state").delete("orders")
    _insert(url, range(7, 8))
    return f"{module}:trigger"


def _trigger(module: str) -> PollTrigger:
    """A fresh instance of the app's trigger (a new process would import it anew)."""
    namespace: dict[str, object] = {}
    path = Path(f"{module}.py")
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the test's app
    trigger = namespace["trigger"]
    assert isinstance(trigger, PollTrigger)
    trigger.cli_source = f"{module}:trigger"
    return trigger


def test_the_first_tick_says_the_poller_is_not_new_and_starts_over(
    app: str, caplog: pytest.LogCaptureFixture
) -> None:
    trigger = _trigger(app.split(":", maxsplit=1)[0])
    seen: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            for _ in range(4):
                trigger.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        trigger.close()
    assert seen == [1, 2, 3, 4, 5, 6, 7]  # at least once: every row again, none lost
    said = [r for r in caplog.records if getattr(r, "event", None) == "state_missing"]
    assert len(said) == 1  # once a process
    assert said[0].levelno == logging.WARNING
    text = said[0].getMessage()
    assert "no state document, but its history holds records" in text
    assert "#2" in text  # the history's last record: the second commit
    assert f"dbtrigger reset orders --to-cursor 6 --pk id=6 --source {app}" in text
    assert "--from-file" in text


def test_history_shows_a_missing_document_and_reset_writes_it_again(
    app: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["history", "orders", "--source", app]) == 2
    out = capsys.readouterr()
    assert "MISSING" in out.out
    command = f"dbtrigger reset orders --to-cursor 6 --pk id=6 --source {app}"
    assert command in out.out

    # Without the trigger there is no source definition to write: refused, saying so.
    store = ["--store", str(Path("state").resolve())]
    assert main(["reset", "orders", "--to-cursor", "6", "--pk", "id=6", *store]) != 0
    assert "--source MODULE:ATTR" in capsys.readouterr().err
    # A poller the history does not know is refused as before.
    assert main(["reset", "orderz", "--to-beginning", *store]) != 0
    assert "no state for poller 'orderz'" in capsys.readouterr().err

    reset = ["reset", "orders", "--to-cursor", "6", "--pk", "id=6", "--source", app]
    assert main([*reset, "--reason", "state document lost"]) == 0  # a dry run
    assert not Path("state/orders.json").exists()
    assert main([*reset, "--reason", "state document lost", "--yes"]) == 0
    doc = json.loads(Path("state/orders.json").read_text())
    assert doc["checkpoint"]["cursor"]["tiebreaker"] == {"id": 6}

    trigger = _trigger(app.split(":", maxsplit=1)[0])
    seen: list[int] = []
    try:
        for _ in range(2):
            trigger.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        trigger.close()
    assert seen == [7]  # on from where the history ended


def test_status_says_the_document_is_missing_and_how_to_write_it_again(
    app: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dbtrigger status` is what an operator runs first; it said only "no state for
    poller 'orders' ...; it holds no poller", as of a name never used, while history
    and the poller's warning said MISSING and printed the reset that writes it again."""
    assert main(["status", "orders", "--source", app]) == 1
    out = capsys.readouterr().out
    assert "MISSING (deleted or lost" in out
    command = f"dbtrigger reset orders --to-cursor 6 --pk id=6 --source {app}"
    assert command in out
    assert main(["status", "orders", "--source", app, "--json"]) == 1
    assert command in json.loads(capsys.readouterr().out)["resume"]
    # A name nothing knows says nothing of the kind.
    assert main(["status", "orderz", "--source", app]) == 1
    assert "MISSING" not in capsys.readouterr().out
