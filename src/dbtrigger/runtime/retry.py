"""Retrying transient failures inside a tick: bounded, jittered, and selective.

A tick that hits a brief storage or database hiccup should not give up and
wait for the next timer firing (minutes, perhaps) when trying again after a
fraction of a second would have worked. So reads of the state document,
conditional writes that were refused because the store was unreachable, and
source fetches are retried a few times with exponential backoff and full
jitter (each wait is drawn uniformly between zero and the exponential bound,
which keeps instances that failed together from retrying in lock-step).

What is never retried inside a tick, and why:

* handler errors - the handler's side effects are the user's; running it again
  at once would double them. A failed batch is redelivered on the next tick,
  and counted towards poison isolation.
* operator errors (:class:`~dbtrigger.errors.OperatorError`: bad credentials,
  corrupt state, a changed source definition) - retrying cannot fix them and
  would only delay the loud failure.
* contention (:class:`~dbtrigger.errors.ContentionError`: a lost
  compare-and-swap, a live lease elsewhere) - that is another instance doing
  the work, the protocol working as designed.

The whole retry budget is bounded by ``attempts`` and ``max_elapsed_seconds``
so a tick that holds a lease cannot spend it waiting on a dead dependency.

The loop is written out here rather than built from a retry library: it runs
around every fetch and state write, and the first attempt (almost always the
only one) should cost a function call, not the construction of a retry
controller; nor should importing dbtrigger's runtime import one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dbtrigger import options as opt
from dbtrigger.errors import (
    AmbiguousWriteError,
    ContentionError,
    FetchError,
    HandlerError,
    OperatorError,
    PartialBatchError,
    QuarantineError,
    RetryableError,
    StoreUnavailableError,
)

log = logging.getLogger("dbtrigger.runtime")

T = TypeVar("T")

#: Failures that are retried by default: nothing was changed (or, for fetches,
#: nothing is changed by reading again).
TRANSIENT: tuple[type[BaseException], ...] = (
    FetchError,
    StoreUnavailableError,
    QuarantineError,
)

RetryHook = Callable[[str, int, BaseException, float], None]


def is_transient(exc: BaseException, kinds: tuple[type[BaseException], ...] = TRANSIENT) -> bool:
    """True when ``exc`` is worth another try right away.

    Operator errors, contention, handler errors and ambiguous writes are never
    transient here, whatever ``kinds`` says: an ambiguous write must be
    resolved by re-reading (see :class:`~dbtrigger.runtime.session.LeaseSession`),
    not by blindly writing again.
    """
    if isinstance(
        exc, (OperatorError, ContentionError, HandlerError, PartialBatchError, AmbiguousWriteError)
    ):
        return False
    return isinstance(exc, kinds) and isinstance(exc, RetryableError)


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures inside one tick are retried.

    Args:
        attempts: tries per operation, the first included (1 disables retries).
        initial_backoff_seconds: upper bound of the first wait.
        max_backoff_seconds: upper bound of any single wait.
        multiplier: growth of the bound per attempt.
        max_elapsed_seconds: no new attempt starts after this much time spent
            on one operation; keep it well below the lease TTL.
        sleep: the sleep function (tests pass a recorder instead of waiting).
        clock: the monotonic clock ``max_elapsed_seconds`` is measured on (tests
            pass one that their ``sleep`` moves).

    Waits use full jitter: attempt ``n`` sleeps a uniform random time in
    ``[0, min(max_backoff, initial * multiplier ** (n - 1))]``.
    """

    attempts: int = 4
    initial_backoff_seconds: float = 0.1
    max_backoff_seconds: float = 2.0
    multiplier: float = 2.0
    max_elapsed_seconds: float = 10.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        opt.whole("RetryPolicy.attempts", self.attempts)
        for name in ("initial_backoff_seconds", "max_backoff_seconds"):
            opt.seconds(f"RetryPolicy.{name}", getattr(self, name), inclusive=True)
        opt.number("RetryPolicy.multiplier", self.multiplier, minimum=1, inclusive=True)
        opt.seconds("RetryPolicy.max_elapsed_seconds", self.max_elapsed_seconds)

    @classmethod
    def none(cls) -> RetryPolicy:
        """Fail on the first error (the next tick is the only retry)."""
        return cls(attempts=1)

    def call(
        self,
        fn: Callable[[], T],
        *,
        operation: str,
        kinds: tuple[type[BaseException], ...] = TRANSIENT,
        on_retry: RetryHook | None = None,
        fields: dict[str, Any] | None = None,
    ) -> T:
        """Run ``fn``, retrying it on transient ``kinds``; re-raise the last error.

        ``on_retry(operation, attempt, error, wait)`` is called before each wait
        (for metrics); every retry is also logged at DEBUG with the event
        ``retrying`` (the tick's failure, if the retries do not help, is what
        an operator reads).
        """
        started = self.clock()
        attempt = 1
        while True:
            try:
                return fn()
            except BaseException as exc:
                if (
                    attempt >= self.attempts
                    or not is_transient(exc, kinds)
                    or self.clock() - started >= self.max_elapsed_seconds
                ):
                    raise
                error = exc
            bound = min(
                self.max_backoff_seconds,
                self.initial_backoff_seconds * self.multiplier ** (attempt - 1),
            )
            wait = random.uniform(0, bound)  # noqa: S311 - jitter, not cryptography
            # DEBUG: an outage would say this three times per tick; the tick's
            # failure (or nothing, when a retry succeeds) is what an operator reads,
            # and retries_total counts them.
            log.debug(
                "%s failed (attempt %d of %d), retrying in %.2fs: %s",
                operation,
                attempt,
                self.attempts,
                wait,
                error,
                extra={
                    "event": "retrying",
                    "operation": operation,
                    "attempt": attempt,
                    "error_type": type(error).__name__,
                    **(fields or {}),
                },
            )
            if on_retry is not None:
                on_retry(operation, attempt, error, wait)
            del error  # no reference cycle through the traceback while sleeping
            self.sleep(wait)
            attempt += 1


#: The policy a :class:`~dbtrigger.runtime.poller.PollTrigger` uses unless told otherwise.
DEFAULT_RETRY_POLICY = RetryPolicy()
