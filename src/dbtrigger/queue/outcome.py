"""Pure decisions for a claimed batch: which rows are done, retried or dead, and when.

Decide, then do: :func:`decide` takes what the handler did (returned, raised,
marked rows with ``ctx.retry`` / ``ctx.reject``) and the attempt numbers, and
returns a :class:`Plan`; the trigger performs it (dead-letter sink first, then
one fenced settlement). Nothing here does I/O, so every rule is table-tested.

The rules:

* a row the handler neither marked nor failed is **done**;
* ``ctx.reject(event, reason)`` makes the row **dead** at once (terminal);
* ``ctx.retry(event, reason)``, an exception from the handler that falls on
  this row alone (the only row of the call not otherwise marked), or a
  :class:`~dbtrigger.errors.PartialBatchError` naming the row fail the
  attempt: **retry** after a backoff, or **dead** once the row has had
  ``max_attempts`` attempts;
* an exception that falls on several rows says nothing about which of them
  failed: those rows are **split** - handed back in two halves that wait as
  groups (after the backoff) and are claimed again each on its own, the
  attempt not counted against any of them (``dbt_attempts`` is given back).
  A half that fails again is halved again, so a poison row is alone after
  about ``log2(batch_size)`` failures and from then on its failures count
  (it comes back alone, a group of its own, so it never fails a claim of
  fresh rows again); its batch-mates are done in the halves without it, with
  the attempts they had. Each row's counted attempts are never more than ``max_attempts``, and
  a row sees at most about ``log2(batch_size)`` uncounted failures per
  counted one, so a poison row still ends ``dead``;
* a failure on a transient error (:func:`~dbtrigger.state.verdict.transient`: a
  write that gave up waiting for another transaction's lock, a lost
  connection) says nothing about the row: it is retried as any failure, but a
  row that has had ``max_attempts`` attempts is handed back with its last
  attempt given back instead of going dead, until the cause is gone;
* a row claimed alone after a claim that expired holding only it (the rows
  of an expired claim are claimed again in halves until the row that kills
  its worker is alone: :mod:`dbtrigger.queue.pick`), once it has had
  ``max_attempts`` attempts, is **dead** without calling the handler, so a
  row that kills its worker cannot crash-loop for ever, and it alone goes dead.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dbtrigger.errors import PartialBatchError
from dbtrigger.queue.schema import ERROR_LIMIT
from dbtrigger.queue.statements import DeadItem, Key, RetryItem
from dbtrigger.redaction import redact
from dbtrigger.state.backoff import Backoff
from dbtrigger.state.verdict import transient


@dataclass(frozen=True)
class Mark:
    """What the handler said about one row through its context."""

    kind: Literal["retry", "reject"]
    reason: str
    delay_seconds: float | None = None


@dataclass(frozen=True)
class Plan:
    done: list[Key] = field(default_factory=list)
    retry: list[RetryItem] = field(default_factory=list)
    dead: list[DeadItem] = field(default_factory=list)


def error_text(error: BaseException | str) -> str:
    """An error as stored in ``dbt_last_error``: one line of type and message,
    with anything that looks like a secret masked, truncated to the column."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return redact(text.strip())[:ERROR_LIMIT]


def _failed_by_partial(
    error: PartialBatchError, pks: Mapping[Key, Mapping[str, object]], passing: set[Key]
) -> dict[Key, str]:
    """The rows ``error`` names, with their error texts; those whose cause is
    transient are added to ``passing``."""
    named: dict[Key, str] = {}
    for index, failed in enumerate(error.failed_pks):
        for key, pk in pks.items():
            if dict(pk) == dict(failed):
                cause = error.causes.get(index)
                named[key] = error_text(cause) if cause is not None else error_text(error)
                if transient(cause):
                    passing.add(key)
    return named


def decide(
    rows: Sequence[tuple[Key, int]],
    *,
    pks: Mapping[Key, Mapping[str, object]],
    marks: Mapping[Key, Mark],
    failure: BaseException | None,
    max_attempts: int,
    backoff: Backoff,
    rng: random.Random,
) -> Plan:
    """The outcome of each ``(key, attempt)`` after the handler ran (see the module doc)."""
    failed: dict[Key, str] = {}
    shared: list[tuple[Key, int]] = []
    passing: set[Key] = set()  # failed on a transient error: never dead for it
    if isinstance(failure, PartialBatchError):
        failed = _failed_by_partial(failure, pks, passing)
    elif failure is not None:
        text = error_text(failure)
        failed = {key: text for key, _ in rows}
        shared = [(key, attempt) for key, attempt in rows if key not in marks]
        if transient(failure):
            passing = set(failed)
    plan = Plan()
    split: set[Key] = set()
    if len(shared) > 1:
        text = error_text(f"failed with {len(shared) - 1} other row(s): {failed[shared[0][0]]}")
        _split(plan, shared, text, backoff, rng)
        split = {key for key, _ in shared}
    for key, attempt in rows:
        if key in split:
            continue
        mark = marks.get(key)
        if mark is not None and mark.kind == "reject":
            plan.dead.append(DeadItem(key, error_text(f"rejected: {mark.reason}")))
            continue
        reason: str | None = None
        delay: float | None = None
        if mark is not None:
            reason, delay = error_text(f"retry requested: {mark.reason}"), mark.delay_seconds
        elif key in failed:
            reason = failed[key]
        if reason is None:
            plan.done.append(key)
        elif attempt >= max_attempts and mark is None and key in passing:
            # Not the row's fault: back alone, its attempt given back (never dead for it).
            group = f"{rng.getrandbits(128):032x}"
            plan.retry.append(RetryItem(key, backoff.delay(attempt, rng), reason, group))
        elif attempt >= max_attempts:
            plan.dead.append(DeadItem(key, error_text(f"failed {attempt} times; last: {reason}")))
        else:
            wait = backoff.delay(attempt, rng) if delay is None else max(0.0, delay)
            # A row an unnamed failure fell on alone comes back alone (a group of
            # its own), so it does not fail a claim of fresh rows again.
            unnamed = mark is None and bool(shared)  # the exception, not a name
            alone = f"{rng.getrandbits(128):032x}" if unnamed else None
            plan.retry.append(RetryItem(key, wait, reason, alone, counted=alone is not None))
    return plan


def _split(
    plan: Plan, shared: Sequence[tuple[Key, int]], error: str, backoff: Backoff, rng: random.Random
) -> None:
    """Hand ``shared`` back in two halves, each a group of its own that waits
    out one backoff (the highest attempt's) and costs no attempt."""
    wait = backoff.delay(max(attempt for _, attempt in shared), rng)
    half = (len(shared) + 1) // 2
    for part in (shared[:half], shared[half:]):
        group = f"{rng.getrandbits(128):032x}"
        plan.retry.extend(RetryItem(key, wait, error, group) for key, _ in part)


def expired_too_often(attempt: int, max_attempts: int, *, isolated: bool) -> bool:
    """An isolated row (its last claim expired holding only it) claimed more
    often than ``max_attempts``. A row claimed with others is never dead for
    expiries: an expiry shared by several rows is given back when the claim is
    halved (:mod:`dbtrigger.queue.pick`), so only expiries alone count."""
    return isolated and attempt > max_attempts


EXPIRED_ERROR = (
    "claim expired {expired} times without an outcome; isolated as a single row, "
    "it still got none: the worker holding it crashed, hung or ran past the "
    "visibility timeout every time"
)
