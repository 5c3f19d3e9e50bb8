"""A :class:`~dbtrigger.runtime.poller.PollTrigger`'s options, checked before anything is built.

Each numeric option's type and range goes through :mod:`dbtrigger.options`
(a :class:`~dbtrigger.errors.ConfigurationError` that names the option, the
value and what it must be), in the order of the constructor's signature; then
how options relate: the heartbeat interval below half the lease TTL (default
a third of it), the retry delay at most its cap, ``handler_timeout_seconds``
not with fan-out (whose calls ``ack_timeout_seconds`` bounds).
:class:`PollOptions` holds the checked values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from dbtrigger import options as opt
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime.heartbeat import default_interval
from dbtrigger.state.backoff import check_retry_delays

__all__ = ["PollOptions", "check_retry_delays", "heartbeat_interval"]


def check_ports(source: object, store: object) -> None:
    """Refuse a source or a store that is not one (None, a URL string...) at once,
    naming it, instead of an AttributeError at the first tick."""
    for option, value, methods, kind in (
        ("source", source, ("fetch", "fingerprint"), "SqlAlchemySource(...)"),
        ("checkpoint_store", store, ("read", "write"), "FileCheckpointStore(...)"),
    ):
        if not all(callable(getattr(value, m, None)) for m in methods):
            raise ConfigurationError(
                f"{option}= must be a {option.replace('_', ' ')} object (e.g. {kind}), "
                f"got {type(value).__name__}"
            )


def heartbeat_interval(interval: float | None, lease_ttl: float) -> float:
    """``heartbeat_interval_seconds`` (checked alone) against the lease TTL, or its
    default (a third of the TTL)."""
    if interval is None:
        return default_interval(lease_ttl)
    if interval >= lease_ttl / 2:
        raise ConfigurationError(
            "heartbeat_interval_seconds must be below lease_ttl_seconds / 2 "
            f"({lease_ttl / 2:g}) so a renewal can fail once and still arrive "
            f"in time, or 0 to disable; got {interval}"
        )
    return interval


@dataclass(frozen=True)
class PollOptions:
    """A poller's numeric options, checked (named as the constructor names them)."""

    batch_size: int
    max_batches_per_tick: int
    journal_limit: int
    lease_ttl_seconds: float
    heartbeat_interval_seconds: float
    null_check_interval_seconds: float
    max_attempts: int
    quarantine_limit: int
    max_concurrency: int
    partitions: int | None
    balance_interval_seconds: float | None
    member_ttl_seconds: float | None
    window_max_events: int
    window_max_bytes: int
    retry_delay_seconds: float
    retry_delay_max_seconds: float
    ack_timeout_seconds: float | None
    handler_timeout_seconds: float | None

    @classmethod
    def check(cls, given: Mapping[str, Any]) -> PollOptions:
        """Check the constructor's keyword arguments ``given``: each option alone,
        in the order of the signature, then how they relate.

        Raises:
            ConfigurationError: naming the first option that is wrong.
        """
        checked = {name: check(name, given[name]) for name, check in _ALONE}
        checked["heartbeat_interval_seconds"] = heartbeat_interval(
            checked["heartbeat_interval_seconds"], checked["lease_ttl_seconds"]
        )
        check_retry_delays(checked["retry_delay_seconds"], checked["retry_delay_max_seconds"])
        if checked["handler_timeout_seconds"] is not None and given.get("subscribers") is not None:
            raise ConfigurationError(
                "handler_timeout_seconds applies to a single handler; a subscriber's "
                "calls are bounded by ack_timeout_seconds"
            )
        return cls(**checked)


#: How each option is checked alone, in the order of the constructor's signature.
_ALONE: tuple[tuple[str, Callable[[str, object], Any]], ...] = (
    ("batch_size", opt.whole),
    ("max_batches_per_tick", opt.whole),
    ("journal_limit", partial(opt.whole, minimum=0)),
    ("lease_ttl_seconds", opt.seconds),
    ("heartbeat_interval_seconds", partial(opt.optional_seconds, inclusive=True)),
    ("null_check_interval_seconds", partial(opt.seconds, inclusive=True)),
    ("max_attempts", opt.whole),
    ("quarantine_limit", opt.whole),
    ("max_concurrency", opt.whole),
    ("partitions", opt.optional_whole),
    ("balance_interval_seconds", opt.optional_seconds),
    ("member_ttl_seconds", opt.optional_seconds),
    ("window_max_events", opt.whole),
    ("window_max_bytes", partial(opt.whole, minimum=1024)),
    ("retry_delay_seconds", partial(opt.seconds, inclusive=True)),
    ("retry_delay_max_seconds", partial(opt.seconds, inclusive=True)),
    ("ack_timeout_seconds", opt.optional_seconds),
    ("handler_timeout_seconds", opt.optional_seconds),
)
