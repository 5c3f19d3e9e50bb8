"""Texts of the state document that one commit's encoding keeps from the last.

Every commit writes the whole state document, yet changes little of it. Its
journal (20 entries by default) is most of the bytes, and a commit adds one
entry and changes none: each entry keeps the text it was encoded to
(:class:`JournalRecord`), and the journal's joined text is carried from one
commit to the next (:func:`journal_text`), so a commit encodes and joins one
entry, not twenty. The document's first fields (its name, fingerprint and
source definition) never change under a poller: :func:`static_text`.
:func:`dbtrigger.state.document.dumps` splices the texts in.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

#: The document's one JSON encoding: compact, keys in insertion order, ASCII.
encode_json = json.JSONEncoder(separators=(",", ":")).encode


class JournalRecord(dict[str, Any]):
    """One journal entry as the document holds it: a read-only dict that keeps its JSON.

    Why: every commit writes the whole document, and the journal (20 entries
    by default) is most of its bytes, yet a commit adds one entry and changes
    none. An entry is encoded on the first write that includes it and its text
    is reused by every later write (:func:`dbtrigger.state.document.dumps`), so
    a commit encodes one entry instead of all of them. The text stays right only while the entry
    does not change, so the methods that would change it raise ``TypeError``
    (nothing in dbtrigger changes an entry, nested values included). It is a
    dict, so ``json``, ``==`` and code that reads entries see no difference.
    """

    __slots__ = ("_json",)

    def __init__(self, entry: Mapping[str, Any]) -> None:
        super().__init__(entry)
        self._json: str | None = None

    def json_text(self) -> str:
        """The entry's compact JSON, encoded once."""
        text = self._json
        if text is None:
            text = self._json = encode_json(self)
        return text

    def __reduce__(self) -> tuple[type[JournalRecord], tuple[dict[str, Any]]]:
        return (JournalRecord, (dict(self),))

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "journal entries are read-only (their encoded JSON is kept); "
            "copy one with dict(entry) to change it"
        )

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only


def entry_json(entry: Mapping[str, Any]) -> str:
    if isinstance(entry, JournalRecord):
        return entry.json_text()
    return encode_json(dict(entry))


#: The journal :func:`journal_text` joined last: (entries, their texts, joined).
_last_journal: list[tuple[tuple[Mapping[str, Any], ...], list[str], str]] = [((), [], "")]


def journal_text(journal: tuple[Mapping[str, Any], ...]) -> tuple[list[str], str]:
    """The entries' texts and their comma-joined text. A commit's journal is the
    last one joined with its oldest entries dropped and one added (the same
    entry objects): then only the new entry's text is looked up, and the
    joined text is the last one's tail plus it. Kept only for a journal of
    :class:`JournalRecord` entries (a plain dict may change in place)."""
    last, texts, joined = _last_journal[0]
    if journal is last:
        return texts, joined
    kept = len(journal) - 1
    dropped = len(last) - kept
    if kept > 0 and dropped >= 0 and all(map(operator.is_, journal[:kept], last[dropped:])):
        cut = sum(map(len, texts[:dropped])) + dropped  # (each dropped text and its comma)
        new = entry_json(journal[-1])
        texts = [*texts[dropped:], new]
        joined = f"{joined[cut:]},{new}"
    else:
        texts = [entry_json(entry) for entry in journal]
        joined = ",".join(texts)
        kept = 0  # (every entry is checked below)
    records = all(type(entry) is JournalRecord for entry in journal[kept:])
    _last_journal[0] = (journal, texts, joined) if records else ((), [], "")
    return texts, joined


#: The last :func:`static_text`: (the objects, the key, the text).
_last_static: list[tuple[tuple[object, ...], tuple[object, ...], str] | None] = [None]


def static_text(
    objects: tuple[object, ...], key: tuple[object, ...], make: Callable[[], Mapping[str, Any]]
) -> str:
    """``make()`` as JSON less its closing brace, encoded again only when one of
    ``objects`` is another object (by identity: a document's mappings are never
    changed in place, and every document a poller's commits derive from one it
    read shares that one's) or ``key`` another value."""
    cached = _last_static[0]
    if cached is not None and cached[1] == key and all(map(operator.is_, cached[0], objects)):
        return cached[2]
    text = encode_json(make())[:-1]
    _last_static[0] = (objects, key, text)
    return text


__all__ = ["JournalRecord", "encode_json", "entry_json", "journal_text", "static_text"]
