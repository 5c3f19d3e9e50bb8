"""``dbtrigger queue add`` and ``dbtrigger queue cancel``: work in, work off, from a shell.

``add`` inserts rows given as JSON (``--row``, repeated, or ``--file`` with
one JSON object per line, ``-`` for stdin) through
:meth:`~dbtrigger.queue.source.ClaimSource.enqueue`, now or ``--run-after``
a delay or a time, with ``--priority``. It applies at once, as a producer's
``INSERT`` would: adding work destroys nothing.

``cancel`` takes rows off the queue by key (``--key``), a dry run unless
``--yes``, and says of each key whether it was canceled, is running (a worker
holds it; left alone), had finished, or is not in the queue.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from dbtrigger._argparse import add_apply_option, read_file_option
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue.cli_target import parse_duration, queue_source, table_options


def parse_run_after(text: str, parse_duration: Callable[[str], float]) -> Any:
    """``10m``, ``3600``, ``2w`` (a delay) or ``2026-11-23T18:00:00Z`` (a time with a zone)."""
    try:
        return parse_duration(text)
    except ConfigurationError:
        pass
    raw = text.strip().replace(" ", "T", 1)
    try:
        moment = dt.datetime.fromisoformat(raw[:-1] + "+00:00" if raw.endswith("Z") else raw)
    except ValueError:
        raise ConfigurationError(
            f"--run-after {text!r} is neither a delay (90, 15m, 12h, 7d) nor a time "
            "(2026-11-23T18:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        raise ConfigurationError(
            f"--run-after {text!r} has no time zone: add Z or +02:00 (the queue compares "
            "it with the database's clock)"
        )
    return moment


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{where} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigurationError(f"{where} must be a JSON object of column values, got {text!r}")
    return value


def _rows(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    for number, text in enumerate(args.row, 1):
        yield _json_object(text, f"--row #{number}")
    if args.file:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            data = read_file_option(args.file)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigurationError(
                    f"{args.file} is not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                yield _json_object(line, f"{args.file} line {number}")


def cmd_add(args: argparse.Namespace) -> int:

    rows = list(_rows(args))
    if not rows:
        raise ConfigurationError("nothing to add: give --row JSON (repeatable) or --file PATH")
    run_after = parse_run_after(args.run_after, parse_duration) if args.run_after else None
    source = queue_source(args)
    try:
        count = source.enqueue(rows, run_after=run_after, priority=args.priority)
    finally:
        source.close()
    when = ""
    if isinstance(run_after, dt.datetime):
        when = f", due at {run_after.astimezone(dt.timezone.utc).isoformat()}"
    elif run_after is not None:
        when = f", due in {args.run_after}"
    prio = f", priority {args.priority}" if args.priority is not None else ""
    print(f"added {count} row(s) to {source.name}{when}{prio}")
    return 0


def parse_key(text: str) -> Any:
    """``5``, ``"abc"`` or ``{"id": 5, "region": "eu"}`` (JSON), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _typed(source: Any, key: Any) -> Any:
    """A key typed on the command line, its values as the key columns' Python types
    (``--key 007`` on a text key is ``"007"``, on an integer key ``7``)."""
    columns = source.queue_table.user.c
    names = list(source.pk_columns)
    pk = dict(key) if isinstance(key, dict) else ({names[0]: key} if len(names) == 1 else key)
    if not isinstance(pk, dict):
        return key
    out = {}
    for name, value in pk.items():
        try:
            kind = columns[name].type.python_type if name in columns else None
        except NotImplementedError:
            kind = None
        typed = value
        if kind in (int, str) and not isinstance(value, kind):
            try:
                typed = kind(value)
            except (TypeError, ValueError):
                raise ConfigurationError(
                    f"--key {name}={value!r} is not a valid {kind.__name__} for {name}"
                ) from None
        out[name] = typed
    return out


def cmd_cancel(args: argparse.Namespace) -> int:

    if not args.key:
        raise ConfigurationError("say which rows: --key VALUE (or a JSON key object), repeatable")
    source = queue_source(args)
    try:
        keys = [_typed(source, parse_key(k)) for k in args.key]
        result = source.cancel(keys, reason=args.reason, dry_run=not args.yes)
    finally:
        source.close()
    verb = "canceled" if args.yes else "would be canceled"
    parts = [
        (result.canceled, verb),
        (result.running, "running (a worker holds it: left alone)"),
        (result.finished, "already finished (done, dead or canceled)"),
        (result.missing, "not in the queue"),
    ]
    for keys, what in parts:
        if keys:
            shown = ", ".join(json.dumps(k, default=str) for k in keys[:20])
            more = f" and {len(keys) - 20} more" if len(keys) > 20 else ""
            print(f"{len(keys)} {what}: {shown}{more}")
    if not args.yes and result.canceled:
        print("dry run: add --yes to cancel them")
    return 0


def add_job_commands(qsub: Any) -> None:
    """Register ``queue add`` and ``queue cancel``."""
    add = qsub.add_parser(
        "add", help="enqueue rows (JSON), now or --run-after, with --priority; applies at once"
    )
    table_options(add)
    add.add_argument(
        "--row", action="append", default=[], metavar="JSON", help="one row, e.g. '{\"id\": 1}'"
    )
    add.add_argument("--file", metavar="PATH", help="rows as JSON lines ('-': stdin)")
    add.add_argument(
        "--run-after",
        metavar="DELAY|TIME",
        help="not claimed before: a delay (90, 15m, 2h, 7d) or a time with a zone "
        "(2026-11-23T18:00:00Z)",
    )
    add.add_argument(
        "--priority", type=int, help="higher is claimed first (needs queue install --priority)"
    )
    add.set_defaults(func=cmd_add)

    cancel = qsub.add_parser("cancel", help="take rows off the queue before they run (dry run)")
    table_options(cancel)
    cancel.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="VALUE|JSON",
        help="the row's key: a value for a one-column key, or '{\"id\": 5}'; repeatable",
    )
    cancel.add_argument("--reason", required=True, help="why: kept in dbt_last_error")
    add_apply_option(cancel)
    cancel.set_defaults(func=cmd_cancel)


__all__ = ["add_job_commands", "parse_key", "parse_run_after"]
