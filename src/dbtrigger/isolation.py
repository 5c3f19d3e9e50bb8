"""Bisecting a failing batch down to the rows that fail alone (poison rows).

Used by a poller's delivery (:mod:`dbtrigger.runtime.delivery`) and by a fan-out
subscriber's share (:mod:`dbtrigger.runtime.subscriber_poison`); what is then
done with the rows found is :mod:`dbtrigger.quarantine`'s. Re-exported there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.cursor import canonical_json, encoded_pk
from dbtrigger.errors import LostLeaseError, PartialBatchError, SerializationError
from dbtrigger.events import RowChange

# --- isolating the failing rows ---------------------------------------------------


def _pk_key(pk: Mapping[str, Any]) -> str:
    try:
        return canonical_json(encoded_pk(pk))
    except SerializationError:
        return repr(sorted(pk.items()))


def match_failed(
    events: Sequence[RowChange], error: PartialBatchError
) -> list[tuple[RowChange, BaseException]]:
    """The events a :class:`PartialBatchError` names, each with its cause.

    Keys are compared through the state document's value encoding, so a key
    named with an ``int`` matches the event's ``int`` however the driver built
    it. Named keys that are not in ``events`` are ignored.
    """
    wanted: dict[str, BaseException] = {}
    for index, pk in enumerate(error.failed_pks):
        wanted.setdefault(_pk_key(pk), error.causes.get(index, error))
    return [(e, wanted[_pk_key(e.pk)]) for e in events if _pk_key(e.pk) in wanted]


@dataclass
class Isolation:
    """What bisecting a failing batch found.

    ``ok`` rows passed in some half (they were processed); ``bad`` rows failed
    alone. ``aborted`` is True when more than the limit of rows failed alone
    and the search stopped: the failure is treated as an outage.
    """

    ok: list[RowChange] = field(default_factory=list)
    bad: list[tuple[RowChange, BaseException]] = field(default_factory=list)
    calls: int = 0
    aborted: bool = False


class _LimitReached(Exception):
    pass


def isolate(
    events: Sequence[RowChange],
    call: Callable[[list[RowChange]], None],
    *,
    first_error: BaseException,
    limit: int,
    check: Callable[[], None] | None = None,
) -> Isolation:
    """Bisect ``events`` (which just failed with ``first_error``) down to the rows
    that fail alone.

    ``call`` runs the handler on a sub-batch and raises when it fails;
    ``check`` runs before every call and may raise (the lease was lost) to end
    the search. A handler that answers a half with
    :class:`~dbtrigger.errors.PartialBatchError` has named its bad rows, and
    that half is not split further. Costs about ``2 * bad * log2(len(events))``
    handler calls.
    """
    out = Isolation()

    def add_bad(event: RowChange, exc: BaseException) -> None:
        out.bad.append((event, exc))
        if len(out.bad) > limit:
            raise _LimitReached

    def split(chunk: list[RowChange], error: BaseException) -> None:
        if len(chunk) == 1:
            add_bad(chunk[0], error)
            return
        mid = len(chunk) // 2
        for half in (chunk[:mid], chunk[mid:]):
            if check is not None:
                check()
            out.calls += 1
            try:
                call(half)
            except LostLeaseError:
                raise
            except PartialBatchError as partial:
                named = match_failed(half, partial)
                if not named:
                    split(half, partial)
                    continue
                named_ids = {e.event_id for e, _ in named}
                out.ok.extend(e for e in half if e.event_id not in named_ids)
                for event, exc in named:
                    add_bad(event, exc)
            except Exception as exc:  # noqa: BLE001 - any handler failure is data here
                split(half, exc)
            else:
                out.ok.extend(half)

    try:
        split(list(events), first_error)
    except _LimitReached:
        out.aborted = True
    return out
