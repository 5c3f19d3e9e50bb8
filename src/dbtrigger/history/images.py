"""Row images as a commit record's detail hashes them, in each detail format.

A commit's ``detail`` keeps one CRC-32 a delivered event: its image (the
operation, the column names and the row as fetched), so that a replay that
reads the row again tells a changed row from an unchanged one. The detail's
``format`` says how the image was made into bytes:

* **2**: the ``repr`` of the row's tuple, UTF-8 with surrogates passed (a value
  whose ``repr`` names a memory address: the event's canonical JSON).
* **3**: ``marshal.dumps(row, 2)``, for a batch whose every value marshal
  writes: ``int``, ``str``, ``float``, ``bytes``, ``bool``, ``None``, and lists
  and dicts of them (what a driver returns for numbers, text, binary and JSON).
  Marshal's version 2 writes them with no references and no interning flags,
  so the bytes are a function of the values alone (the same from Python 3.6
  to 3.13, checked at import against a known answer: :data:`MARSHAL_STABLE`),
  and makes them in a third of the time the ``repr`` takes: the detail is
  most of what the history costs a narrow row.

A live batch is written in format 3 when it can be, else (a timestamp or a
decimal column) in format 2, which any earlier dbtrigger reads too. A replay
makes the images again in the format of the record it compares with.
Format 1 (``events`` lines, ``images`` digest) is :func:`image_digest` and
:func:`digest_images`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import itertools
import json
import marshal
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from operator import attrgetter
from typing import Any

from dbtrigger.errors import ReplayRefusedError
from dbtrigger.events import RowChange
from dbtrigger.history.kept_rows import KeptRows

#: Row images as ``repr`` text (format 2) and as marshal bytes (format 3).
REPR_IMAGES = 2
MARSHAL_IMAGES = 3

#: Marshal's format version 2: no references, no interning flags.
_VERSION = 2

#: A known answer: what marshal's version 2 has written for these values since
#: Python 3.6 (checked with 3.6 to 3.13). A Python that writes other bytes
#: would see every row of a format-3 record as changed: it writes format 2 and
#: refuses to replay format 3 instead.
_KNOWN = (
    *(0, -2, 2**31, -(2**40), 2**70),
    *("a", "\u00e9\udc80", "", b"x"),
    *(None, True, False, 1.5, -0.0),
    [1, "b"],
    {"k": [None, 2.5]},
)
_KNOWN_BYTES = bytes.fromhex(
    "2810000000690000000069feffffff6c030000000000000002006cfdffffff0000000000046c05000000"
    "000000000000000000047501000000617505000000c3a9edb28075000000007301000000784e54466700"
    "0000000000f83f6700000000000000805b0200000069010000007501000000627b75010000006b5b0200"
    "00004e67000000000000044030"
)
MARSHAL_STABLE = marshal.dumps(_KNOWN, _VERSION) == _KNOWN_BYTES


def _plain(value: Any) -> Any:
    """A JSON-able stand-in for a row value, the same for the same value in any process."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return list(value)
    return str(value)


def image_text(event: RowChange) -> str:
    """The event's image as canonical JSON: operation, before and after.

    Two reads of an unchanged row (or of an immutable change-log row) give the
    same text; any change to a column changes it.
    """
    before = event.before
    after = event.after
    return json.dumps(
        [
            event.op,
            None if before is None else dict(before),
            None if after is None else dict(after),
        ],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        default=_plain,
    )


def _image_key(event: RowChange) -> str:
    """What the image digest hashes: the same text for the same image, in any
    process reading the source the same way, and cheap (this runs for every
    delivered event). An event over a fetched row tuple hashes the tuple's
    ``repr`` with the column names; any other, its images' items. Values whose
    ``repr`` would name a memory address fall back to :func:`image_text`.
    """
    row = getattr(event, "_row", None)
    shape = getattr(event, "_shape", None)
    if row is not None and shape is not None:
        text = repr((shape.op, shape.columns, tuple(row)))
    else:
        before, after = event.before, event.after
        text = repr(
            (
                event.op,
                None if before is None else tuple(before.items()),
                None if after is None else tuple(after.items()),
            )
        )
    return image_text(event) if " at 0x" in text else text


def _image_bytes(event: RowChange) -> bytes:
    return _image_key(event).encode("utf-8", "surrogatepass")


def image_digest(event: RowChange) -> str:
    """The image's CRC-32, 8 hex digits: tells a changed row (a changed row keeps
    its digest once in four billion times; the batch's ``images`` digest, a
    SHA-256 over the images themselves, has no such chance)."""
    return f"{zlib.crc32(_image_bytes(event)):08x}"


def digest_images(events: Iterable[RowChange]) -> str:
    """``sha256:...`` over the events' images, in order."""
    h = hashlib.sha256()
    for event in events:
        h.update(_image_bytes(event))
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def row_batch(events: Sequence[RowChange]) -> tuple[Any, list[Any]] | None:
    """The shape and row tuples when every event is a fetched row of one shape (or of
    shapes alike: a replay reads a recorded range in several fetches)."""
    if type(events) is KeptRows:
        return events.shape, events.rows
    batch_shape = getattr(events[0], "_shape", None) if events else None
    if batch_shape is None:
        return None
    try:
        shapes = set(map(_shape_of, events))
        rows = list(map(_row_of, events))
    except AttributeError:  # an event of another kind among them
        return None
    if shapes != {batch_shape} and {_likeness(s) for s in shapes} != {_likeness(batch_shape)}:
        return None
    return batch_shape, rows


def _likeness(shape: Any) -> tuple[Any, ...]:
    """What a batch's lines depend on of its rows' shape."""
    return (shape.op, tuple(shape.columns), shape.single_index, tuple(shape.pk_names))


_shape_of, _row_of = attrgetter("_shape"), attrgetter("_row")


def _row_text(row: Any) -> bytes:
    return repr(row if type(row) is tuple else tuple(row)).encode("utf-8", "surrogatepass")


def _seed(shape: Any) -> int:
    """The CRC of what every row of a shape shares (operation and column names)."""
    return _seed_of(shape.op, tuple(shape.columns))


@functools.lru_cache(maxsize=64)
def _seed_of(op: str, columns: tuple[str, ...]) -> int:
    # (a shape is a batch's; its source's next batches have the same columns)
    return zlib.crc32(repr((op, columns)).encode("utf-8", "surrogatepass"))


@functools.lru_cache(maxsize=64)
def _row_format(width: int) -> str:
    """A ``%`` format that writes a row of ``width`` values as its tuple's ``repr``,
    then a newline: ``tuple.__repr__`` is ``(``, the items' ``repr`` joined by
    ``, ``, ``)``, with a ``,`` before the ``)`` for one item."""
    return "(" + ", ".join(["%r"] * width) + ("," if width == 1 else "") + ")\n"


def _row_texts(shape: Any, rows: list[Any]) -> tuple[list[bytes], bytes]:
    """Each row's ``repr`` (that of ``tuple(row)``), UTF-8 with surrogates passed,
    and all of them joined by newlines.

    The same bytes as ``repr(tuple(row)).encode(...)`` row by row, made in three C
    calls for the batch: the batch's values flattened, one ``%`` format of them
    (``%r`` is ``repr``), one encode, one split at the newlines. A split is exact
    when the text has one newline a row: ``repr`` of a ``str``, number, date or
    ``bytes`` never writes one (it escapes it), and a batch whose values'
    ``repr`` does (a foreign object's) has more, and is made row by row.
    """
    count = len(rows)
    width = len(shape.columns)
    if count and set(map(len, rows)) == {width}:
        flat = tuple(itertools.chain.from_iterable(rows))
        joined = (_row_format(width) * count % flat).encode("utf-8", "surrogatepass")
        if joined.count(b"\n") == count:
            texts = joined.split(b"\n")
            texts.pop()  # after the last newline: empty
            return texts, joined
    texts = [_row_text(row) for row in rows]
    return texts, b"\n".join(texts)


def _marshal_stable(remake: bool) -> bool:
    """Whether format-3 images can be made here; a replay (``remake``) that needs
    them where they cannot is refused, not compared as if every row changed."""
    if MARSHAL_STABLE or not remake:
        return MARSHAL_STABLE
    raise ReplayRefusedError(
        "this history's records hash their rows with marshal (detail format 3), and "
        "this Python's marshal writes other bytes than the Python that wrote them: "
        "every row would read as changed; replay with a Python whose marshal writes "
        "them (3.6 to 3.13 do)"
    )


def row_crcs(
    events: Sequence[RowChange], shape: Any, rows: list[Any], form: int, *, remake: bool = False
) -> tuple[list[int], int]:
    """The image CRC-32 of each of a batch's ``rows`` (over ``shape``; ``events``
    are their events) and the format they are in: ``form`` when ``remake`` (a
    replay making a record's images again), else the newest format up to
    ``form`` that the batch can be written in (see the module docstring).

    The common case makes no Python call a row: one marshal and one CRC-32 a
    row, mapped at C speed. A batch holding a value marshal cannot write (a
    timestamp, a decimal) stops at the first such row, and is format 2."""
    if form >= MARSHAL_IMAGES and _marshal_stable(remake) and (remake or _marshals(rows[:1])):
        seed = _seed(shape)
        tuples = rows if set(map(type, rows)) <= {tuple} else list(map(tuple, rows))
        try:
            texts = map(marshal.dumps, tuples, itertools.repeat(_VERSION))
            return list(map(zlib.crc32, texts, itertools.repeat(seed))), MARSHAL_IMAGES
        except ValueError:  # ("unmarshallable object")
            if remake:
                return _remade(events, shape, rows, tuples, seed), MARSHAL_IMAGES
    return _repr_crcs(events, shape, rows), REPR_IMAGES


def _marshals(rows: list[Any]) -> bool:
    """Whether marshal writes the first row (a table with a timestamp or decimal
    column fails there: its batches go to format 2 without a look at every row)."""
    try:
        marshal.dumps(tuple(rows[0]) if rows else (), _VERSION)
    except ValueError:
        return False
    return True


def _remade(
    events: Sequence[RowChange], shape: Any, rows: list[Any], tuples: list[Any], seed: int
) -> list[int]:
    """Format 3 made again for rows some of which marshal cannot write (every row of
    a format-3 record could be): those are hashed as in format 2, and read as changed."""
    crcs = _repr_crcs(events, shape, rows)
    for i, row in enumerate(tuples):
        with contextlib.suppress(ValueError):
            crcs[i] = zlib.crc32(marshal.dumps(row, _VERSION), seed)
    return crcs


def _repr_crcs(events: Sequence[RowChange], shape: Any, rows: list[Any]) -> list[int]:
    """Format 2: one ``%`` format for the batch's texts (:func:`_row_texts`), then
    one CRC-32 a text. A row whose ``repr`` names a memory address (an object
    without a value ``repr``) is hashed from its canonical JSON instead."""
    texts, joined = _row_texts(shape, rows)
    crcs = list(map(zlib.crc32, texts, itertools.repeat(_seed(shape))))
    if b" at 0x" in joined:
        for i, text in enumerate(texts):
            if b" at 0x" in text:
                crcs[i] = zlib.crc32(_image_bytes(events[i]))
    return crcs


def image_crc(event: RowChange, form: int = MARSHAL_IMAGES) -> int:
    """What a detail of format ``form`` records as an event's image CRC-32 (a
    batch of this one event made again in that format)."""
    shape = getattr(event, "_shape", None)
    row = getattr(event, "_row", None)
    if shape is not None and row is not None:
        if form >= MARSHAL_IMAGES and _marshal_stable(remake=True):
            with contextlib.suppress(ValueError):
                values = row if type(row) is tuple else tuple(row)
                return zlib.crc32(marshal.dumps(values, _VERSION), _seed(shape))
        text = _row_text(row)
        if b" at 0x" not in text:
            return zlib.crc32(text, _seed(shape))
    return zlib.crc32(_image_bytes(event))


__all__ = [
    "MARSHAL_IMAGES",
    "MARSHAL_STABLE",
    "REPR_IMAGES",
    "digest_images",
    "image_crc",
    "image_digest",
    "image_text",
    "row_batch",
    "row_crcs",
]
