#!/usr/bin/env bash
# Install everything the tests need and run them all: lint, types, the suite.
# Uses the python3 on PATH (activate a venv first to keep things isolated).
set -euo pipefail
cd "$(dirname "$0")/.."
# Some machines export PYTHONDONTWRITEBYTECODE=1 (this one does). Then every Python process
# the tests start (the CLI, workers, docs snippets: several hundred a run) compiled the
# package from source again, 0.35 s of CPU each: 135 s of the subprocesses' 760 s.
unset PYTHONDONTWRITEBYTECODE
python3 -m pip install -q --upgrade pip >/dev/null
python3 -m pip install -q -e ".[test]"
bash scripts/services.sh
bash scripts/azurite.sh
python3 -m ruff check src tests benchmarks examples
python3 -m ruff format --check src tests benchmarks examples
# mypy's cache kept per user, as Azurite is (CI runs on a fresh clone): checked from scratch
# it takes 12.6 s, from this cache 2 s. Entries are checked against the sources' hashes,
# so another clone's or an older commit's entries are only ever reused when they fit.
python3 -m mypy --cache-dir "${XDG_CACHE_HOME:-$HOME/.cache}/dbtrigger/mypy"
# Three workers by default on this two-core machine class: most tests wait on a database,
# a subprocess or Azurite rather than compute, and every MariaDB/horizon test runs on one
# worker anyway (loadgroup, tests/conftest.py). Idle, 4,754 tests: 11 min 54 s on three
# workers (the CPU 85% busy), 11 min 7-13 s on four (93%); four stays opt-in: at that load
# one of three full runs saw a CDC chaos worker not stop within 60 s of SIGTERM.
# DBTRIGGER_TEST_WORKERS=4 for four, 0 for a serial run.
# --durations: the slowest tests are in every log, to keep the suite inside its budget.
python3 -m pytest -n "${DBTRIGGER_TEST_WORKERS:-3}" --dist loadgroup --durations=30 "$@"
