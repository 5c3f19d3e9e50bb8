"""Poller names claimed by the ``DbBindings`` of one process, across all of them.

The poller name is the state document's name in its store. One ``DbBindings``
refuses a name twice; an app split into ``func.Blueprint`` modules often has a
``DbBindings`` per module, which cannot see each other. Two functions on one
document would share its checkpoint and lease: each firing hands the new rows
to whichever function wins the lease, and each silently misses the other's.

A claim is (where the documents live, poller name) -> the function's qualified
name, held only while the ``DbBindings`` that made it is alive. The same
function decorated again (its module imported once more, as test suites and
``importlib.reload`` do) is the same poller, not a second one.
"""

from __future__ import annotations

import weakref
from typing import Any

from dbtrigger.errors import ConfigurationError
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import describe_store

_claims: dict[tuple[str, str], tuple[weakref.ReferenceType[Any], str]] = {}


def _where(store: CheckpointStore) -> str:
    """Where ``store`` keeps its documents; an in-process store is its own place."""
    try:
        where = describe_store(store)
    except Exception:  # noqa: BLE001 - a store that cannot say where: identity alone
        where = ""
    return where if where not in ("", "memory") else f"{type(store).__name__}@{id(store)}"


def claim(owner: object, store: CheckpointStore, poller: str, function: str) -> None:
    """Record that ``function`` of ``owner`` (a ``DbBindings``) is poller ``poller``.

    Raises:
        ConfigurationError: another live ``DbBindings`` has a different function
            on the same poller name in the same store.
    """
    key = (_where(store), poller)
    held = _claims.get(key)
    if held is not None:
        other, other_function = held
        if other() is not None and other() is not owner and other_function != function:
            raise ConfigurationError(
                f"poller {poller!r} in {key[0]} is already the trigger of function "
                f"{other_function} (in another DbBindings, e.g. another blueprint's): two "
                "functions on one state document would split its rows between them; give "
                f"{function} a distinct name=, or share one DbBindings across the app"
            )
    _claims[key] = (weakref.ref(owner), function)


__all__ = ["claim"]
