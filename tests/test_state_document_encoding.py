"""``dumps`` splices kept journal texts into the document: the bytes never change.

The journal entries of a document keep their encoded JSON
(:class:`~dbtrigger.state.document.JournalRecord`), and :func:`dumps` assembles
the document around them instead of encoding the whole object on every commit.
These tests hold it to exactly what the plain encoding writes,
``json.dumps(to_json(doc), separators=(",", ":"))``, over hand-built and
generated documents (unknown fields kept, unicode, the window) and over every
document a real poller writes.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.cursor import Position
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state import document as docmod
from dbtrigger.state.document import (
    Checkpoint,
    FailureRecord,
    JournalRecord,
    Lease,
    StateDocument,
)
from dbtrigger.state.journal import JournalEntry, Outcomes, encode
from dbtrigger.state.window import Bound, Pending, Window

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 4, 7, 1, 23, tzinfo=UTC)


def plain(doc: StateDocument) -> bytes:
    """The reference: the whole document encoded in one go."""
    return json.dumps(docmod.to_json(doc), separators=(",", ":")).encode("utf-8")


def assert_same_bytes(doc: StateDocument) -> bytes:
    want = plain(doc)
    assert docmod.dumps(doc) == want
    assert docmod.dumps(doc) == want  # again, from the kept texts
    if docmod._TOP_KEYS.isdisjoint(doc.extra):  # else only a hand-built document
        reread = docmod.loads(want)
        assert docmod.dumps(reread) == want  # a read document writes back what it read
    return want


def commit_entry(i: int, **kw: Any) -> dict[str, object]:
    return encode(
        JournalEntry.commit(
            batch_id=f"batch_{i:04d}",
            before=Position(cursor=T0 + dt.timedelta(seconds=i), pk={"id": i}),
            after=Position(cursor=T0 + dt.timedelta(seconds=i + 1), pk={"id": i + 1}),
            rows=100,
            owner_id="funcapp/instance-é",
            fencing_token=7,
            now=T0 + dt.timedelta(seconds=i, milliseconds=5),
            started_at=T0 + dt.timedelta(seconds=i),
            **kw,
        )
    )


def full_document() -> StateDocument:
    """Every field the format has, unknown ones included, and non-ASCII text."""
    window = Window(
        settled=(Position(cursor=12, pk={"id": 12}),),
        pending=(Pending(Position(cursor=11, pk={"id": 11}), 2, T0, "429 from billing ☃"),),
        bound=Bound(40, 4096),
        extra={"written_by_a_newer": "dbtrigger ✓"},
    )
    doc = StateDocument(
        poller_name="orders-ü",
        source_fingerprint="sha256:abc",
        checkpoint=Checkpoint(
            position=Position(cursor=T0, pk={"id": 10, "region": "eu"}),
            last_successful_batch_id="batch_0010",
            updated_at=T0,
            row_count=100,
            extra={"future": [1, {"x": None}], "metadata": {"source_lsn": "0/16B3748"}},
        ),
        lease=Lease(
            owner_id="funcapp/instance-abc123",
            fencing_token=42,
            acquired_at=T0,
            heartbeat_at=T0,
            expires_at=T0 + dt.timedelta(minutes=2),
            extra={"host": "数据库"},
        ),
        failure=FailureRecord(
            attempts=3,
            first_failed_at=T0,
            last_failed_at=T0,
            last_error='ValueError: naïve "quoted" \\ \n line',
            batch_id="batch_0011",
            from_position=Position(cursor=T0, pk={"id": 10}),
            done=("e1", "e2"),
            done_total=5,
            batch_end=Position(cursor=T0, pk={"id": 20}),
            batch_rows=10,
            batch_digest="sha256:def",
            extra={"next_field": 1.5},
        ),
        extra={"written_by": "dbtrigger 9.9", "zeta": {"nested": ["\u2028", "\U0001f600"]}},
        window=window,
    )
    for i in range(25):
        outcomes = None
        if i % 3 == 0:
            outcomes = Outcomes(
                accepted=90,
                rejected=4,
                failed=6,
                subscribers={"search": Outcomes(95, 0, 5), "billing": Outcomes(96, 4, 0)},
            )
        doc = doc.with_journal_entry(
            commit_entry(i, quarantined=i % 2, outcomes=outcomes), limit=20
        )
    return doc.with_journal_entry(
        {"type": "manual", "operation": "reset", "actor": "ops@höst", "reason": "ünïcode"},
        limit=20,
    )


DOCUMENTS = [
    pytest.param(StateDocument("orders", "sha256:abc"), id="new"),
    pytest.param(full_document(), id="every field"),
    pytest.param(StateDocument("o", "f", window=Window()), id="empty window"),
    pytest.param(StateDocument("o", "f", journal=({"a": 1}, {})), id="plain dict entries"),
    pytest.param(
        StateDocument("o", "f", extra={"version": 0, "poller_name": "x", "a": 1}),
        id="extra naming known fields",
    ),
    pytest.param(
        StateDocument("o", "f", journal=({"a": 1},), extra={"journal": 1, "window": 2}),
        id="extra naming journal and window",
    ),
]


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_dumps_is_byte_identical_to_encoding_the_whole_document(doc: StateDocument) -> None:
    assert_same_bytes(doc)


def test_the_full_document_keeps_its_unknown_fields_and_text() -> None:
    data = assert_same_bytes(full_document())
    assert b"\\u2603" in data  # ASCII-only, as before
    assert b"\\ud83d\\ude00" in data
    raw = json.loads(data)
    assert list(raw)[:2] == ["written_by", "zeta"]  # unknown top-level keys lead, as before
    assert list(raw)[-2:] == ["journal", "window"]
    assert len(raw["journal"]) == 20


def test_a_commit_reuses_the_kept_texts_of_earlier_entries() -> None:
    doc = full_document()
    docmod.dumps(doc)
    kept = [entry.json_text() for entry in doc.journal if isinstance(entry, JournalRecord)]
    assert len(kept) == 20
    nxt = doc.with_journal_entry(commit_entry(99), limit=20)
    assert all(a is b for a, b in zip(doc.journal[1:], nxt.journal[:-1], strict=True))
    assert docmod.dumps(nxt) == plain(nxt)


def test_journal_records_are_read_only_dicts() -> None:
    record = JournalRecord({"type": "commit", "rows": 3})
    assert isinstance(record, dict)
    assert record == {"type": "commit", "rows": 3}
    assert repr(record) == "{'type': 'commit', 'rows': 3}"
    text = record.json_text()
    with pytest.raises(TypeError, match="read-only"):
        record["rows"] = 4
    for mutate in (
        lambda: record.update(rows=4),
        lambda: record.pop("rows"),
        lambda: record.setdefault("x", 1),
        record.clear,
        record.popitem,
        lambda: record.__delitem__("rows"),
        lambda: record.__ior__({"rows": 4}),
    ):
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    assert record.json_text() == text == '{"type":"commit","rows":3}'
    pickled = pickle.loads(pickle.dumps(record))  # noqa: S301 - our own bytes
    for clone in (copy.copy(record), copy.deepcopy(record), pickled):
        assert type(clone) is JournalRecord
        assert clone == record
    assert dict(record) | {"rows": 4} == {"type": "commit", "rows": 4}


# --- generated documents ----------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
SCALAR = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
OBJECT = st.dictionaries(TEXT, JSON, max_size=5)
TIMES = st.datetimes(
    min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(9999, 1, 1), timezones=st.just(UTC)
)


def _windows() -> st.SearchStrategy[Window]:
    return st.builds(
        Window,
        settled=st.lists(POSITIONS, max_size=3).map(tuple),
        pending=st.lists(
            st.builds(Pending, position=POSITIONS, attempts=st.integers(1, 9), not_before=TIMES),
            max_size=3,
        ).map(tuple),
        bound=st.none() | st.builds(Bound, st.integers(1, 2000), st.integers(1024, 10**6)),
        extra=unknown(frozenset({"settled", "pending", "bound"})),
    )


POSITIONS = st.builds(
    Position,
    cursor=st.integers() | TIMES | TEXT,
    pk=st.dictionaries(st.sampled_from(["id", "region", "ключ"]), st.integers() | TEXT, min_size=1),
)


def unknown(known: frozenset[str]) -> st.SearchStrategy[dict[str, Any]]:
    return OBJECT.map(lambda extra: {k: v for k, v in extra.items() if k not in known})


WINDOWS = st.deferred(_windows)


@st.composite
def documents(draw: st.DrawFn) -> StateDocument:
    doc = StateDocument(
        poller_name=draw(TEXT),
        source_fingerprint=draw(TEXT),
        checkpoint=draw(
            st.none()
            | st.builds(
                Checkpoint,
                position=POSITIONS,
                last_successful_batch_id=st.none() | TEXT,
                updated_at=TIMES,
                row_count=st.integers(0, 10**6),
                extra=unknown(docmod._CHECKPOINT_KEYS),
            )
        ),
        lease=draw(
            st.none()
            | st.builds(
                Lease,
                owner_id=TEXT,
                fencing_token=st.integers(0, 10**9),
                acquired_at=TIMES,
                heartbeat_at=TIMES,
                expires_at=TIMES,
                released=st.booleans(),
                extra=unknown(docmod._LEASE_KEYS),
            )
        ),
        failure=draw(
            st.none()
            | st.builds(
                FailureRecord,
                attempts=st.integers(0, 100),
                first_failed_at=TIMES,
                last_failed_at=TIMES,
                last_error=TEXT,
                batch_id=st.none() | TEXT,
                from_position=st.none() | POSITIONS,
                done=st.lists(TEXT, max_size=3).map(tuple),
                done_total=st.integers(0, 10),
                extra=unknown(docmod._FAILURE_KEYS),
            )
        ),
        extra=draw(unknown(docmod._TOP_KEYS)),
        window=draw(st.none() | WINDOWS),
    )
    # Entries arrive the ways they do in practice: appended (read-only records,
    # some of them already encoded by an earlier write) or as plain mappings.
    for entry in draw(st.lists(OBJECT, max_size=6)):
        doc = doc.with_journal_entry(entry, limit=draw(st.integers(0, 8)))
        if draw(st.booleans()):
            docmod.dumps(doc)
    if draw(st.booleans()):
        doc = StateDocument(**{**doc.__dict__, "journal": tuple(map(dict, doc.journal))})
    return doc


#: Generated documents per run: 100 by default (CI time: generation is most of the
#: cost), DBTRIGGER_PROPERTY_EXAMPLES=1000 for a longer search.
EXAMPLES = int(os.environ.get("DBTRIGGER_PROPERTY_EXAMPLES", "100"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(documents())
def test_generated_documents_dump_to_the_plain_encoding(doc: StateDocument) -> None:
    assert docmod.dumps(doc) == plain(doc)
    assert docmod.dumps(doc) == plain(doc)


# --- what a poller writes ---------------------------------------------------------------


class RecordingStore(InMemoryCheckpointStore):
    """Keeps every document written (the bytes a poller produced from kept texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        self.written.append(data)
        return super().write(key, data, if_match=if_match)


def test_every_document_a_poller_writes_is_the_plain_encoding() -> None:
    source = MemorySource(
        [{"id": i, "v": i, "note": "ünï"} for i in range(1, 61)],
        cursor_column="v",
        pk_columns=["id"],
    )
    store = RecordingStore()
    ticks = iter(range(10**6))
    trigger = PollTrigger(
        name="items",
        source=source,
        checkpoint_store=store,
        batch_size=4,
        clock=lambda: T0 + dt.timedelta(seconds=10 * next(ticks)),  # retries come due
    )
    retried: set[int] = set()

    def handler(events: list[Any], ctx: BatchContext) -> None:
        for event in events:
            if event.pk["id"] % 7 == 0 and event.pk["id"] not in retried:
                retried.add(event.pk["id"])
                ctx.retry(event, "try again ☃")

    trigger.drain(handler)
    assert len(store.written) > 20
    assert any(b'"window"' in data for data in store.written)
    for data in store.written:
        assert data == plain(docmod.loads(data))
