"""Who holds a lease, as a process, and whether that process provably died.

A worker killed mid-batch (``kill -9``, an OOM kill, ``os._exit``) leaves its
lease neither released nor renewed; by the lease rules another instance takes
it over once it has expired (``lease_ttl_seconds``, default 120 s). A worker
restarted on the same machine (systemd, a supervisor, a shell loop) would
then deliver nothing for that long, though it could see for itself that the
holder is gone. So each lease this version takes records the taking process
(``lease.process`` in the state document)::

    {"host": "web-1", "boot_id": "523c...", "pid_ns": "pid:[4026531836]",
     "pid": 4242, "started": 59955, "fencing_token": 7}

``started`` is the process's start time in clock ticks since boot
(``/proc/<pid>/stat`` field 22), which tells a pid reused by another process
from the one recorded. ``fencing_token`` binds the record to the lease it was
written with: a version that predates this field keeps it unchanged in the
lease it takes (an unknown field is written back as read), with a higher
token, so a record whose token is not the lease's says nothing of its holder.

A holder is *provably gone* (:func:`gone`) only when everything is known and
agrees: the record is of this very lease, names this host, this boot
(``/proc/sys/kernel/random/boot_id``) and this PID namespace
(``/proc/self/ns/pid``, with a ``/proc`` mounted for it), and its pid no
longer exists, or exists with another start time (reused), or is a zombie
with no thread left. Anything else - another host, another container,
another boot, no ``/proc`` (macOS, Windows), a ``/proc`` that hides other
users' processes, a record missing or malformed - is "not known to be
gone", and the lease lapses by its TTL as before. No command line, user or
environment is recorded.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from dbtrigger.state.document import Lease

_PROC = "/proc"

#: (pid, identity) of this process, computed once per process (a fork recomputes).
_mine: tuple[int, dict[str, Any] | None] | None = None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _stat(pid: int | str) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of ``pid`` from its
    ``/proc/<pid>/stat``; None when it cannot be read or parsed."""
    text = _read(f"{_PROC}/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or
    # parentheses itself: the fields that follow start after the last ")".
    fields = text.rpartition(")")[2].split()
    try:
        return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime)
    except (IndexError, ValueError):
        return None


def _identify() -> dict[str, Any] | None:
    pid = os.getpid()
    try:
        # /proc must be mounted for our PID namespace: its "self" is our pid.
        if os.readlink(f"{_PROC}/self") != str(pid):
            return None
        namespace = os.readlink(f"{_PROC}/self/ns/pid")
    except OSError:  # no /proc (macOS, Windows), or no access to it
        return None
    boot = (_read(f"{_PROC}/sys/kernel/random/boot_id") or "").strip()
    stat = _stat("self")
    if not boot or not namespace or stat is None:
        return None
    return {
        "host": socket.gethostname(),
        "boot_id": boot,
        "pid_ns": namespace,
        "pid": pid,
        "started": stat[1],
    }


def this_process() -> dict[str, Any] | None:
    """This process as a lease records it (without the token), or None where it
    cannot be told (no usable ``/proc``): then no record is written."""
    global _mine  # noqa: PLW0603 - a per-process cache
    pid = os.getpid()
    if _mine is None or _mine[0] != pid:
        _mine = (pid, _identify())
    return None if _mine[1] is None else dict(_mine[1])


def record(token: int) -> dict[str, Any] | None:
    """What a lease taken with ``token`` by this process records of it (None: nothing)."""
    me = this_process()
    return None if me is None else {**me, "fencing_token": token}


def target(
    recorded: Mapping[str, Any] | None, token: int, me: Mapping[str, Any] | None
) -> tuple[int, int] | None:
    """``(pid, started)`` of the process a lease's record names, when it is a
    process whose life this one can check (pure: the record, the lease's token,
    and this process as :func:`this_process` sees it); None otherwise."""
    if recorded is None or me is None:
        return None
    pid, started = recorded.get("pid"), recorded.get("started")
    if type(pid) is not int or type(started) is not int or pid <= 0:
        return None
    written_with = recorded.get("fencing_token")
    if type(written_with) is not int or written_with != token:
        return None
    for key in ("host", "boot_id", "pid_ns"):
        value = recorded.get(key)
        if not isinstance(value, str) or not value or value != me.get(key):
            return None
    if pid == me.get("pid") and started == me.get("started"):
        return None  # this very process: alive
    return pid, started


def _exists(pid: int) -> bool | None:
    """Whether ``pid`` exists in our PID namespace (None: cannot tell)."""
    try:
        os.kill(pid, 0)  # signal 0: delivers nothing, only checks
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return None
    return True


def _how_gone(pid: int, started: int) -> str | None:
    """Why process ``pid`` started at ``started`` is provably no longer running
    (None: it may be)."""
    alive = _exists(pid)
    if alive is None:
        return None
    if not alive:
        return f"pid {pid} no longer exists"
    stat = _stat(pid)
    if stat is None:
        # Exited since (then gone), or hidden from us (hidepid): alive, as far as we know.
        return f"pid {pid} no longer exists" if _exists(pid) is False else None
    state, now_started = stat
    if now_started != started:
        return f"pid {pid} is now another process (started at tick {now_started}, not {started})"
    if state in ("Z", "X"):
        try:
            tasks = os.listdir(f"{_PROC}/{pid}/task")
        except OSError:
            return None
        if tasks == [str(pid)]:  # the zombie leader alone: every thread has exited
            return f"pid {pid} has exited (a zombie not yet reaped)"
    return None


def gone(lease: Lease | None) -> str | None:
    """Why the holder of ``lease`` (unreleased) is provably no longer running, as
    words for the log; None when it is alive or that cannot be known."""
    if lease is None or lease.released or lease.process is None:
        return None
    found = target(lease.process, lease.fencing_token, this_process())
    if found is None:
        return None
    return _how_gone(*found)


__all__ = ["gone", "record", "target", "this_process"]
