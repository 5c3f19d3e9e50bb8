"""A worker killed mid-batch, and the one started in its place (a new user's first crash).

``kill -9`` (or a crash, or a closed terminal) leaves the lease to lapse a TTL
later: 120 s by default. The worker started again on the same machine waited
those two minutes told only "lease held by vm/14017/532c0e66 until ...", with
nothing saying that pid 14017 was gone or that ``dbtrigger release-lease``
frees the lease now. The tick's line says both when the holder was a process
of this host that no longer runs, and nothing more of a live or foreign holder.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.errors import LostLeaseError
from dbtrigger.runtime.quiet import QuietCadence
from dbtrigger.runtime.trigger import TickResult, gone_holder
from dbtrigger.state import document as docmod
from dbtrigger.testing import MemorySource


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process of this host that has exited (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _busy(holder: str) -> str:
    text, fields = TickResult(0, 0, "lease_busy", holder=holder).summary(5)
    assert fields["holder"] == holder
    return text


def test_a_holder_that_no_longer_runs_here_is_named_with_what_frees_it(dead_pid: int) -> None:
    text = _busy(f"{socket.gethostname()}/{dead_pid}/532c0e66")
    assert f"pid {dead_pid} is not running on this host" in text
    assert "`dbtrigger release-lease " in text
    assert text.endswith("; next tick in 5s")


@pytest.mark.parametrize(
    "holder",
    [
        f"{socket.gethostname()}/{os.getppid()}/532c0e66",  # alive
        f"{socket.gethostname()}/{os.getpid()}/532c0e66",  # this very process
        "another-host/1/532c0e66",  # not ours to judge
        "funcapp/instance-abc123",  # an owner id of the user's own making
        "",
    ],
    ids=["alive", "this-process", "another-host", "own-owner-id", "empty"],
)
def test_a_live_foreign_or_unreadable_holder_gets_no_hint(holder: str) -> None:
    assert gone_holder(holder) == ""
    assert "not running" not in _busy(holder)


def test_the_worker_started_again_says_so_of_the_killed_ones_lease(dead_pid: int) -> None:
    store = InMemoryCheckpointStore()
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    killed = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        owner_id=f"{socket.gethostname()}/{dead_pid}/532c0e66",
    )
    again = PollTrigger(name="orders", source=source, checkpoint_store=store)
    said: list[str] = []

    def handler(events: list[RowChange]) -> None:
        assert again.tick_result(lambda events: None).outcome == "lease_busy"
        assert again.last_result is not None
        said.append(again.last_result.summary(None)[0])

    killed.tick(handler)
    (line,) = said
    assert line.startswith(f"lease held by {socket.gethostname()}/{dead_pid}/532c0e66 until ")
    assert f"(pid {dead_pid} is not running on this host" in line


def test_the_command_it_prints_frees_the_killed_ones_lease(
    dead_pid: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The hint was a bare `dbtrigger release-lease`: no poller, no store, and without
    --force a release of the still-unexpired lease is refused. The command printed now
    runs as it is and frees the lease, so the worker started again takes over at once."""
    store = FileCheckpointStore(str(tmp_path / "state"))
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    killed = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        owner_id=f"{socket.gethostname()}/{dead_pid}/532c0e66",
    )
    again = PollTrigger(name="orders", source=source, checkpoint_store=store)
    in_handler, let_go = threading.Event(), threading.Event()

    def hangs(events: list[RowChange]) -> None:  # the process dies here, as far as the
        in_handler.set()  # store can tell: its lease is left behind, not released
        let_go.wait(30)

    outcome: list[BaseException] = []

    def killed_worker() -> None:
        try:
            killed.tick_result(hangs)
        except LostLeaseError as exc:  # fenced out by the release: commits nothing
            outcome.append(exc)

    worker = threading.Thread(target=killed_worker, daemon=True)
    worker.start()
    assert in_handler.wait(30)
    assert again.tick_result(lambda events: None).outcome == "lease_busy"
    assert again.last_result is not None
    line = again.last_result.summary(None)[0]
    command = re.search(r"`(dbtrigger release-lease [^`]+)`", line)
    assert command is not None, line
    # dbtrigger status said "live, ... renewed 3s ago" of it, nothing more.
    assert main(["status", "orders", "--store", str(tmp_path / "state")]) == 0
    shown = capsys.readouterr().out
    assert f"(pid {dead_pid} is not running on this host" in shown
    assert "`dbtrigger release-lease orders --store STORE --force --reason R --yes`" in shown
    monkeypatch.chdir(tmp_path.parent)  # pasted elsewhere, it still finds the store
    assert main(shlex.split(command.group(1))[1:]) == 0
    seen: list[int] = []
    assert again.tick_result(lambda events: seen.extend(e.pk["id"] for e in events)).rows == 1
    assert seen == [1]
    let_go.set()
    worker.join(30)
    assert [type(exc) for exc in outcome] == [LostLeaseError]


def _level(cadence: QuietCadence, result: TickResult) -> tuple[int, str]:
    level, text, _ = cadence.line(result, 5)
    return level, text


def _held_elsewhere(
    store: InMemoryCheckpointStore,
    trigger: PollTrigger,
    *,
    renewed_ago: float = 5.0,
    batch_began_ago: float | None = None,
) -> TickResult:
    """Write the poller's lease as held by a worker of another host, renewed
    ``renewed_ago`` seconds ago for 120 s (and, with ``batch_began_ago``, taken
    then with nothing committed since); tick, and return the lease_busy result."""
    stored = store.read("orders")
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.lease is not None
    now = dt.datetime.now(dt.timezone.utc)
    renewed = now - dt.timedelta(seconds=renewed_ago)
    lease = dataclasses.replace(
        doc.lease,
        owner_id="web-2/311/9f1c2d3e",
        released=False,
        heartbeat_at=renewed,
        expires_at=renewed + dt.timedelta(seconds=120),
    )
    changed = dataclasses.replace(doc, lease=lease)
    if batch_began_ago is not None:
        assert doc.checkpoint is not None
        began = now - dt.timedelta(seconds=batch_began_ago)
        checkpoint = dataclasses.replace(doc.checkpoint, updated_at=began)
        changed = dataclasses.replace(
            changed, lease=dataclasses.replace(lease, acquired_at=began), checkpoint=checkpoint
        )
    store.write("orders", docmod.dumps(changed), if_match=stored.etag)
    assert trigger.tick_result(lambda events: None).outcome == "lease_busy"
    assert trigger.last_result is not None
    return trigger.last_result


def test_a_holder_killed_while_the_worker_waits_is_said_at_info() -> None:
    """Three workers on a backlog, the lease holder killed mid-batch: the two others had
    said "lease held by ..." once at INFO while it was alive, and every tick after it
    died repeated that at DEBUG, so for the two minutes until the lease lapsed their
    logs said nothing at all. Its death is a new state: said at INFO, with the hint."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = f"{socket.gethostname()}/{child.pid}/532c0e66"
        cadence = QuietCadence()
        busy = TickResult(0, 0, "lease_busy", holder=holder)
        assert _level(cadence, busy)[0] == logging.INFO
        assert _level(cadence, busy)[0] == logging.DEBUG  # alive: a repeat
    finally:
        child.kill()
        child.wait()
    level, text = _level(cadence, busy)
    assert (level, f"pid {child.pid} is not running on this host" in text) == (logging.INFO, True)
    assert _level(cadence, busy)[0] == logging.DEBUG  # said once


def test_a_holder_of_another_host_that_stopped_renewing_is_said_at_info() -> None:
    """A holder on another host (a container, a VM) cannot be looked up by pid; that it
    missed its renewals (as `dbtrigger status` says NOT RENEWED) is said by the waiting
    worker too, once, at INFO, instead of DEBUG repeats of "lease held by" until it lapses."""
    store = InMemoryCheckpointStore()
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store)
    trigger.tick(lambda events: None)
    source.put({"id": 2, "seq": 2})

    def held(renewed_ago: float) -> TickResult:
        return _held_elsewhere(store, trigger, renewed_ago=renewed_ago)

    cadence = QuietCadence()
    assert _level(cadence, held(5))[0] == logging.INFO
    assert _level(cadence, held(10))[0] == logging.DEBUG  # renewed: still the same news
    stale = held(70)
    level, text = _level(cadence, stale)
    assert level == logging.INFO
    assert "(NOT RENEWED for 1m 1" in text, text
    assert "takes the lease over once it lapses" in text
    assert _level(cadence, held(75))[0] == logging.DEBUG


def test_a_holder_renewing_a_hung_batch_is_said_at_info_by_the_waiting_workers() -> None:
    """A handler hung at default settings: its heartbeat renews the lease, so the other
    workers said "lease held by ..." once and nothing after it, however long it hung
    (its own worker says handler_slow at the TTL, in its own log only). Once the batch
    has run past the lease TTL with no commit, a waiting worker says so once, at INFO."""
    store = InMemoryCheckpointStore()
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store)
    trigger.tick(lambda events: None)
    source.put({"id": 2, "seq": 2})

    def held(batch_began_ago: float) -> TickResult:
        return _held_elsewhere(store, trigger, batch_began_ago=batch_began_ago)

    cadence = QuietCadence()
    assert _level(cadence, held(30))[0] == logging.INFO
    assert _level(cadence, held(90))[0] == logging.DEBUG  # a batch within its TTL
    level, text = _level(cadence, held(150))
    assert level == logging.INFO
    assert "(renewed, but nothing committed under it for 2m 30s" in text, text
    assert "handler_slow" in text
    assert _level(cadence, held(160))[0] == logging.DEBUG


def test_the_list_view_says_a_holder_gone_from_this_host_not_live(
    tmp_path: Path, dead_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three `dbtrigger run` on a change log, the lease holder kill -9'd mid-batch: the
    list view (`dbtrigger status --source app:trigger`, what an operator types first)
    said `live t11` of the dead worker's lease 3 s later, while the one-poller view said
    its pid was not running here. The LEASE column and --json now say so too."""
    store = FileCheckpointStore(str(tmp_path / "state"))
    source = MemorySource([{"id": 1, "seq": 1}], cursor_column="seq", pk_columns=["id"])
    killed = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        owner_id=f"{socket.gethostname()}/{dead_pid}/532c0e66",
    )
    in_handler, let_go = threading.Event(), threading.Event()

    def hangs(events: list[RowChange]) -> None:  # its lease is left behind, live
        in_handler.set()
        let_go.wait(30)

    worker = threading.Thread(
        target=lambda: killed.tick_result(hangs), daemon=True
    )  # fenced out by nothing: let go below, it commits
    worker.start()
    try:
        assert in_handler.wait(30)
        assert main(["status", "--store", str(tmp_path / "state")]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if "orders" in line)
        assert "live" not in row, row
        assert "HOLDER GONE t" in row, row
        assert main(["status", "--json", "--store", str(tmp_path / "state")]) == 0
        shown = capsys.readouterr().out
        assert '"holder_gone": true' in shown, shown
    finally:
        let_go.set()
        worker.join(30)
