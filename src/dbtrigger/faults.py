"""Fault injection for checkpoint stores and sources, for your own tests.

Every failure the runtime contract describes - a lost compare-and-swap, a
commit that timed out after it landed, a storage outage, a dropped database
connection - is hard to provoke with the real services on demand. These
wrappers sit between the poller and a real store or source and misbehave
exactly when a :class:`FaultPlan` says so; everything else passes through
untouched, so the rest of the test runs against the real thing::

    from dbtrigger.faults import Fault, FaultPlan, FaultyStore

    plan = FaultPlan()
    plan.add("write", Fault.AMBIGUOUS_LANDED, skip=1)  # the commit lands, then "times out"
    trigger = PollTrigger(name="orders", source=source,
                          checkpoint_store=FaultyStore(store, plan))
    trigger.tick(handler)

Rules match an operation (``read``, ``write``, ``delete``, ``list_keys`` for
stores; ``fetch`` for sources; ``*`` for any), may skip the first ``skip``
matching calls, fire ``times`` times (``None``: for ever), with a
``probability`` drawn from the plan's seeded random generator, and only for
calls a ``match`` predicate accepts. A ``before`` hook runs just before the
call (use it to let a competitor write first, which makes a CAS conflict
real rather than simulated). Every call is recorded in :attr:`FaultPlan.calls`
with the fault it got, so tests can also count storage operations.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import (
    AmbiguousWriteError,
    CasConflictError,
    ConfigurationError,
    CorruptStateError,
    FetchError,
    StoreAuthError,
    StoreUnavailableError,
)
from dbtrigger.events import RowChange
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument


class Fault(str, enum.Enum):
    """What an injected fault does."""

    #: Store: the conditional write is refused (412); nothing is written.
    CONFLICT = "conflict"
    #: Store: the write lands, then the caller gets a timeout (ambiguous commit).
    AMBIGUOUS_LANDED = "ambiguous_landed"
    #: Store: the caller gets a timeout and the write did not land.
    AMBIGUOUS_LOST = "ambiguous_lost"
    #: Store: the service answers 5xx / cannot be reached; nothing happens.
    UNAVAILABLE = "unavailable"
    #: Store: credentials or permissions refused (an operator error).
    AUTH = "auth"
    #: Store or source: the call waits ``delay`` seconds, then proceeds normally.
    SLOW = "slow"
    #: Source: the database connection drops (pooled connections are discarded).
    CONNECTION_DROP = "connection_drop"
    #: Source: the query fails on the server.
    QUERY_ERROR = "query_error"
    #: Store or source: the call proceeds normally (only the ``before`` hook acts).
    NONE = "none"


STORE_FAULTS = frozenset(
    {
        Fault.CONFLICT,
        Fault.AMBIGUOUS_LANDED,
        Fault.AMBIGUOUS_LOST,
        Fault.UNAVAILABLE,
        Fault.AUTH,
        Fault.SLOW,
        Fault.NONE,
    }
)
SOURCE_FAULTS = frozenset({Fault.CONNECTION_DROP, Fault.QUERY_ERROR, Fault.SLOW, Fault.NONE})
WRITE_ONLY = frozenset({Fault.CONFLICT, Fault.AMBIGUOUS_LANDED, Fault.AMBIGUOUS_LOST})


@dataclass(frozen=True)
class Call:
    """One call that went through a faulty wrapper."""

    op: str
    index: int  # 0-based count of earlier calls with the same op
    key: str | None = None
    data: bytes | None = None
    if_match: str | None = None

    @property
    def document(self) -> StateDocument | None:
        """The state document being written (None for other calls or non-documents)."""
        if self.data is None:
            return None
        try:
            return docmod.loads(self.data)
        except CorruptStateError:
            return None


@dataclass
class FaultRule:
    """Inject ``fault`` into calls of ``op``; see :class:`FaultPlan`."""

    op: str
    fault: Fault
    times: int | None = 1
    skip: int = 0
    probability: float = 1.0
    delay: float = 0.0
    match: Callable[[Call], bool] | None = None
    before: Callable[[Call], None] | None = None
    fired: int = 0
    seen: int = 0

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.fired >= self.times


@dataclass(frozen=True)
class Injection:
    call: Call
    fault: Fault | None


class FaultPlan:
    """An ordered list of fault rules; the first rule that fires wins.

    Thread-safe; the random draws come from ``random.Random(seed)`` so a
    failing randomized test can be replayed.
    """

    def __init__(self, rules: Iterable[FaultRule] = (), *, seed: int | None = None) -> None:
        self.rules: list[FaultRule] = list(rules)
        self.calls: list[Injection] = []
        self._random = random.Random(seed)  # noqa: S311 - test randomness, not security
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(
        self,
        op: str,
        fault: Fault,
        *,
        times: int | None = 1,
        skip: int = 0,
        probability: float = 1.0,
        delay: float = 0.0,
        match: Callable[[Call], bool] | None = None,
        before: Callable[[Call], None] | None = None,
    ) -> FaultRule:
        """Append a rule and return it (its ``fired`` count tells what happened)."""
        if not 0 <= probability <= 1:
            raise ConfigurationError(f"probability must be within [0, 1], got {probability}")
        rule = FaultRule(op, fault, times, skip, probability, delay, match, before)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule (calls are still recorded)."""
        with self._lock:
            self.rules.clear()

    def next_call(self, op: str, **details: Any) -> tuple[Call, FaultRule | None]:
        """Record a call and pick the rule that fires for it (wrappers call this)."""
        with self._lock:
            index = self._counts.get(op, 0)
            self._counts[op] = index + 1
            call = Call(op=op, index=index, **details)
            chosen: FaultRule | None = None
            for rule in self.rules:
                if rule.op not in (op, "*") or rule.exhausted:
                    continue
                if rule.fault in WRITE_ONLY and op != "write":
                    continue
                if rule.match is not None and not rule.match(call):
                    continue
                rule.seen += 1
                if rule.seen <= rule.skip:
                    continue
                if rule.probability < 1 and self._random.random() >= rule.probability:
                    continue
                rule.fired += 1
                chosen = rule
                break
            self.calls.append(Injection(call, chosen.fault if chosen else None))
        if chosen is not None and chosen.before is not None:
            chosen.before(call)
        return call, chosen

    def count(self, op: str | None = None, fault: Fault | None = None) -> int:
        """Calls recorded for ``op`` (any op when None) that got ``fault`` (any when None)."""
        with self._lock:
            return sum(
                1
                for i in self.calls
                if (op is None or i.call.op == op) and (fault is None or i.fault == fault)
            )

    def reset_counts(self) -> None:
        """Forget recorded calls (rules keep their state)."""
        with self._lock:
            self.calls.clear()


class FaultyStore:
    """A :class:`~dbtrigger.state.stores.base.CheckpointStore` that misbehaves on plan.

    With an empty plan it is the wrapped store, call for call (it passes the
    store contract suite), plus a record of every call in ``plan.calls``.
    """

    def __init__(self, inner: CheckpointStore, plan: FaultPlan | None = None) -> None:
        self.inner = inner
        self.plan = plan if plan is not None else FaultPlan()

    def _pre(self, rule: FaultRule | None, what: str) -> None:
        if rule is None:
            return
        fault = rule.fault
        if fault is Fault.SLOW:
            time.sleep(rule.delay)
        elif fault is Fault.UNAVAILABLE:
            raise StoreUnavailableError(f"injected: storage unavailable (503) during {what}")
        elif fault is Fault.AUTH:
            raise StoreAuthError(f"injected: storage refused the credentials (403) during {what}")
        elif fault is Fault.AMBIGUOUS_LOST:
            raise AmbiguousWriteError(f"injected: {what} timed out before it reached storage")
        elif fault is Fault.CONFLICT:
            raise CasConflictError(f"injected: {what} refused, the etag no longer matches (412)")

    def read(self, key: str) -> StoredDocument | None:
        _, rule = self.plan.next_call("read", key=key)
        self._pre(rule, "read")
        return self.inner.read(key)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        _, rule = self.plan.next_call("write", key=key, data=bytes(data), if_match=if_match)
        self._pre(rule, "write")
        etag = self.inner.write(key, data, if_match=if_match)
        if rule is not None and rule.fault is Fault.AMBIGUOUS_LANDED:
            raise AmbiguousWriteError("injected: the write landed but its response timed out")
        return etag

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        _, rule = self.plan.next_call("delete", key=key, if_match=if_match)
        self._pre(rule, "delete")
        self.inner.delete(key, if_match=if_match)

    def list_keys(self) -> list[str]:
        _, rule = self.plan.next_call("list_keys")
        self._pre(rule, "list")
        return self.inner.list_keys()

    def describe(self) -> str:
        return f"faulty({self.inner.describe()})"


class FaultySource:
    """A :class:`~dbtrigger.sources.base.SourceAdapter` whose fetches fail on plan.

    ``CONNECTION_DROP`` also disposes the wrapped source's connection pool when
    it has one (``engine``), the connection a catch-up keeps included, so the
    next fetch really reconnects.
    """

    #: Its plan counts fetches in the order a tick makes them: no read-ahead
    #: (dbtrigger.runtime.readahead), whose reads would take faults meant for the tick's,
    #: and one read a batch (no bulk reads: dbtrigger.runtime.bulk), so that a fault
    #: lands on the batch a plan names.
    concurrent_reads = False
    bulk_reads = False

    def __init__(self, inner: SourceAdapter, plan: FaultPlan | None = None) -> None:
        self.inner = inner
        self.plan = plan if plan is not None else FaultPlan()

    @property
    def name(self) -> str:
        return self.inner.name

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        _, rule = self.plan.next_call("fetch")
        if rule is not None:
            if rule.fault is Fault.SLOW:
                time.sleep(rule.delay)
            elif rule.fault is Fault.CONNECTION_DROP:
                release = getattr(self.inner, "release_connection", None)
                if release is not None:
                    release()  # a kept connection is not the pool's to close
                engine = getattr(self.inner, "engine", None)
                if engine is not None:
                    engine.dispose()
                raise FetchError(
                    f"fetch from {self.name} failed: injected: connection dropped"
                ) from ConnectionResetError("connection reset by peer")
            elif rule.fault is Fault.QUERY_ERROR:
                raise FetchError(f"fetch from {self.name} failed: injected: query error")
        return self.inner.fetch(after, limit)

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        return self.inner.to_events(rows, poller=poller, batch_id=batch_id)

    def __getattr__(self, name: str) -> Any:
        # Optional source extras (null_cursor_keys, count_after, ...) pass through.
        return getattr(self.inner, name)


__all__ = [
    "SOURCE_FAULTS",
    "STORE_FAULTS",
    "Call",
    "Fault",
    "FaultPlan",
    "FaultRule",
    "FaultySource",
    "FaultyStore",
    "Injection",
]
