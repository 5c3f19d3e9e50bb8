"""What a tick says about a batch whose delivering process died, and its refusal.

The decisions are :mod:`dbtrigger.state.crashes` (pure): a lease taken over
that its holder neither released nor renewed counts as a failed attempt of
the batch at the checkpoint, and once ``max_attempts`` are counted with the
latest one dead the batch is not handed over whole again. This module says
so: ``lease_holder_gone`` (WARNING) when the holder's process was found gone
before its lease expired (taken over at once, :mod:`dbtrigger._process`),
``delivery_died`` (WARNING) on each such takeover, and ``crash_loop``
(ERROR) with a :class:`~dbtrigger.errors.CrashLoopError` naming the batch's
first and last row and the ways on, instead of handing the batch to a
handler that would kill this process too.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from dbtrigger._paste import pasteable
from dbtrigger.cursor import Position
from dbtrigger.errors import CrashLoopError
from dbtrigger.events import RowChange
from dbtrigger.sources.base import position_of
from dbtrigger.state.codec import format_time
from dbtrigger.state.document import FailureRecord, Lease


def _at(position: Position) -> str:
    if position.is_beginning:
        return "the beginning"
    return f"{dict(position.pk)!r} at cursor {position.cursor!r}"


def say_died(
    emit: Callable[..., None],
    dead: Lease,
    failure: FailureRecord | None,
    position: Position,
    max_attempts: int,
    *,
    early: bool = False,
) -> None:
    """``delivery_died`` at WARNING: the takeover of ``dead``, counted as an attempt
    (``early``: its process was found gone before the lease expired)."""
    attempts = failure.attempts if failure is not None else 1
    emit(
        "delivery_died",
        "the process delivering the batch after %s (%s, token %s) stopped without releasing "
        "its lease (%s %s): killed, crashed or hung; counted as failed attempt %d "
        "of max_attempts=%d of that batch",
        _at(position),
        dead.owner_id,
        dead.fencing_token,
        "found gone, lease until" if early else "expired at",
        format_time(dead.expires_at),
        attempts,
        max_attempts,
        dead_owner=dead.owner_id,
        dead_fencing_token=dead.fencing_token,
        attempt=attempts,
        checkpoint=None if position.is_beginning else repr(position.cursor),
    )


def say_gone(emit: Callable[..., None], dead: Lease, why: str, token: int) -> None:
    """``lease_holder_gone`` at WARNING: ``dead``'s lease, unexpired, taken over at
    once because its process provably no longer runs (``why``)."""
    process = dead.process or {}
    emit(
        "lease_holder_gone",
        "the lease holder %s (token %s, pid %s on this host) is no longer running (%s): "
        "its lease, valid until %s, taken over at once with token %s",
        dead.owner_id,
        dead.fencing_token,
        process.get("pid"),
        why,
        format_time(dead.expires_at),
        token,
        dead_owner=dead.owner_id,
        dead_fencing_token=dead.fencing_token,
        dead_pid=process.get("pid"),
        fencing_token=token,
    )


def _reset(target: str, position: Position) -> str:
    if position.is_beginning:
        return f"dbtrigger reset {target} --to-beginning"
    keys = "".join(f" --pk {shlex.quote(f'{k}={v}')}" for k, v in position.pk.items())
    return f"dbtrigger reset {target} --to-cursor {shlex.quote(str(position.cursor))}{keys}"


def refuse(
    emit: Callable[..., None],
    *,
    poller: str,
    target: str,
    failure: FailureRecord,
    events: list[RowChange],
    position: Position,
    batch_id: str,
    fencing_token: int,
    max_attempts: int,
    outside: bool = False,
) -> CrashLoopError:
    """``crash_loop`` at ERROR, and the error the tick raises instead of delivering.

    ``target`` is the poller as the CLI names it (with ``--source`` when known).
    """
    first, last = position_of(events[0]), position_of(events[-1])
    sink = (
        "with a dead-letter sink (quarantine=) the poller would hand it over one row "
        "at a time and set the row at fault aside"
    )
    rows = (
        f"batch {batch_id} of poller {poller!r}, {len(events)} row(s) from {_at(first)} to "
        f"{_at(last)} (after the checkpoint at {_at(position)})"
    )
    why = (
        f"{rows}, killed the process delivering it on its last {failure.crashes} attempt(s) "
        f"({failure.attempts} failed in all, max_attempts={max_attempts}); it is not handed "
        f"over again, as the handler would kill this process too ({sink})."
    )
    if outside:
        why = (
            f"{rows}: the process delivering it died on its last {failure.crashes} "
            f"attempt(s), {failure.crashes - max_attempts} of them while its rows were "
            f"handed over one at a time, of which {len(failure.killed)} named the row "
            "handed alone (failure.killed); the others came outside every handler call - "
            "reading the batch after it (a row too big for memory: try a smaller "
            "batch_size; a crash in the database driver), writing the dead-letter sink or "
            "the state - which no sink can set aside. Find how the worker ended (OOM kill, "
            "segfault: the platform's log) before going on."
        )
    why += (
        " Ways on: fix the handler (or the row) and "
        "deliver the batch again with the count cleared: "
        f"{pasteable(_reset(target, position) + ' --reason TEXT --yes')} (the checkpoint "
        "where it stands); or step over the batch, its rows not delivered (data loss, "
        f"journaled): {pasteable(_reset(target, last) + ' --reason TEXT --yes')}; or over "
        "the rows up to one of them (--to-cursor/--pk of the row before the one at fault)"
    )
    fields: dict[str, Any] = {
        "batch_id": batch_id,
        "fencing_token": fencing_token,
        "attempt": failure.attempts,
        "crashes": failure.crashes,
        "rows": len(events),
    }
    error = CrashLoopError(why, poller=poller, **fields)
    emit("crash_loop", "%s", error, **fields)
    return error


__all__ = ["refuse", "say_died", "say_gone"]
