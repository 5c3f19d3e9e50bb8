"""The docs' ``dbtrigger`` commands, each forked from one interpreter that imported the CLI once.

A page's shell blocks run 50-odd ``dbtrigger`` commands across the docs; as fresh
processes each paid the interpreter start and the package's imports again (about
0.4 s of CPU, most of what the docs test costs). Here ``python doc_cli.py serve
SOCKET`` imports the CLI and what its commands import, then forks a process per
command; ``python -IS doc_cli.py SOCKET ARGS...`` (what ``dbtrigger`` is on the page's
PATH, tests/doc_runner.py) hands it its argv, working directory, environment and
stdin/stdout/stderr, forwards SIGINT and SIGTERM to the command (Ctrl-C, ``timeout``)
and exits with the command's status. The command itself runs as the console script
would: ``dbtrigger.cli.main()`` in a process whose environment, directory, argv,
streams and ``sys.path[0]`` (the script's directory) are the reader's; only the
modules were imported before (never anything the page wrote: the server imports no
page module and opens no connection).

The client imports only the standard library (``-I -S``: no site, no environment).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_LEN = struct.Struct("!I")
PRELOAD = (
    "dbtrigger.cli.loading",
    "sqlalchemy.dialects.postgresql",
    "sqlalchemy.dialects.sqlite",
    "psycopg",
    "azure.storage.blob",
    "azure.functions",
)


@contextlib.contextmanager
def fork_server() -> Iterator[str]:
    """A directory whose ``dbtrigger`` runs each command forked from a server started here."""
    # A socket's path has at most 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="dbt-cli-") as tmp:
        socket_path = os.path.join(tmp, "cli.sock")
        log = Path(tmp, "server.log")
        with log.open("wb") as out:  # not the caller's pipes: a test may read them to EOF
            server = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "serve", socket_path],
                stdout=out,
                stderr=out,
            )
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(socket_path):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the CLI fork server did not start: {log.read_text()}")
                time.sleep(0.02)
            shim = Path(tmp, "dbtrigger")
            shim.write_text(
                f"#!/bin/sh\nexec '{sys.executable}' -IS '{os.path.abspath(__file__)}' "
                f"'{socket_path}' \"$@\"\n",
                encoding="utf-8",
            )
            shim.chmod(0o755)
            yield tmp
        finally:
            server.terminate()
            server.wait(30)


_SHARED: list[str] = []


def dbtrigger_command() -> str:
    """The ``dbtrigger`` of this test process: one fork server, started at first use.

    For tests that run short commands (no signal sent, no kill): each costs about
    0.08 s of CPU instead of a fresh process's 0.4. A test about the console script
    itself, or one that signals or kills the command, runs the installed script
    (the client forwards SIGINT/SIGTERM, but SIGKILL would only kill the client).
    The docs test hands its directory to every page's runner (``DOCTEST_CLI_DIR``,
    tests/doc_runner.py): one server for all the pages a test process runs, as the
    server imports no page module and opens no connection.
    """
    if not _SHARED:
        server = fork_server()
        _SHARED.append(os.path.join(server.__enter__(), "dbtrigger"))
        atexit.register(server.__exit__, None, None, None)
    return _SHARED[0]


def recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the other side closed")
        data += chunk
    return data


def client(path: str, argv: list[str]) -> int:
    command: list[int] = []  # its pid, once the server said it
    pending: list[int] = []  # signals that came before

    def forward(signum: int, frame: object) -> None:
        del frame
        if not command:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(command[0], signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [_LEN.pack(len(request))], [0, 1, 2])
    conn.sendall(request)
    command.append(_LEN.unpack(recv_exact(conn, _LEN.size))[0])
    for signum in pending:
        forward(signum, None)
    code = os.waitstatus_to_exitcode(_LEN.unpack(recv_exact(conn, _LEN.size))[0])
    if code < 0:  # killed by a signal: so is this process, as the shell would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _run(conn: socket.socket, fds: list[int], request: dict[str, Any], bin_dir: str) -> None:
    """In the forked command process: become the reader's process and run the CLI.

    It ends as the console script's process does (``sys.exit(main())`` unwinding
    to the interpreter's own exit: atexit handlers, non-daemon threads joined, an
    uncaught exception printed with status 1).
    """
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.close()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [os.path.join(bin_dir, "dbtrigger"), *request["argv"]]
    sys.path[0] = bin_dir  # as for the console script

    from dbtrigger.cli import main  # noqa: PLC0415 - imported by the server already

    sys.exit(main())


def _supervise(conn: socket.socket, server: socket.socket, bin_dir: str) -> None:
    """In a child of the server: fork the command, tell the client its pid, then its status."""
    server.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    head, fds, _flags, _addr = socket.recv_fds(conn, _LEN.size, 3)
    if len(head) < _LEN.size:
        head += recv_exact(conn, _LEN.size - len(head))
    request = json.loads(recv_exact(conn, _LEN.unpack(head)[0]))
    pid = os.fork()
    if pid == 0:
        _run(conn, fds, request, bin_dir)
    for fd in fds:
        os.close(fd)
    conn.sendall(_LEN.pack(pid))
    _, status = os.waitpid(pid, 0)
    conn.sendall(_LEN.pack(status))
    os._exit(0)


def listen(path: str) -> socket.socket:
    """A Unix socket listening at ``path``, which exists only once it accepts."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(16)
    os.rename(path + ".tmp", path)
    return server


def reap(signum: int, frame: object) -> None:
    """SIGCHLD: wait for every child that ended (their CPU then counts in this process's)."""
    del signum, frame
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def serve(path: str) -> None:
    """Import once, then fork a supervisor per connection (no threads: only forks)."""
    import importlib  # noqa: PLC0415

    from dbtrigger.cli.main import COMMANDS  # noqa: PLC0415

    # Every command's module, and what the pages' commands reach for: imported
    # here once instead of in each command (importing has no other effect).
    for module in [*(m for m, _, _ in COMMANDS), *PRELOAD]:
        with contextlib.suppress(ImportError):  # an extra not installed: left to the command
            importlib.import_module(module)
    bin_dir = os.path.dirname(sys.executable)
    # Reaped, not ignored: their CPU then counts in this process's children, and so
    # in the test's (a run's CPU time stays comparable with the fresh processes').
    signal.signal(signal.SIGCHLD, reap)
    server = listen(path)
    sys.stdout.flush()
    sys.stderr.flush()
    # Out of the collector's sight: a collection in a command would otherwise walk
    # (and so copy, page by page) every object imported here. 0.08 s of CPU a
    # command with it, 0.25 s without, 0.4 s as a fresh process.
    gc.freeze()
    parent = os.getppid()
    server.settimeout(1.0)
    while os.getppid() == parent:  # the page's runner gone (killed at its timeout): so is this
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            _supervise(conn, server, bin_dir)
        conn.close()
    # The test process is gone without its atexit (an xdist worker ends by os._exit):
    # its temporary directory, the socket and the shim in it, would stay behind.
    directory = os.path.dirname(path)
    if os.path.basename(directory).startswith("dbt-cli-"):
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
