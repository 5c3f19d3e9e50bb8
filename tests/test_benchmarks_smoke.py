"""The benchmark scripts still run and still print their tables.

Each script runs as a subprocess, the way its README says to run it, on tiny
data (a few thousand rows) so the whole module takes well under a minute. This
checks that the scripts work end to end (data set build, every contender,
Azurite, azure-functions-db, the table output, the exit code) - not how fast
anything is: no timing is asserted.

Data sets go to this test's own PostgreSQL schema and temp directory; blob
stores to the session's Azurite (``DBTRIGGER_BENCH_AZURITE``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import claim_mix

from dbtrigger import ClaimSource
from tests.azurite import Azurite
from tests.databases import TestDatabase

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"[\d,]+(?:\.\d+)?"

pytestmark = [pytest.mark.postgresql, pytest.mark.azurite]


@pytest.fixture(autouse=True)
def _shared_azurite(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts' blob stores on the session's Azurite, not one started per script."""
    monkeypatch.setenv("DBTRIGGER_BENCH_AZURITE", azurite.connection_string)


def run_benchmark(module: str, args: list[str], pg: TestDatabase, tmp_path: Path) -> str:
    env = {
        **os.environ,
        "DBTRIGGER_BENCH_PG_URL": pg.url,
        "DBTRIGGER_BENCH_SCHEMA": pg.schema or "",
        "DBTRIGGER_BENCH_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def table_rows(output: str, title: str) -> list[list[str]]:
    """The data rows of the table whose title starts with ``title``, split on runs of spaces."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 3 :]:  # title, header, rule
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_catchup_prints_every_contender_and_the_ratios(pg: TestDatabase, tmp_path: Path) -> None:
    out = run_benchmark(
        "catchup",
        ["--rows", "600,1000", "--batch-sizes", "500", "--repeats", "1"],
        pg,
        tmp_path,
    )
    assert "azure-functions-db 0.8.3" in out
    rows = table_rows(out, "Catch-up throughput")
    configs = {(r[0], r[1], r[2], r[4]) for r in rows}
    assert configs == {
        (db, table, n, store)
        for db in ("postgresql", "sqlite")
        for table in ("wide", "narrow")
        for n in ("600", "1,000")
        for store in ("memory", "blob")
    }
    for row in rows:
        db, store = row[0], row[4]
        raw, ours, guard, afdb, ours_raw, ours_raw_cpu, guard_raw, ours_afdb = row[5:13]
        guard_ours, guard_ours_cpu = row[13:]
        for value in (raw, ours, afdb, ours_raw, ours_raw_cpu, ours_afdb):
            assert re.fullmatch(NUMBER, value), row
        if db == "postgresql" and store == "memory":
            for value in (guard, guard_raw, guard_ours, guard_ours_cpu):
                assert re.fullmatch(NUMBER, value), row
        else:
            assert guard == guard_raw == guard_ours == guard_ours_cpu == "-", row
    per_row = table_rows(out, "Per row: wall and client CPU")
    assert {(r[0], r[1], r[2], r[4]) for r in per_row} == configs
    for row in per_row:
        assert all(re.fullmatch(NUMBER, v) for v in row[5:9]), row  # raw, dbt (wall, cpu)
    scaling = table_rows(out, "Flat cost with depth")
    assert len(scaling) == 8
    for row in scaling:
        assert all(re.fullmatch(NUMBER, v) for v in row[4:]), row


def test_catchup_prints_the_narrow_table_targets(pg: TestDatabase, tmp_path: Path) -> None:
    out = run_benchmark(
        "catchup",
        [
            "--rows", "3000", "--batch-sizes", "100,1000", "--repeats", "1",
            "--dbs", "postgresql", "--stores", "memory", "--no-afdb", "--tables", "narrow",
        ],
        pg,
        tmp_path,
    )  # fmt: skip
    targets = table_rows(out, "Targets at default settings")
    assert [(r[1], r[3], r[6]) for r in targets] == [
        ("narrow", "100", ">= 0.4"),
        ("narrow", "1000", ">= 0.5"),
    ]
    for row in targets:
        assert all(re.fullmatch(NUMBER, v) for v in row[4:6]), row
        assert row[7] in ("yes", "no"), row


def test_ops_per_tick_meets_every_target_on_every_store(pg: TestDatabase, tmp_path: Path) -> None:
    out = run_benchmark("ops_per_tick", ["--quick"], pg, tmp_path)
    rows = table_rows(out, "Storage operations per tick")
    assert {r[0] for r in rows} == {"memory", "file", "blob (Azurite)"}
    assert len(rows) == 18
    assert all(r[5] == "yes" for r in rows), rows
    by_scenario = {(r[0], r[1]): r for r in rows}
    assert by_scenario[("memory", "idle (nothing new)")][4] == "1 / 0"
    assert by_scenario[("blob (Azurite)", "5 batches")][4] == "1 / 6"
    # azure-functions-db is counted at its blob client, and its in-memory stand-in
    # must make the same calls.
    for scenario in ("idle (nothing new)", "5 batches", "contended (lease held elsewhere)"):
        blob = by_scenario[("blob (Azurite)", scenario)][6]
        assert re.fullmatch(r"\d+ / \d+", blob)
        assert by_scenario[("memory", scenario)][6] == blob
    trips = table_rows(out, "Store round trips")
    assert [r[0] for r in trips] == ["memory", "file", "blob (Azurite)"]
    for row in trips:
        assert all(re.fullmatch(NUMBER, v) for v in row[1:]), row


def test_memory_reports_growth_per_batch_size(pg: TestDatabase, tmp_path: Path) -> None:
    out = run_benchmark("memory", ["--rows", "3000", "--batch-sizes", "100,1000"], pg, tmp_path)
    rows = table_rows(out, "Catch-up memory")
    assert [(r[0], r[2]) for r in rows] == [("postgresql", "100"), ("postgresql", "1000")]
    for row in rows:
        before, peak, growth = (float(v) for v in row[3:6])
        assert peak >= before > 0
        assert growth == pytest.approx(peak - before, abs=0.11)


def test_fetch_depth_shows_keyset_flat_and_offset_growing(pg: TestDatabase, tmp_path: Path) -> None:
    out = run_benchmark(
        "fetch_depth",
        ["--rows", "5000", "--depths", "100,3000", "--batch", "500", "--repeats", "2"],
        pg,
        tmp_path,
    )
    rows = table_rows(out, "One fetch of 500 rows")
    assert [(r[0], r[1]) for r in rows] == [
        ("postgresql", "100"),
        ("postgresql", "3,000"),
        ("sqlite", "100"),
        ("sqlite", "3,000"),
    ]
    for row in rows:
        assert all(re.fullmatch(NUMBER, v) for v in row[2:7]), row
    # Buffers touched are a property of the plan, not of machine load: the keyset
    # fetch touches as many at depth 3000 as at depth 100, OFFSET touches more.
    shallow, deep = rows[0], rows[1]
    assert int(deep[7]) <= int(shallow[7]) + 5
    assert int(deep[8]) > int(shallow[8]) + 1000


@pytest.mark.parametrize("table", ["wide", "narrow"])
def test_stages_prints_every_stage(pg: TestDatabase, tmp_path: Path, table: str) -> None:
    out = run_benchmark(
        "stages", ["--rows", "3000", "--batch", "500", "--quick", "--table", table], pg, tmp_path
    )
    rows = table_rows(out, f"Per-row cost of each stage at batch 500 ({table} table)")
    names = [r[0] for r in rows]
    assert [n.split(" (")[0].split(",")[0] for n in names] == [
        "raw keyset fetch",
        "SqlAlchemySource.fetch",
        "of which per-fetch fixed cost",
        "the same fetch",
        "to_events",
        "reading pk + one column",
        "event ids",
        "commit",
        "drain setup",
        "sum of fetch + to_events + reading + commit + setup",
        "whole drain",
    ]
    for row in rows:
        assert all(re.fullmatch(NUMBER, v) for v in row[1:]), row


def test_coldstart_imports_nothing_heavy_and_times_a_first_invocation(
    pg: TestDatabase, tmp_path: Path
) -> None:
    # --quick's in-memory store, one round instead of its two: every child (each import
    # row, the invocation) still runs and prints; a second round only gave medians.
    args = ["--store", "memory", "--repeats", "1", "--rows", "1000"]
    out = run_benchmark("coldstart", args, pg, tmp_path)
    imports = {r[0]: r for r in table_rows(out, "Imports in a fresh interpreter")}
    assert set(imports) == {"python -c pass", "import dbtrigger", "function_app imports"}
    assert imports["import dbtrigger"][4] == "-", imports  # no heavy package at all
    for row in imports.values():
        assert all(re.fullmatch(NUMBER, v) for v in row[2:4]), row
    (tick,) = table_rows(out, "A Functions invocation from a fresh process")
    assert all(re.fullmatch(NUMBER, v) for v in tick[1:]), tick


def test_claim_drains_the_queue_and_prints_the_ratio_to_the_raw_loop(
    pg: TestDatabase, tmp_path: Path
) -> None:
    out = run_benchmark(
        "claim",
        ["--rows", "300", "--repeats", "1", "--workers", "1,2", "--systems", "dbtrigger,raw"],
        pg,
        tmp_path,
    )
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("workers"))
    rows = [re.split(r"\s+", line.strip()) for line in lines[header + 1 : header + 3]]
    assert [r[0] for r in rows] == ["1", "2"]
    for row in rows:
        assert all(re.fullmatch(NUMBER, cell) for cell in row[1:])
        assert float(row[3]) > 0


def test_fanout_reads_once_for_three_subscribers(pg: TestDatabase, tmp_path: Path) -> None:
    out = run_benchmark(
        "fanout", ["--quick", "--batch-size", "250", "--read-ahead", "off"], pg, tmp_path
    )
    rows = {r[0]: r for r in table_rows(out, "postgresql, 1,000 rows, batch 250")}
    assert list(rows) == ["1 handler", "3 subscribers", "3 pollers"]
    # The counts are exact (not timings): one read per batch for the fan-out
    # poller, three times as many for three pollers. Read-ahead is off because
    # the adaptive default decides by timing whether a tick's last commit also
    # releases the lease or the release is a write of its own (store writes 5
    # or 6 per drain under load).
    assert rows["3 subscribers"][1] == rows["1 handler"][1]
    assert int(rows["3 pollers"][1]) == 3 * int(rows["1 handler"][1])
    assert rows["3 subscribers"][4] == rows["1 handler"][4]


@pytest.mark.mariadb
def test_latency_prints_percentiles_per_database_source_and_hint(
    pg: TestDatabase, tmp_path: Path
) -> None:
    out = run_benchmark(
        "latency",
        ["--quick", "--seconds", "0.5", "--hints", "notify,adaptive"],  # every code path
        pg,
        tmp_path,
    )
    rows = table_rows(out, "Commit -> handler latency")
    assert [(r[0], r[1], r[2]) for r in rows] == [
        *(
            ("postgresql", source, hint)
            for source in ("polling", "changelog")
            for hint in ("notify", "adaptive")
        ),
        ("mariadb", "polling", "adaptive"),  # no notify on MariaDB
        ("mariadb", "changelog", "adaptive"),
    ]
    for row in rows:
        assert row[3] == "200", row
        assert all(re.fullmatch(NUMBER, v) for v in row[4:11]), row  # rates, rows, ms, ticks/s
        assert row[5] == "100", row  # every row committed (0.5 s at 200/s) reached the handler
    assert "rows not delivered" not in out


def test_claim_mix_reads_the_same_with_many_rows_scheduled(
    pg: TestDatabase, tmp_path: Path
) -> None:
    out = run_benchmark(
        "claim_mix",
        ["--due", "1000", "--scheduled", "0,20k", "--batch", "50", "--repeats", "3"],
        pg,
        tmp_path,
    )
    rows = {(r[0], r[1]): r for r in table_rows(out, "One claim of 50 rows")}
    assert list(rows) == [
        ("plain", "0"),
        ("plain", "20,000"),
        ("priority", "0"),
        ("priority", "20,000"),
    ]
    for row in rows.values():
        assert all(re.fullmatch(NUMBER, v) for v in row[2:]), row
    # Buffers are a property of the plans, not of machine load: what a claim reads
    # does not grow with the rows scheduled for later, while one ORDER BY priority
    # statement walks the scheduled rows of the top priority first.
    for layout in ("plain", "priority"):
        assert int(rows[(layout, "20,000")][3]) <= int(rows[(layout, "0")][3]) + 10
    assert int(rows[("priority", "20,000")][4]) > int(rows[("priority", "0")][4]) + 40


def test_claim_mix_buffers_do_not_depend_on_other_sessions_snapshots(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test above failed under load: a snapshot another test held open while one
    # load ran kept that load's VACUUM from setting the visibility map, and the row
    # locks of a claim on a table with the map set read one more page per row (53
    # buffers or 103). Here the snapshot is held on purpose during the first load only.
    monkeypatch.setattr(claim_mix, "PG_URL", pg.url)
    monkeypatch.setattr(claim_mix, "SCHEMA", pg.schema)

    def buffers(scheduled: int) -> int:
        claim_mix.load("plain", 200, scheduled, 3)
        source = ClaimSource(url=pg.url, table=claim_mix.TABLE, schema=pg.schema, pk_columns=["id"])
        try:
            return claim_mix.claim_buffers(source, 50)
        finally:
            source.close()

    with pg.engine.connect() as other:
        other.exec_driver_sql("SELECT txid_current()")  # a transaction and its snapshot, open
        with_snapshot = buffers(0)
        other.rollback()
    assert buffers(0) == with_snapshot


def test_history_prints_the_cost_beside_the_baseline(pg: TestDatabase, tmp_path: Path) -> None:
    # Two batches of 1,000 and twenty of 100, once each: --quick's 5,000 rows twice cost
    # three times the CPU for the same rows of the table.
    args = ["--rows", "2000", "--repeats", "1", "--stores", "memory,file"]
    out = run_benchmark("history", args, pg, tmp_path)
    rows = table_rows(out, "durable history:")
    assert {(r[0], r[2]) for r in rows} == {
        (s, b) for s in ("memory", "file") for b in ("100", "1000")
    }
    assert all(r[-2] == "1.00" for r in rows)  # one history record per batch


def test_history_narrow_prints_the_historys_cpu(pg: TestDatabase, tmp_path: Path) -> None:
    args = ["--narrow", "--rows", "2000", "--batch-sizes", "100", "--repeats", "1"]
    out = run_benchmark("history", args, pg, tmp_path)
    rows = table_rows(out, "durable history on the narrow PostgreSQL table")
    assert [r[0] for r in rows] == ["100"]
