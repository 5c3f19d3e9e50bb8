"""Azurite (the Azure Storage emulator) for tests: started once per session.

``scripts/azurite.sh`` installs the pinned npm package into ``.cache/azurite``;
this module starts it on free loopback ports with ``--skipApiVersionCheck`` and
in-memory persistence, waits until it answers, and stops it at the end. If it
is not installed or does not come up, tests that need it fail (never skip).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = "devstoreaccount1"
# The emulator's published well-known development key (not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


@dataclass(frozen=True)
class Azurite:
    blob_port: int
    queue_port: int
    table_port: int

    @property
    def blob_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.blob_port}/{ACCOUNT}"

    @property
    def table_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.table_port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.blob_endpoint};"
            f"QueueEndpoint=http://127.0.0.1:{self.queue_port}/{ACCOUNT};"
            f"TableEndpoint={self.table_endpoint};"
        )


def azurite_binary() -> str | None:
    local = ROOT / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite"
    if local.exists():
        return str(local)
    return shutil.which("azurite")


def start_azurite() -> Iterator[Azurite]:
    binary = azurite_binary()
    if binary is None:
        pytest.fail("Azurite is not installed: run `bash scripts/azurite.sh`", pytrace=False)
    ports = Azurite(_free_port(), _free_port(), _free_port())
    workdir = tempfile.mkdtemp(prefix="azurite-")
    log_path = Path(workdir) / "azurite.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                "--silent",
                "--skipApiVersionCheck",
                "--inMemoryPersistence",
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(ports.blob_port),
                "--queueHost",
                "127.0.0.1",
                "--queuePort",
                str(ports.queue_port),
                "--tableHost",
                "127.0.0.1",
                "--tablePort",
                str(ports.table_port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ},
            cwd=workdir,
        )
    try:
        up = all(_wait_port(p, 30) for p in (ports.blob_port, ports.table_port))
        if not up or proc.poll() is not None:
            pytest.fail(f"Azurite did not start: {log_path.read_text()[-2000:]}", pytrace=False)
        yield ports
    finally:
        proc.terminate()
        try:
            proc.wait(3)  # in-memory: nothing to flush; it lingers on open keep-alives
        except subprocess.TimeoutExpired:
            # Azurite waits for open keep-alive connections before exiting.
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
