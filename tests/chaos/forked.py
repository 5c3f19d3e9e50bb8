"""Chaos worker processes forked from one interpreter that imported them once.

A chaos test SIGKILLs and restarts its workers again and again, and each fresh
``python -m tests.chaos.queue_worker`` paid the interpreter start and the
imports (dbtrigger, SQLAlchemy, the driver) again: 1-1.5 s of CPU on a loaded
machine, most of what such a test costs. :class:`Forker` starts one server
per test that imports the worker module and the drivers, then forks a
process per worker; :meth:`Forker.start` returns a :class:`ForkedProcess`
for it, which the test signals, kills, freezes and waits for as it would a
``subprocess.Popen``: ``pid`` is the worker's own process (unlike
tests/doc_cli.py, whose client stands between the test and the command, so
a SIGKILL would only kill the client).

The worker runs as ``python -m MODULE ARGV...`` would: ``sys.argv``, its
output to its log file, the default signal dispositions; only the modules
were imported before (the server opens no connection and starts no thread,
and ``random`` reseeds itself in a forked child). Each worker is forked by a
supervisor of its own, which waits for it and hands its exit status to the
test; the server reaps the supervisors, and the test waits for the server at
the end, so every worker's CPU still counts in the test's children.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import TracebackType

from tests.doc_cli import listen, reap, recv_exact

ROOT = Path(__file__).resolve().parent.parent.parent
_STATUS = struct.Struct("!i")
#: What the workers' engines import on first connect: imported once here.
DRIVERS = (
    "sqlalchemy.dialects.postgresql",
    "sqlalchemy.dialects.sqlite",
    "sqlalchemy.dialects.mysql",
    "psycopg",
    "pymysql",
    "azure.storage.blob",
)


class ForkedProcess:
    """A forked worker, as much of ``subprocess.Popen`` as the chaos tests use."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self.pid = _STATUS.unpack(recv_exact(conn, _STATUS.size))[0]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                head = self._conn.recv(_STATUS.size, socket.MSG_PEEK)
            except BlockingIOError:
                return None
            finally:
                self._conn.setblocking(True)
            if head:
                self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._conn.recv(_STATUS.size, socket.MSG_PEEK)
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0) from None
            finally:
                self._conn.settimeout(None)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def _finish(self) -> None:
        status = _STATUS.unpack(recv_exact(self._conn, _STATUS.size))[0]
        self._conn.close()
        self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Forker:
    """The fork server of one test: ``with Forker("tests.chaos.queue_worker") as f:``."""

    def __init__(self, module: str) -> None:
        self.module = module
        self._procs: list[ForkedProcess] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="dbt-fork-")  # a short socket path
        self.socket = os.path.join(self._tmp.name, "fork.sock")
        log = Path(self._tmp.name, "server.log")
        with log.open("wb") as out:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.forked", self.socket, module],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket):
            if self._server.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the chaos fork server did not start: {log.read_text()}")
            time.sleep(0.05)

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> ForkedProcess:
        """``python -m MODULE *argv`` with its output appended to ``log`` and ``env``
        added to its environment."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        request = json.dumps({"argv": argv, "log": str(log), "env": env or {}}).encode()
        conn.sendall(_STATUS.pack(len(request)) + request)
        proc = ForkedProcess(conn)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop the server and wait for it (and so for every worker's CPU).

        The test stops its workers first; one still running (the test failed
        before it stopped them) is killed here.
        """
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
        self._server.terminate()
        try:
            self._server.wait(60)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._tmp.cleanup()

    def __enter__(self) -> Forker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _run(module: str, argv: list[str], log: str, env: dict[str, str]) -> None:
    """In the forked worker: become ``python -m MODULE ARGV...`` and exit with its status."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    sys.argv = [module, *argv]
    # The imported modules stay frozen (gc.freeze in serve): a collection in the worker
    # would otherwise walk them, and so copy every page they are on.
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter would: printed, status 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _supervise(conn: socket.socket, server: socket.socket, module: str) -> None:
    """In a child of the server: fork the worker, say its pid, then its exit status."""
    server.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    request = json.loads(recv_exact(conn, _STATUS.unpack(recv_exact(conn, _STATUS.size))[0]))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(module, request["argv"], request["log"], request["env"])
    conn.sendall(_STATUS.pack(pid))
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the test may have gone
        conn.sendall(_STATUS.pack(status))
    os._exit(0)


def serve(path: str, module: str) -> None:
    """Import once, then fork a supervisor per connection (no threads: only forks)."""
    importlib.import_module(module)
    # Run afresh as __main__ in each worker (runpy warns about a module run that
    # was imported already); what it imported stays.
    del sys.modules[module]
    for name in DRIVERS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    # Reaped, not ignored: their CPU then counts in this process's children, and so,
    # once the test waited for this process, in the test's.
    signal.signal(signal.SIGCHLD, reap)
    server = listen(path)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # a collection in a worker would otherwise copy every imported object
    parent = os.getppid()
    server.settimeout(0.5)
    while not stop and os.getppid() == parent:  # the test gone: so is this
        try:
            conn, _ = server.accept()
        except (TimeoutError, InterruptedError):
            continue
        if os.fork() == 0:
            _supervise(conn, server, module)
        conn.close()
    server.close()
    # The supervisors end with their workers: wait for them, so their CPU is counted.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
