"""The history store that goes with a checkpoint store: same family, same place.

A poller's history is kept beside its state document unless told otherwise
(``PollTrigger(history=...)``): JSON-lines files next to the state file, append
blobs next to the state blob, a table next to the SQL state table, entities in
the Table Storage state table, a dict next to the in-memory store. A store of
one's own (or one wrapped, like ``CountingStore``) has no history unless one
is given.
"""

from __future__ import annotations

import weakref
from typing import Any

from dbtrigger.history.memory import MemoryHistory
from dbtrigger.history.store import HistoryStore

_MEMORY: weakref.WeakKeyDictionary[Any, MemoryHistory] = weakref.WeakKeyDictionary()


def history_for(store: Any) -> HistoryStore | None:
    """The history store beside checkpoint store ``store``; None for other stores.

    Never connects: the adapters reach their service at first use.
    """
    from dbtrigger.state.stores.file import FileCheckpointStore  # noqa: PLC0415 - optional deps
    from dbtrigger.state.stores.memory import InMemoryCheckpointStore  # noqa: PLC0415

    explicit = getattr(store, "history", None)
    if explicit is not None and isinstance(explicit, HistoryStore):
        return explicit
    if isinstance(store, FileCheckpointStore):
        from dbtrigger.history.file import FileHistory  # noqa: PLC0415

        return FileHistory(store.directory)
    if isinstance(store, InMemoryCheckpointStore):
        history = _MEMORY.get(store)
        if history is None:
            history = _MEMORY[store] = MemoryHistory()
        return history
    kind = type(store).__name__
    if kind == "SqlCheckpointStore":
        from dbtrigger.history.sql import SqlHistory  # noqa: PLC0415

        schema, _, name = store.table_name.rpartition(".")
        return SqlHistory(
            lambda: store.engine,
            table=f"{name}_history",
            schema=schema or None,
            namespace=store.namespace,
            create_table=store.creates_table,
            lock_timeout_seconds=store.lock_timeout,
        )
    if kind == "BlobCheckpointStore":
        from dbtrigger.history.blob import BlobHistory  # noqa: PLC0415

        return BlobHistory(
            lambda: store.container_client,
            app=lambda: store.app_name,
            prefix=store.prefix,
            credential=store.credential_words,
        )
    if kind == "TableCheckpointStore":
        from dbtrigger.history.table import TableHistory  # noqa: PLC0415

        return TableHistory(
            lambda: store.table_client, app=store.app_name, credential=store.credential_words
        )
    return None


def resolve_history(option: object, store: Any) -> HistoryStore | None:
    """``PollTrigger(history=...)``: None (the default) keeps one beside ``store`` when
    that store has a family (else none), True insists on one, False keeps none, a
    :class:`HistoryStore` is used as given.

    Raises:
        ConfigurationError: ``True`` for a store without a history family, or a
            value that is none of these.
    """
    from dbtrigger.errors import ConfigurationError  # noqa: PLC0415

    if option is False:
        return None
    if option is None or option is True:
        found = history_for(store)
        if found is None and option is True:
            raise ConfigurationError(
                f"history=True: the checkpoint store {type(store).__name__} has no history "
                "beside it; pass a history store (dbtrigger.history.FileHistory, SqlHistory, "
                "...) as history="
            )
        return found
    if isinstance(option, HistoryStore):
        return option
    raise ConfigurationError(
        f"history must be None, True, False or a history store, got {option!r}"
    )


__all__ = ["history_for", "resolve_history"]
