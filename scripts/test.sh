#!/usr/bin/env bash
# Install everything the tests need and run them all: lint, types, the suite.
# Uses the python3 on PATH (activate a venv first to keep things isolated).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip >/dev/null
python3 -m pip install -q -e ".[test]"
bash scripts/services.sh
bash scripts/azurite.sh
python3 -m ruff check src tests benchmarks examples
python3 -m ruff format --check src
python3 -m mypy
# Two workers by default (this machine class has two cores; most tests wait on a database,
# a subprocess or Azurite rather than compute). DBTRIGGER_TEST_WORKERS=0 runs serially.
python3 -m pytest -n "${DBTRIGGER_TEST_WORKERS:-2}" --dist loadgroup "$@"
