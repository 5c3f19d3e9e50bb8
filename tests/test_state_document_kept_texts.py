"""A commit's encoding keeps what it can from the last one: the bytes never change.

:func:`~dbtrigger.state.document.dumps` carries the journal's joined text and
the document's first fields (name, fingerprint, source definition) from one
call to the next (:mod:`dbtrigger.state.kept_texts`), a commit's transitions
copy the document without running ``__init__``
(:func:`~dbtrigger.state.document.evolve`), and a UTC time is formatted in one
``isoformat`` call. Each is held here to what the general path gives: the
plain encoding of the whole document, ``dataclasses.replace``, the conversion.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbtrigger.cursor import Position
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.codec import format_time
from dbtrigger.state.document import Checkpoint, Lease, StateDocument, evolve
from dbtrigger.state.journal import JournalEntry

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 4, 7, 1, 23, tzinfo=UTC)


def plain(doc: StateDocument) -> bytes:
    return json.dumps(docmod.to_json(doc), separators=(",", ":")).encode("utf-8")


def held(token: int = 3) -> StateDocument:
    return StateDocument(
        poller_name="orders",
        source_fingerprint="sha256:abc",
        lease=Lease("me", token, T0, T0, T0 + dt.timedelta(seconds=60)),
        source_definition={"fingerprint": "sha256:abc", "table": "orders", "pk_columns": ["id"]},
    )


def commit(doc: StateDocument, i: int, *, limit: int = 20) -> StateDocument:
    now = T0 + dt.timedelta(seconds=i)
    before, after = Position(cursor=i, pk={"id": i}), Position(cursor=i + 1, pk={"id": i + 1})
    return leasemod.decide_commit(
        doc,
        owner="me",
        token=3,
        position=after,
        batch_id=f"b{i}",
        row_count=10,
        now=now,
        ttl=dt.timedelta(seconds=60),
        release=False,
        journal_entry=JournalEntry.commit(
            batch_id=f"b{i}",
            before=before,
            after=after,
            rows=10,
            owner_id="me",
            fencing_token=3,
            now=now,
            started_at=now,
        ),
        journal_limit=limit,
    )


def test_a_chain_of_commits_dumps_to_the_plain_encoding() -> None:
    doc = held()
    for i in range(45):  # the journal grows to its limit, then slides
        doc = commit(doc, i)
        assert docmod.dumps(doc) == plain(doc)
    assert len(doc.journal) == 20


# One step of a writer's life: a commit (any journal limit, shrinking ones
# included), the same document dumped again, another document (another poller
# in the process), a new source definition, or a hand-built journal of plain
# dicts, one of which is then changed in place.
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), st.integers(0, 25)),
        st.tuples(st.just("again"), st.just(0)),
        st.tuples(st.just("other"), st.just(0)),
        st.tuples(st.just("definition"), st.integers(0, 3)),
        st.tuples(st.just("plain"), st.integers(0, 3)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(STEPS)
def test_every_step_dumps_to_the_plain_encoding(steps: list[tuple[str, int]]) -> None:
    doc, other = held(), held()
    for i, (step, arg) in enumerate(steps):
        if step == "commit":
            doc = commit(doc, i, limit=arg)
        elif step == "other":
            other = commit(other, i)
            assert docmod.dumps(other) == plain(other)
        elif step == "definition":
            doc = dataclasses.replace(
                doc, source_definition={**(doc.source_definition or {}), "table": f"t{arg}"}
            )
        elif step == "plain":
            entries: tuple[Any, ...] = tuple(dict(e) for e in doc.journal) or ({"n": arg},)
            doc = dataclasses.replace(doc, journal=entries)
            assert docmod.dumps(doc) == plain(doc)
            entries[-1]["changed"] = arg  # a plain dict may change in place
        assert docmod.dumps(doc) == plain(doc)


@pytest.mark.parametrize(
    ("obj", "changes"),
    [
        (held(), {"lease": None, "failure": None}),
        (held(), {"journal": ({"a": 1},), "extra": {"x": 1}}),
        (Lease("me", 1, T0, T0, T0, extra={"k": 1}), {"heartbeat_at": T0, "released": True}),
        (Checkpoint(Position(cursor=1, pk={"id": 1}), "b", T0), {"row_count": 5}),
    ],
)
def test_evolve_is_dataclasses_replace(obj: Any, changes: dict[str, Any]) -> None:
    new = evolve(obj, **changes)
    want = dataclasses.replace(obj, **changes)
    assert type(new) is type(want)
    assert new == want
    assert new.__dict__ == want.__dict__
    assert obj == dataclasses.replace(obj)  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.version = 2  # still frozen
    with pytest.raises(TypeError, match="no field"):
        evolve(obj, not_a_field=1)


@pytest.mark.parametrize(
    "value",
    [
        T0,
        dt.datetime(1, 1, 1, tzinfo=UTC),
        dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        dt.datetime(2026, 4, 7, 1, 23, 0, 5, tzinfo=UTC),
        dt.datetime(2026, 4, 7, 1, 23, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        dt.datetime(2026, 4, 7, 1, 23, tzinfo=dt.timezone(dt.timedelta(0))),
    ],
)
def test_format_time_of_utc_is_the_converted_text(value: dt.datetime) -> None:
    converted = value.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds")
    assert format_time(value) == converted + "Z"
