"""The Functions example installs from a fresh machine, as docs/azure.md says.

dbtrigger is not on PyPI, so the example's ``requirements.txt`` installs it
from a wheel built into the app's ``wheels/`` folder. This test does exactly
what the documentation tells a new user to do: build the wheel, create an
empty virtual environment, ``pip install -r requirements.txt`` into it from the app
folder, and import the function app in that environment. It downloads the
app's dependencies, so it is slow (about a minute); it runs in CI all the same.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        args,
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_requirements_install_into_a_fresh_venv(tmp_path: Path) -> None:
    app = tmp_path / "orders-app"
    shutil.copytree(ROOT / "examples", app)
    # Step 1 of docs/azure.md "Install": the wheel, into the app's wheels/ folder.
    wheels = str(app / "wheels")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels, str(ROOT)], ROOT)
    assert list((app / "wheels").glob("dbtrigger-*.whl"))
    # Step 2: what the Functions remote build does - a fresh environment, then
    # `pip install -r requirements.txt` in the app folder.
    # The environment gets no pip of its own: `venv` installing one (ensurepip) was a
    # quarter of the test's CPU and proves nothing about the app. The same
    # `pip install -r requirements.txt` runs in the app folder, by this interpreter's pip
    # pointed at the new environment (`--python`): it resolves and installs into that
    # environment's site-packages only, as the environment's own pip would.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    # --no-compile: what is tested is that the requirements resolve, install and import;
    # compiling every installed package's bytecode up front was a third of the test's CPU.
    pip = [sys.executable, "-m", "pip", "--python", python]
    _run([*pip, "install", "-q", "--no-compile", "-r", "requirements.txt"], app)
    # The installed app imports and indexes its function.
    settings = {
        "AzureWebJobsStorage": "UseDevelopmentStorage=true",
        "DBTRIGGER_APP_NAME": "install-test",
        "ORDERS_DB_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
        "DEST_DB_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
        "PYTHONPATH": "",
    }
    out = _run(
        [
            python,
            "-c",
            "import function_app, psycopg, azure.storage.blob, azure.identity; "
            "print([f.get_function_name() for f in function_app.app.get_functions()])",
        ],
        app,
        settings,
    )
    assert out.strip() == "['orders_poll']"
    version = _run([str(venv / "bin" / "dbtrigger"), "--version"], app, settings)
    assert version.startswith("dbtrigger ")
