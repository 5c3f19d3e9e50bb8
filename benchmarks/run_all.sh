#!/usr/bin/env bash
# Run every benchmark in turn and print their tables.
#
#   bash benchmarks/run_all.sh           # default sizes (100k-row catch-up; 1M for memory and depth)
#   bash benchmarks/run_all.sh --full    # adds the 1M-row catch-up
#   bash benchmarks/run_all.sh --quick   # a short smoke run of each script
#
# Run from anywhere; uses the python on PATH (activate the project's venv first).
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-default}"
case "$mode" in
  --quick)
    python -m benchmarks.catchup --quick
    python -m benchmarks.ops_per_tick --quick
    python -m benchmarks.memory --quick
    python -m benchmarks.fetch_depth --quick
    python -m benchmarks.stages --quick
    python -m benchmarks.coldstart --quick
    ;;
  --full)
    python -m benchmarks.catchup --rows 100k,1m
    python -m benchmarks.ops_per_tick
    python -m benchmarks.memory
    python -m benchmarks.fetch_depth
    python -m benchmarks.stages
    python -m benchmarks.coldstart
    ;;
  default)
    python -m benchmarks.catchup
    python -m benchmarks.ops_per_tick
    python -m benchmarks.memory
    python -m benchmarks.fetch_depth
    python -m benchmarks.stages
    python -m benchmarks.coldstart
    ;;
  *)
    echo "usage: $0 [--quick|--full]" >&2
    exit 2
    ;;
esac
