"""The files dbtrigger leaves on disk, and the store factory's reading of a SAS
connection string: bounded lock waits, reads of read-only state, leftovers of
killed writes, owner-only backups and quarantine files, the portal's SAS form.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.storage.blob import (
    AccountSasPermissions,
    BlobServiceClient,
    ResourceTypes,
    generate_account_sas,
)

from dbtrigger import FileCheckpointStore
from dbtrigger.cli import main
from dbtrigger.errors import StoreUnavailableError
from dbtrigger.quarantine import JsonLinesQuarantineSink, QuarantineRecord
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import decide_acquire
from dbtrigger.state.stores.factory import is_connection_string, open_store, redact
from tests.azurite import ACCOUNT, KEY, Azurite

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 1, 1, tzinfo=UTC)


def _doc_bytes(poller: str = "orders") -> bytes:
    decided = decide_acquire(
        None, poller=poller, fingerprint="sha256:x", owner="a", now=NOW, ttl=dt.timedelta(0)
    )
    return docmod.dumps(decided.document)


# --- item 9: the file store's lock -------------------------------------------------------

_HOLD_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def frozen_writer(tmp_path: Path) -> subprocess.Popen[str]:
    """Another process holding the exclusive lock of poller ``orders`` and never letting go,
    as a writer stopped inside a write would."""
    store = FileCheckpointStore(tmp_path)
    store.write("orders", _doc_bytes(), if_match=None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path / ".orders.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "locked"
    yield proc  # type: ignore[misc]
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_a_frozen_writer_makes_reads_and_writes_unavailable_not_hang(
    tmp_path: Path, frozen_writer: subprocess.Popen[str]
) -> None:
    store = FileCheckpointStore(tmp_path, lock_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="stayed locked by another process"):
        store.read("orders")
    with pytest.raises(StoreUnavailableError, match="stayed locked"):
        store.write("orders", _doc_bytes(), if_match=None)
    assert time.monotonic() - started < 10  # bounded, not a hang (generous under load)
    # Other pollers in the same directory are not affected.
    store.write("other", _doc_bytes("other"), if_match=None)
    assert store.read("other") is not None


def test_status_under_a_frozen_writer_fails_instead_of_hanging(
    tmp_path: Path, frozen_writer: subprocess.Popen[str]
) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    code = textwrap.dedent(
        f"""
        import dbtrigger.state.stores.file as f
        f.DEFAULT_LOCK_TIMEOUT = 0.3
        from dbtrigger.cli import main
        raise SystemExit(main(["status", "orders", "--store", {str(tmp_path)!r}]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode != 0
    assert "stayed locked" in done.stdout + done.stderr


def test_the_lock_is_released_when_the_holder_dies(
    tmp_path: Path, frozen_writer: subprocess.Popen[str]
) -> None:
    store = FileCheckpointStore(tmp_path, lock_timeout=5)
    frozen_writer.send_signal(signal.SIGKILL)
    frozen_writer.wait()
    assert store.read("orders") is not None


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_reads_work_in_a_read_only_state_directory(tmp_path: Path) -> None:
    FileCheckpointStore(tmp_path / "s").write("orders", _doc_bytes(), if_match=None)
    os.chmod(tmp_path / "s", 0o500)
    try:
        _assert_read_only_reads(tmp_path / "s")
    finally:
        os.chmod(tmp_path / "s", 0o700)


def _assert_read_only_reads(directory: Path) -> None:
    store = FileCheckpointStore(directory, create=False)
    stored = store.read("orders")
    assert stored is not None
    assert docmod.loads(stored.data).poller_name == "orders"
    assert store.read("missing") is None  # no lock file, none can be made: still a read


def _read_only_bind_mount_available() -> bool:
    return os.geteuid() == 0 and sys.platform.startswith("linux")


@pytest.mark.skipif(not _read_only_bind_mount_available(), reason="needs root on Linux")
def test_reads_work_on_a_read_only_mount(tmp_path: Path) -> None:
    """As root (this CI), permissions do not bind: a read-only mount is the real case."""
    source = tmp_path / "s"
    FileCheckpointStore(source).write("orders", _doc_bytes(), if_match=None)
    (source / ".orders.lock").unlink()  # and one poller whose lock file never existed
    FileCheckpointStore(source).write("more", _doc_bytes("more"), if_match=None)
    mount = tmp_path / "ro"
    mount.mkdir()
    mount_tool, umount_tool = shutil.which("mount"), shutil.which("umount")
    if not mount_tool or not umount_tool:
        pytest.skip("no mount(8) here")
    bind = [mount_tool, "--bind", "-o", "ro", str(source), str(mount)]
    if subprocess.run(bind, check=False).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run([mount_tool, "-o", "remount,ro,bind", str(mount)], check=True)
        _assert_read_only_reads(mount)
        store = FileCheckpointStore(mount, create=False)
        assert store.read("more") is not None
        with pytest.raises(StoreUnavailableError, match="read-only"):
            store.write("orders", _doc_bytes(), if_match=None)
    finally:
        subprocess.run([umount_tool, str(mount)], check=True)


def _killed_writer(directory: str) -> None:
    store = FileCheckpointStore(directory)
    original = os.replace

    def die(src: object, dst: object) -> None:
        if str(dst).endswith("orders.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        original(src, dst)  # type: ignore[arg-type]

    os.replace = die  # type: ignore[assignment]
    stored = store.read("orders")
    assert stored is not None
    store.write("orders", _doc_bytes(), if_match=stored.etag)


def test_temp_files_of_a_killed_write_are_removed_by_the_next_write(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    store.write("orders", _doc_bytes(), if_match=None)
    # A neighbour whose name starts the same must keep its files.
    store.write("orders.json.x", _doc_bytes("orders.json.x"), if_match=None)
    neighbour_tmp = tmp_path / ".orders.json.x.json.abcdefgh.tmp"
    neighbour_tmp.write_bytes(b"not ours")

    proc = multiprocessing.get_context("fork").Process(target=_killed_writer, args=(tmp_path,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    leftovers = sorted(p.name for p in tmp_path.glob(".orders.json.*.tmp"))
    assert len(leftovers) == 2  # the killed write's and the neighbour's

    stored = store.read("orders")
    assert stored is not None
    store.write("orders", stored.data, if_match=stored.etag)
    assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == [neighbour_tmp.name]


# --- item 13: owner-only files --------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def _usual_umask() -> Iterator[None]:
    """The common umask (022), under which a plain open() makes world-readable files."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_backups_are_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    store = FileCheckpointStore(tmp_path / "state")
    store.write("orders", _doc_bytes(), if_match=None)
    argv = ["release-lease", "orders", "--reason", "t", "--yes", "--force"]
    dirs = ["--store", str(tmp_path / "state"), "--backup-dir", str(tmp_path / "b")]
    assert main([*argv, *dirs]) == 0
    capsys.readouterr()
    [backup] = (tmp_path / "b").iterdir()
    assert _mode(backup) == 0o600
    assert _mode(tmp_path / "b") == 0o700
    assert _mode(tmp_path / "state" / "orders.json") == 0o600


def test_the_quarantine_file_is_owner_only(tmp_path: Path) -> None:
    sink = JsonLinesQuarantineSink(tmp_path / "q" / "poison.jsonl")
    record = QuarantineRecord(
        poller="orders",
        event_id="e",
        source="s",
        pk={"id": 1},
        cursor=1,
        row={"id": 1, "card": "4111 1111 1111 1111"},
        error="ValueError: x",
        attempts=3,
        checkpoint={},
        batch_id="b",
        fencing_token=1,
        owner_id="o",
        quarantined_at=NOW,
    )
    sink.put([record])
    sink.put([record])
    assert _mode(tmp_path / "q" / "poison.jsonl") == 0o600
    assert _mode(tmp_path / "q") == 0o700
    assert len(sink.records()) == 2


# --- item 13: the portal's SAS connection string --------------------------------------------


def _portal_sas_string(azurite: Azurite) -> tuple[str, str]:
    sas = generate_account_sas(
        account_name=ACCOUNT,
        account_key=KEY,
        resource_types=ResourceTypes(service=True, container=True, object=True),
        permission=AccountSasPermissions(
            read=True, write=True, delete=True, list=True, add=True, create=True
        ),
        expiry=dt.datetime.now(UTC) + dt.timedelta(hours=1),
    )
    # The portal's "Shared access signature" blade gives exactly this shape.
    return (
        f"BlobEndpoint={azurite.blob_endpoint};"
        f"QueueEndpoint=http://127.0.0.1:{azurite.queue_port}/{ACCOUNT};"
        f"FileEndpoint=http://127.0.0.1:1/{ACCOUNT};"
        f"TableEndpoint={azurite.table_endpoint};"
        f"SharedAccessSignature={sas}"
    ), sas


def test_portal_sas_forms_are_connection_strings() -> None:
    assert is_connection_string(
        "BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=1&sig=x"
    )
    assert is_connection_string("SharedAccessSignature=sv=1&sig=x;BlobEndpoint=https://a/")
    assert is_connection_string("TableEndpoint=https://a.table.core.windows.net/;AccountName=a")
    assert not is_connection_string("./state")
    assert not is_connection_string("/var/lib/dbtrigger/state")
    assert not is_connection_string("postgresql://u:p@h/db?options=a=b;c")


@pytest.mark.azurite
def test_a_portal_sas_connection_string_opens_the_blob_store(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection, sas = _portal_sas_string(azurite)
    container = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    monkeypatch.chdir(tmp_path)
    try:
        store = open_store(connection, container=container, app="shop")
        assert type(store).__name__ == "BlobCheckpointStore"
        etag = store.write("orders", _doc_bytes(), if_match=None)
        stored = store.read("orders")
        assert stored is not None
        assert stored.etag == etag
        assert not any(tmp_path.iterdir())  # no directory named after the string
        signature = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
        assert signature not in store.describe()
        assert signature not in redact(f"failed: {connection}")
    finally:
        service.delete_container(container)
        service.close()


# --- every file-system failure is a store error ------------------------------------------


def test_a_directory_removed_during_a_write_is_unavailable_not_a_raw_oserror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock was opened, then the directory vanished (a test's tmp dir, an unmounted
    share): the write must fail as StoreUnavailableError, never as FileNotFoundError
    escaping a background balance thread or a tick."""
    store = FileCheckpointStore(tmp_path / "state")
    etag = store.write("orders", _doc_bytes(), if_match=None)
    real_mkstemp = tempfile.mkstemp

    def vanished(*args: object, **kwargs: object) -> tuple[int, str]:
        shutil.rmtree(tmp_path / "state")
        return real_mkstemp(*args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(tempfile, "mkstemp", vanished)
    with pytest.raises(StoreUnavailableError, match="cannot write"):
        store.write("orders", _doc_bytes(), if_match=etag)


def test_the_cli_does_not_create_a_sqlite_state_database(tmp_path: Path) -> None:
    """An operator command pointed at a mistyped SQLite path fails, and leaves no
    empty database behind (SQLite creates the file on connect)."""
    missing = tmp_path / "typo" / "state.db"
    missing.parent.mkdir()
    for argv in (["status"], ["reset", "orders", "--to-beginning"]):
        assert main([*argv, "--store", f"sqlite:///{missing}"]) == 2
    assert not missing.exists()
    assert list(missing.parent.iterdir()) == []


def test_a_bare_app_setting_name_as_store_says_how_to_reference_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--store AzureWebJobsStorage` (the form the store constructors take) is a
    directory on the command line; with no such directory but such a setting, the
    command fails and names the %SETTING% form instead of listing 'no pollers'."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AzureWebJobsStorage", "UseDevelopmentStorage=true")
    monkeypatch.setenv("STATE_STORAGE__accountName", "acct")
    for name in ("AzureWebJobsStorage", "STATE_STORAGE"):
        assert main(["status", "--store", name]) == 2
        assert f"write it as %{name}%" in capsys.readouterr().err
    (tmp_path / "AzureWebJobsStorage").mkdir()  # a real directory of that name is used
    assert main(["status", "--store", "AzureWebJobsStorage"]) == 0
    assert "no pollers" in capsys.readouterr().out
