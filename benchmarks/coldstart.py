"""Cold start: importing dbtrigger, and the first tick of a Functions invocation.

Every measurement runs in a fresh interpreter (``--repeats`` of them, medians
reported), next to the interpreter's own start-up measured the same way:

* ``import dbtrigger``: wall and CPU milliseconds, and which heavy packages the
  import loaded (it must load none: SQLAlchemy, a DB driver, tenacity, an
  Azure SDK are imported when a name that needs them is first used);
* ``function_app imports``: what ``examples/function_app.py`` imports
  (``azure.functions``, ``DbBindings``, ``SqlAlchemySource``,
  ``BlobCheckpointStore``, ``DbOut``, ``RowChange``);
* ``first tick``: a function app defined the way the example defines it
  (PostgreSQL source, Blob store on a private Azurite, or the in-memory store
  with ``--store memory``), then its function invoked once the way the
  Functions host invokes it: engine, table reflection, state read, fetch,
  handler and commit of one batch of 100 rows, then a second invocation for
  comparison (the warm cost of the same work).

``--compare DIR`` runs the same children against another checkout's ``src``
directory too (interleaved), e.g. the code before a change::

    git archive HEAD~3 src | tar -x -C /tmp/before
    python -m benchmarks.coldstart --compare /tmp/before/src

    python -m benchmarks.coldstart                # 7 rounds, Blob store on Azurite
    python -m benchmarks.coldstart --quick        # 2 rounds, in-memory store
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import subprocess
import sys
import uuid
from typing import Any

from benchmarks.common import ROOT, azurite, dataset, int_list, median, print_table

HEAVY = ("sqlalchemy", "psycopg", "pymysql", "tenacity", "azure", "asyncio")

_IMPORT = """
import json, sys, time
w, c = time.perf_counter(), time.process_time()
{imports}
w, c = time.perf_counter() - w, time.process_time() - c
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
print(json.dumps({{"wall": w * 1e3, "cpu": c * 1e3, "heavy": heavy}}))
"""

_TICK = """
import json, os, time
w = time.perf_counter()
import azure.functions as func
from dbtrigger import BlobCheckpointStore, DbBindings, InMemoryCheckpointStore, SqlAlchemySource
imported = time.perf_counter() - w

app = func.FunctionApp()
db = DbBindings()
source = SqlAlchemySource(
    url=os.environ["BENCH_URL"], table=os.environ["BENCH_TABLE"], schema=os.environ["BENCH_SCHEMA"],
    cursor_column="updated_at", pk_columns=["id"],
)
if os.environ.get("BENCH_BLOB"):
    store = BlobCheckpointStore.from_connection_string(
        os.environ["BENCH_BLOB"], app_name=os.environ["BENCH_APP"], container="coldstart",
        create_container=True,
    )
else:
    store = InMemoryCheckpointStore()
seen = []

@app.schedule(schedule="0 */1 * * * *", arg_name="timer")
@db.trigger(arg_name="events", source=source, checkpoint_store=store, name="cold",
            batch_size=100, max_batches_per_tick=1)
def poll(timer, events):
    seen.extend((e.pk["id"], e.after["status"]) for e in events)

(function,) = app.get_functions()
invoke = function.get_user_function()
defined = time.perf_counter() - w
t = time.perf_counter(); invoke(timer=None); first = time.perf_counter() - t
t = time.perf_counter(); invoke(timer=None); second = time.perf_counter() - t
assert len(seen) == 200, len(seen)
print(json.dumps({{"imports": imported * 1e3, "defined": defined * 1e3,
                  "first": first * 1e3, "second": second * 1e3}}))
"""


def run_child(code: str, src: str | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    child_env = dict(os.environ)
    child_env.update(env or {})
    if src is not None:
        child_env["PYTHONPATH"] = src
    out = subprocess.run(  # noqa: S603 - our own interpreter running our own code
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env,
        cwd=ROOT,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--store", choices=("blob", "memory"), default="blob")
    parser.add_argument("--rows", default="100k", help="the PostgreSQL data set to read from")
    parser.add_argument("--compare", metavar="DIR", help="another checkout's src directory")
    parser.add_argument("--quick", action="store_true", help="2 rounds, in-memory store")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.store = 2, "memory"

    variants: list[tuple[str, str | None]] = [("this checkout", None)]
    if args.compare:
        variants.append((f"--compare {args.compare}", os.path.abspath(args.compare)))
    # A deployed app's packages come with their bytecode (pip writes it when it installs
    # them); a checkout's may have none (PYTHONDONTWRITEBYTECODE=1, a fresh clone), and a
    # child would compile dbtrigger from source each time: write it once, before timing.
    for _, src in variants:
        compileall.compile_dir(src or str(ROOT / "src"), quiet=1)
    imports = {
        "python -c pass": "pass",  # the timer alone: interpreter start-up is not in any row
        "import dbtrigger": "import dbtrigger",
        "function_app imports": "import azure.functions\n"
        "from dbtrigger import BlobCheckpointStore, DbBindings, DbOut, RowChange, "
        "SqlAlchemySource",
    }
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for label, src in variants:
            for what, code in imports.items():
                body = _IMPORT.format(imports=code, heavy=HEAVY)
                samples.setdefault((label, what), []).append(run_child(body, src))
    rows = []
    for (label, what), got in samples.items():
        rows.append(
            [
                what,
                label,
                f"{median([g['wall'] for g in got]):.1f}",
                f"{median([g['cpu'] for g in got]):.1f}",
                ", ".join(got[-1]["heavy"]) or "-",
            ]
        )
    print_table(
        f"Imports in a fresh interpreter, ms (median of {args.repeats}; "
        "target: import dbtrigger < 100 ms, loading none of the heavy packages)",
        ["what", "code", "wall ms", "cpu ms", f"heavy packages loaded (of {', '.join(HEAVY)})"],
        rows,
        left=2,
    )

    ds = dataset("postgresql", int_list(args.rows)[0])
    env = {
        "BENCH_URL": ds.url,
        "BENCH_TABLE": ds.table,
        "BENCH_SCHEMA": ds.schema or "",
    }
    ticks: dict[str, list[dict[str, Any]]] = {}
    with azurite() if args.store == "blob" else contextlib.nullcontext() as az:
        if az is not None:
            env["BENCH_BLOB"] = az.connection_string
        for _ in range(args.repeats):
            for label, src in variants:
                env["BENCH_APP"] = f"c{uuid.uuid4().hex[:10]}"
                ticks.setdefault(label, []).append(run_child(_TICK.format(), src, env))
    rows = [
        [
            label,
            *(
                f"{median([g[k] for g in got]):.1f}"
                for k in ("imports", "defined", "first", "second")
            ),
        ]
        for label, got in ticks.items()
    ]
    print_table(
        f"A Functions invocation from a fresh process, ms (median of {args.repeats}; "
        f"PostgreSQL source, {args.store} store, one batch of 100 rows per invocation)",
        ["code", "imports", "app defined", "1st invocation", "2nd invocation"],
        rows,
    )
    print(
        "imports: azure.functions + dbtrigger names; app defined: including imports; "
        "1st invocation: engine, reflection, state read, fetch, handler, commit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
