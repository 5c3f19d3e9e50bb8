"""Run one page's blocks in order, as a reader would, in the current directory.

``python doc_runner.py BLOCKS.json RESULTS.json``: Python blocks (and the page's
hidden ``doc-test: run`` comments) share one namespace, as if pasted one after
another into one interpreter; shell blocks run through bash, each command on
its own, with the package's ``dbtrigger`` first on PATH. The results file gets
one entry per block, in order, written after each so a hang still shows which
block it was. A block that fails does not stop the next (later blocks may fail
for the same cause; the first failure is the one to read).

A worker the page starts (``dbtrigger run``, ``dbtrigger demo``) would run until
stopped: the harness bounds it (``--max-ticks 2``, ``--duration 3``) and a
``--serve`` command listens on a free loopback port instead of the page's
8080 (several test runs share a machine) and is stopped once it says it serves,
as a person would press Ctrl-C. Nothing else in a command is changed. Every
``dbtrigger`` command runs ``dbtrigger.cli:main`` as the console script does, in a
process forked from one interpreter that imported the CLI once (tests/doc_cli.py:
a fifth of a fresh process's CPU).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from doc_cli import fork_server

PRELUDE = r"""
dbtrigger() {
  case "$1" in
    run) command dbtrigger "$@" --max-ticks 2 ;;
    demo) command dbtrigger "$@" --duration 3 ;;
    *)
      case " $* " in
        *" --serve "*)
          args=()
          for arg in "$@"; do
            case "$arg" in *:8080) arg=127.0.0.1:0 ;; esac
            args+=("$arg")
          done
          # Until it says it serves (at most 60 s), then Ctrl-C until it has stopped.
          out=$(mktemp) err=$(mktemp)
          command dbtrigger "${args[@]}" >"$out" 2>"$err" &
          pid=$!
          for _ in $(seq 600); do
            grep -q "^serving " "$out" && break
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
          done
          for _ in $(seq 100); do
            kill -INT "$pid" 2>/dev/null || break
            sleep 0.1
          done
          kill -KILL "$pid" 2>/dev/null
          wait "$pid"
          rc=$?
          cat "$out"
          cat "$err" >&2
          rm -f "$out" "$err"
          if [ "$rc" = 130 ]; then return 0; fi
          return "$rc" ;;
        *) command dbtrigger "$@" ;;
      esac ;;
  esac
}
"""


def run_python(
    code: str, where: str, namespace: dict[str, object], expect: list[str]
) -> tuple[bool, str]:
    """Run a block; it passes when it raises nothing and prints what the page says.

    ``expect``: what the page shows a ``print`` prints (a comment beside it, or on
    the line after), in order; each is one whole line of what the block printed.
    """
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
    except BaseException:
        return False, out.getvalue() + err.getvalue() + traceback.format_exc(limit=8)
    printed = [line.strip() for line in out.getvalue().splitlines()]
    at = 0
    for line in expect:
        while at < len(printed) and printed[at] != line:
            at += 1
        if at == len(printed):
            return False, (
                f"the page says a print shows {line!r}; the block printed:\n{out.getvalue()}"
            )
        at += 1
    return True, out.getvalue() + err.getvalue()


def shows(printed: str, shown: list[str]) -> str | None:
    """None when every ``shown`` line is a whole line of ``printed``, in order
    (``...`` stands for any lines); else the first line that is not."""
    lines = [line.strip() for line in printed.splitlines()]
    at = 0
    for want in shown:
        if want == "...":
            continue
        while at < len(lines) and lines[at] != want:
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def run_shell(
    commands: list[str], exits: list[int], shown: list[list[str]] | None
) -> tuple[bool, str]:
    transcript = []
    for i, command in enumerate(commands):
        done = subprocess.run(
            ["bash", "-c", PRELUDE + command],  # noqa: S607 - the reader's shell, from PATH
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        transcript.append(f"$ {command}\n{done.stdout}{done.stderr}[exit {done.returncode}]")
        if done.returncode not in exits:
            return False, "\n".join(transcript)
        missing = shows(done.stdout + done.stderr, shown[i]) if shown else None
        if missing is not None:
            transcript.append(f"the page shows {missing!r}, which this command did not print")
            return False, "\n".join(transcript)
    return True, "\n".join(transcript)


@contextlib.contextmanager
def forked_cli(blocks: list[dict[str, object]], shared: str | None) -> Iterator[str | None]:
    """A directory whose ``dbtrigger`` runs each command forked from one interpreter
    that imported the CLI once (tests/doc_cli.py); None when no shell block names it.

    ``shared``: the directory of a server already running (the test process's, so
    its imports are paid once for all the pages, not once a page); else one is
    started for this page."""
    if not any("dbtrigger" in str(b["commands"]) for b in blocks if b["kind"] == "shell"):
        yield None
        return
    if shared:
        yield shared
        return
    with fork_server() as shim_dir:
        yield shim_dir


def main() -> None:
    blocks = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    results_path = Path(sys.argv[2])
    sys.path.insert(0, os.getcwd())
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    namespace: dict[str, object] = {"__name__": "__main__"}
    results = []
    shared = os.environ.pop("DOCTEST_CLI_DIR", None)  # not the page's to see
    with forked_cli(blocks, shared) as shim_dir:
        if shim_dir is not None:
            os.environ["PATH"] = shim_dir + os.pathsep + os.environ["PATH"]
        for block in blocks:
            if block["save"]:
                Path(block["save"]).write_text(block["code"], encoding="utf-8")
                sys.modules.pop(Path(block["save"]).stem, None)
            if block["kind"] == "python":
                ok, output = run_python(block["code"], block["where"], namespace, block["expect"])
            else:
                ok, output = run_shell(block["commands"], block["exits"], block["shown"])
            results.append({"where": block["where"], "ok": ok, "output": output})
            results_path.write_text(json.dumps(results), encoding="utf-8")


if __name__ == "__main__":
    main()
