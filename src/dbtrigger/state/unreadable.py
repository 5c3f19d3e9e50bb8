"""A state document nobody can read: the error that names it and the way out.

Whoever meets one (a tick in a Functions invocation or a worker, the health
probe, ``dbtrigger check``, every CLI command) reports it the same way: which
poller, which store, that nothing was changed, and the two commands that
replace it (a backup with ``--from-file``, or a new document with
``--to-beginning --source``), both needing ``--force`` because nothing can be
checked in a document that cannot be read.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

from dbtrigger._paste import pasteable
from dbtrigger.errors import CorruptStateError
from dbtrigger.redaction import redact
from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument


def unreadable_state(
    store: CheckpointStore,
    poller: str,
    exc: CorruptStateError,
    stored: object = None,
    spec: str | None = None,
) -> CorruptStateError:
    """``exc`` again, naming the poller, the store and the way out.

    ``stored`` (the document as read; by default what ``exc`` carries, from a
    store that could not decode it) is kept as the error's ``stored``
    attribute: ``reset --force`` replaces exactly that version. ``spec``, the
    ``module:attribute`` of the poller's trigger when known, is filled in the
    commands (else they say ``MODULE:ATTR``). With no backup the way that
    delivers no row twice is the last position the history recorded, which
    ``dbtrigger history`` prints as a ``reset --to-cursor`` to paste.
    """
    if stored is None:
        stored = getattr(exc, "stored", None)
    source = f"--source {shlex.quote(spec) if spec else 'MODULE:ATTR'}"
    error = CorruptStateError(
        f"the state of poller {poller!r} in {redact(store.describe())} cannot be read: {exc}. "
        "Nothing was changed. To replace it: dbtrigger reset "
        f"{poller} --from-file BACKUP --force (backups are in --backup-dir), or, with no "
        f"backup, `{pasteable(f'dbtrigger history {poller} {source}')}` shows the last "
        "position committed and the reset --to-cursor ... --force that resumes after it; "
        f"dbtrigger reset {poller} --to-beginning {source} --force delivers every row again",
        poller=poller,
    )
    error.stored = stored  # type: ignore[attr-defined]
    return error


def checkpoint_misfit(
    store: CheckpointStore, poller: str, exc: CorruptStateError, spec: str | None = None
) -> CorruptStateError:
    """``exc`` (a checkpoint the source cannot place: a tiebreaker without the key
    columns, edited by hand) again, naming the poller, the store and the reset
    that moves the checkpoint to a position the source can read."""
    source = f"--source {shlex.quote(spec) if spec else 'MODULE:ATTR'}"
    return CorruptStateError(
        f"the checkpoint of poller {poller!r} in {redact(store.describe())} does not fit its "
        f"source: {exc}. Nothing was changed. Move it to the last row delivered with "
        f"`{pasteable(f'dbtrigger reset {poller} --to-cursor VALUE --pk NAME=VALUE {source}')} "
        f"--reason R --yes` (`dbtrigger history {poller} {source}` shows the last position "
        f"committed), or deliver every row again with `dbtrigger reset {poller} "
        f"--to-beginning {source} --reason R --yes`",
        poller=poller,
    )


def load_state(
    store: CheckpointStore,
    poller: str,
    stored: StoredDocument,
    spec: str | Callable[[], str | None] | None = None,
) -> StateDocument:
    """The document ``store`` holds for ``poller``, parsed; :func:`unreadable_state`
    if it is corrupt or is another poller's (copied under this name by hand).

    ``spec`` may be a function that finds it: it is called only for that error
    (a trigger's import path is found by walking every imported module's
    globals, milliseconds that a tick reading a good document must not pay)."""
    try:
        doc = docmod.loads(stored.data)
        if doc.poller_name != poller:
            raise CorruptStateError(f"the document belongs to poller {doc.poller_name!r}")
    except CorruptStateError as exc:
        named = spec() if callable(spec) else spec
        raise unreadable_state(store, poller, exc, stored, named) from exc
    return doc


__all__ = ["checkpoint_misfit", "load_state", "unreadable_state"]
