"""Claim sources that break one rule of the claim contract each.

Each wraps a real :class:`~dbtrigger.ClaimSource` on a throw-away SQLite
queue and gets one thing wrong; the meta-test in ``tests/test_claim_contract.py``
checks that the suite catches every one of them with the test named for it.
"""

from __future__ import annotations

import dataclasses
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dbtrigger.queue.layout import Claim
from dbtrigger.queue.statements import DeadItem, Key, RetryItem, Settled
from tests.contracts.claim_harnesses import ColumnsHarness
from tests.databases import TestDatabase

#: Where the queues' files go: one folder, removed when the process ends (a folder
#: per queue was left in the system's temporary directory by every run).
_FILES = tempfile.TemporaryDirectory(prefix="dbt-claims-")


def sqlite_queue() -> ColumnsHarness:
    """A columns-mode queue in a new SQLite file (the nested session has no ``db``)."""
    url = f"sqlite:///{Path(_FILES.name) / f'queue-{uuid.uuid4().hex}.db'}"
    return ColumnsHarness(TestDatabase("sqlite", url, None, sa.create_engine(url)))


class Wrapped:
    """A real claim source; subclasses override one operation."""

    #: key -> the token that last claimed it, shared by every source of a harness.
    holders: dict[Key, str]

    def __init__(self, real: Any, holders: dict[Key, str]) -> None:
        self.real = real
        self.holders = holders

    @property
    def name(self) -> str:
        return str(self.real.name)

    def claim_batch(self, *, limit: int, token: str, worker: str, visibility: float) -> Claim:
        claim = self.real.claim_batch(
            limit=limit, token=token, worker=worker, visibility=visibility
        )
        for row in claim.rows:
            self.holders[row.key] = token
        return claim  # type: ignore[no-any-return]

    def extend(self, *, token: str, visibility: float) -> int:
        return int(self.real.extend(token=token, visibility=visibility))

    def settle(
        self,
        *,
        token: str,
        done: Sequence[Key],
        retry: Sequence[RetryItem] = (),
        dead: Sequence[DeadItem] = (),
    ) -> Settled:
        return self.real.settle(token=token, done=done, retry=retry, dead=dead)  # type: ignore[no-any-return]

    def counts(self) -> Any:
        return self.real.counts()

    def close(self) -> None:
        self.real.close()


class Unfenced(Wrapped):
    """Settles a row for whichever claim holds it now: a stale worker overwrites."""

    def settle(self, *, token: str, done: Sequence[Key], retry: Sequence[RetryItem] = (),
               dead: Sequence[DeadItem] = ()) -> Settled:  # fmt: skip
        del token
        parts: dict[str, tuple[list[Key], list[RetryItem], list[DeadItem]]] = {}
        for key in done:
            parts.setdefault(self.holders.get(key, ""), ([], [], []))[0].append(key)
        for item in retry:
            parts.setdefault(self.holders.get(item.key, ""), ([], [], []))[1].append(item)
        for dead_item in dead:
            parts.setdefault(self.holders.get(dead_item.key, ""), ([], [], []))[2].append(dead_item)
        out = Settled(frozenset(), frozenset(), frozenset())
        for holder, (d, r, x) in parts.items():
            got = self.real.settle(token=holder, done=d, retry=r, dead=x)
            out = Settled(out.done | got.done, out.retried | got.retried, out.dead | got.dead)
        return out


class Overreporting(Wrapped):
    """Says every row it was asked to settle was written, held or not."""

    def settle(self, *, token: str, done: Sequence[Key], retry: Sequence[RetryItem] = (),
               dead: Sequence[DeadItem] = ()) -> Settled:  # fmt: skip
        self.real.settle(token=token, done=done, retry=retry, dead=dead)
        return Settled(
            frozenset(done), frozenset(r.key for r in retry), frozenset(d.key for d in dead)
        )


class FirstAttemptForever(Wrapped):
    """Never counts an attempt: every claim says it is the first."""

    def claim_batch(self, *, limit: int, token: str, worker: str, visibility: float) -> Claim:
        claim = super().claim_batch(limit=limit, token=token, worker=worker, visibility=visibility)
        rows = [dataclasses.replace(r, attempt=1) for r in claim.rows]
        return Claim(rows, claim.more, claim.bisected)


class Sharing(Wrapped):
    """Hands the rows of the previous claim out again with the next one."""

    last: list[Any]

    def claim_batch(self, *, limit: int, token: str, worker: str, visibility: float) -> Claim:
        claim = super().claim_batch(limit=limit, token=token, worker=worker, visibility=visibility)
        shared = [r for r in getattr(self, "last", []) if r not in claim.rows]
        self.last = list(claim.rows)
        return Claim([*claim.rows, *shared][: max(limit, 1)], claim.more, claim.bisected)


class BrokenHarness:
    def __init__(self, kind: Callable[[Any, dict[Key, str]], Wrapped]) -> None:
        self.inner = sqlite_queue()
        self.kind = kind
        self.holders: dict[Key, str] = {}

    def put(self, ids: Sequence[int]) -> None:
        self.inner.put(ids)

    def open(self) -> Wrapped:
        return self.kind(self.inner.open(), self.holders)


BROKEN_CLAIM_HARNESSES: dict[str, Callable[[], BrokenHarness]] = {
    "unfenced": lambda: BrokenHarness(Unfenced),
    "overreporting": lambda: BrokenHarness(Overreporting),
    "first_attempt_forever": lambda: BrokenHarness(FirstAttemptForever),
    "sharing": lambda: BrokenHarness(Sharing),
}
