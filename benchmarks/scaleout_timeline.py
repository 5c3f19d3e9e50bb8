"""Where a cold ``dbtrigger run`` worker's time goes: a timeline per worker process.

Starts W workers of ``benchmarks.scaleout_app`` together on a backlog, as
``benchmarks.scaleout`` does, but each through this module's ``--worker``
mode, which wraps a few of dbtrigger's methods (measurement only) and writes,
at exit, per process:

* wall seconds since the processes were started, and the process's CPU
  seconds, at: interpreter up, CLI imported, app imported, first heartbeat
  written, first partition owned, first handler call, last handler return;
* the partition ticks' wall and CPU time beyond the handler, per batch;
* the store's reads and writes (count, wall, CPU) by thread and document
  (the membership document or a partition's), and the fence reads
  (``confirm_ownership`` calls that read the document);
* the rounds of partition ticks, idle ones and their CPU.

    python -m benchmarks.scaleout_timeline --store file --workers 1,3
    python -m benchmarks.scaleout_timeline --store blob --workers 3 --rows 3000

The workers run the checkout's dbtrigger as it is: with
``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__`` every process compiles it
from source (``python -m compileall -q src`` first to measure what an
installed package does).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

PHASES = [
    "python_up",
    "cli_imported",
    "app_imported",
    "first_beat",
    "first_owned",
    "first_batch",
    "last_batch",
]


def worker() -> int:
    """``dbtrigger run benchmarks.scaleout_app:trigger`` with its phases recorded."""
    started = float(os.environ["TIMELINE_T0"])
    out = Path(os.environ["TIMELINE_OUT"])
    at: dict[str, tuple[float, float]] = {}

    def mark(name: str, *, again: bool = False) -> None:
        if again or name not in at:
            at[name] = (time.time() - started, time.process_time())

    mark("python_up")
    from dbtrigger.cli.main import main  # noqa: PLC0415 - the import is what is timed

    mark("cli_imported")
    import benchmarks.scaleout_app as app  # noqa: PLC0415

    mark("app_imported")
    from dbtrigger.partitions import balancing, member  # noqa: PLC0415
    from dbtrigger.runtime.poller import PollTrigger  # noqa: PLC0415

    acc: dict[str, float] = dict.fromkeys(
        ["tick_wall", "tick_cpu", "ticks", "handler_wall", "batches", "rows", "confirms",
         "fence_reads", "rounds", "idle_rounds", "idle_round_cpu"], 0.0
    )  # fmt: skip
    stores: dict[str, list[float]] = {}

    def counted(cls: Any) -> None:
        for method in ("read", "write"):
            original = getattr(cls, method)

            def wrapper(self: Any, key: str, *a: Any, _o: Any = original, _m: str = method,
                        **k: Any) -> Any:  # fmt: skip
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _o(self, key, *a, **k)
                finally:
                    thread = "balance" if "balance" in threading.current_thread().name else "main"
                    doc = "members" if key.endswith(".members") else "partition"
                    s = stores.setdefault(f"{thread} {_m} {doc}", [0, 0.0, 0.0])
                    s[0] += 1
                    s[1] += time.perf_counter() - wall
                    s[2] += time.thread_time() - cpu

            setattr(cls, method, wrapper)

    counted(type(app.trigger.store))
    balance = balancing.Balancing._balance

    def _balance(self: Any, *, leaving: bool) -> Any:
        decision = balance(self, leaving=leaving)
        mark("first_beat")
        if self.owned:
            mark("first_owned")
        return decision

    confirm = balancing.Balancing.confirm_ownership

    def confirm_ownership(self: Any, max_age: float = 0.0) -> Any:
        before = self._view_at
        lost = confirm(self, max_age)
        acc["confirms"] += 1
        acc["fence_reads"] += self._view_at != before
        return lost

    tick = PollTrigger.tick_result

    def tick_result(self: Any, handler: Any, **k: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return tick(self, handler, **k)
        finally:
            acc["tick_wall"] += time.perf_counter() - wall
            acc["tick_cpu"] += time.thread_time() - cpu
            acc["ticks"] += 1

    round_ = member.PartitionedPoller.tick_result

    def round_result(self: Any, handler: Any = None, **k: Any) -> Any:
        cpu = time.thread_time()
        result = round_(self, handler, **k)
        acc["rounds"] += 1
        if not result.rows:
            acc["idle_rounds"] += 1
            acc["idle_round_cpu"] += time.thread_time() - cpu
        return result

    handle = app.trigger.default_handler

    def handler(events: Any) -> Any:
        mark("first_batch")
        wall = time.perf_counter()
        try:
            return handle(events)  # type: ignore[misc]
        finally:
            acc["handler_wall"] += time.perf_counter() - wall
            acc["batches"] += 1
            acc["rows"] += len(events)
            mark("last_batch", again=True)

    balancing.Balancing._balance = _balance  # type: ignore[method-assign]
    balancing.Balancing.confirm_ownership = confirm_ownership  # type: ignore[method-assign]
    PollTrigger.tick_result = tick_result  # type: ignore[method-assign]
    member.PartitionedPoller.tick_result = round_result  # type: ignore[method-assign]
    app.trigger.default_handler = handler

    def dump() -> None:
        report = {"pid": os.getpid(), "at": at, "acc": acc, "stores": stores,
                  "cpu": time.process_time()}  # fmt: skip
        (out / f"{os.getpid()}.timeline.json").write_text(json.dumps(report))

    atexit.register(dump)
    return main(["run", "benchmarks.scaleout_app:trigger"])


def show(report: dict[str, Any]) -> None:
    at, acc = report["at"], report["acc"]
    batches = max(acc["batches"], 1)
    print(
        f"  pid {report['pid']}: "
        + "  ".join(f"{p} {at[p][0]:.2f}s/{at[p][1]:.2f}" for p in PHASES if p in at)
        + f"  (wall since start / process CPU s), CPU at exit {report['cpu']:.2f}"
    )
    print(
        f"    {acc['rows']:.0f} rows in {acc['batches']:.0f} batches, {acc['ticks']:.0f} "
        f"partition ticks, {acc['rounds']:.0f} rounds ({acc['idle_rounds']:.0f} idle, "
        f"{acc['idle_round_cpu']:.2f} CPU s); per batch beyond the handler "
        f"{(acc['tick_wall'] - acc['handler_wall']) / batches * 1000:.0f} ms wall, "
        f"{acc['tick_cpu'] / batches * 1000:.1f} ms CPU; fence reads "
        f"{acc['fence_reads']:.0f} of {acc['confirms']:.0f} checks"
    )
    print(
        "    store: "
        + ", ".join(
            f"{k} {n:.0f}x {wall / max(n, 1) * 1000:.1f} ms ({cpu / max(n, 1) * 1000:.1f} CPU)"
            for k, (n, wall, cpu) in sorted(report["stores"].items())
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="file", choices=["file", "blob"])
    parser.add_argument("--workers", default="1,3")
    parser.add_argument("--rows", type=int, default=9000)
    parser.add_argument("--handler-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    import sqlalchemy as sa  # noqa: PLC0415 - the worker mode needs none of this

    from benchmarks import scaleout  # noqa: PLC0415
    from benchmarks.common import PG_URL, ROOT, SCHEMA  # noqa: PLC0415

    engine = sa.create_engine(PG_URL)
    print(f"load average before: {scaleout.load_average()}")
    with scaleout.stores([args.store]) as specs, tempfile.TemporaryDirectory() as tmp:
        for workers in [int(w) for w in args.workers.split(",")]:
            table = f"scaleout_{uuid.uuid4().hex[:8]}"
            scaleout.make_table(engine, table, args.rows)
            workdir = Path(tmp) / table
            workdir.mkdir()
            group_store = scaleout.store_location(specs[args.store], workdir)
            env = {
                **os.environ,
                "DBT_SCALEOUT_URL": PG_URL,
                "DBT_SCALEOUT_SCHEMA": SCHEMA,
                "DBT_SCALEOUT_TABLE": table,
                "DBT_SCALEOUT_STORE": group_store,
                "DBT_SCALEOUT_APP": f"bench{uuid.uuid4().hex[:8]}",
                "DBT_SCALEOUT_HANDLER_MS": str(args.handler_ms),
                "DBT_SCALEOUT_OUT": str(workdir),
                "TIMELINE_OUT": str(workdir),
            }
            started = time.time()
            env["TIMELINE_T0"] = repr(started)
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.scaleout_timeline", "--worker"],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for _ in range(workers)
            ]

            def delivered(workdir: Path = workdir) -> int:
                return sum(len(p.read_text().splitlines()) for p in workdir.glob("*.out"))

            try:
                scaleout.wait(lambda: delivered() >= args.rows, timeout=600, poll=0.1)
                took = time.time() - started
            finally:
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                for proc in procs:
                    proc.wait(60)
            scaleout.drop_table(engine, table)
            print(f"{workers} worker(s), {args.store} store: {took:.2f}s")
            for path in sorted(workdir.glob("*.timeline.json")):
                show(json.loads(path.read_text()))
    print(f"load average after: {scaleout.load_average()}")
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
