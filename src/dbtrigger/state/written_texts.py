"""The journal entry texts of the last few state documents this process encoded,
by the document's bytes.

A worker reads its state document at the start of every tick, and it is
nearly always the one it wrote at the end of the last tick. Parsing it makes
new entry objects without their texts, so that tick's first commit encoded the
whole journal again (about 0.1 ms, more than the parse). The document is still
parsed as always; only the texts its entries were encoded to are handed back
to the parsed entries, in order (:func:`dbtrigger.state.document.loads`). A
text is what encoding its parsed entry gives (compact JSON of a dict reads back
to an equal dict with the same key order, which encodes to the same text).
"""

from __future__ import annotations

import threading


class WrittenTexts:
    """A small cache: document bytes -> the texts of its journal entries."""

    _SIZE = 8

    def __init__(self) -> None:
        self._texts: dict[bytes, list[str]] = {}
        self._lock = threading.Lock()

    def remember(self, data: bytes, texts: list[str]) -> None:
        with self._lock:
            self._texts.pop(data, None)
            self._texts[data] = texts
            while len(self._texts) > self._SIZE:
                del self._texts[next(iter(self._texts))]

    def texts_of(self, data: bytes | str, entries: int) -> list[str] | None:
        """The texts of a document's ``entries`` journal entries, if ``data`` is
        bytes this process encoded (and has that many entries)."""
        if type(data) is not bytes:
            return None
        with self._lock:
            texts = self._texts.get(data)
        return texts if texts is not None and len(texts) == entries else None


__all__ = ["WrittenTexts"]
