"""The v1 state document: the contract's format, round trips, and clear errors."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from dbtrigger.cursor import Position
from dbtrigger.errors import CorruptStateError
from dbtrigger.state import document as docmod
from dbtrigger.state.document import Checkpoint, FailureRecord, Lease, StateDocument

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 4, 7, 1, 23, tzinfo=UTC)

# The reference example of the checkpoint/lease spec, written by another implementation.
SEED_EXAMPLE = {
    "version": 1,
    "poller_name": "orders",
    "source_fingerprint": "sha256:abc",
    "checkpoint": {
        "cursor": {
            "kind": "timestamp+pk",
            "value": "2026-04-07T01:23:45.123456Z",
            "tiebreaker": {"id": 12093},
        },
        "last_successful_batch_id": "batch_20260407_012346_0001",
        "updated_at": "2026-04-07T01:23:46.020000Z",
        "metadata": {"row_count": 100},
    },
    "lease": {
        "owner_id": "funcapp/instance-abc123",
        "fencing_token": 42,
        "acquired_at": "2026-04-07T01:23:00Z",
        "heartbeat_at": "2026-04-07T01:23:20Z",
        "expires_at": "2026-04-07T01:25:00Z",
    },
}


def full_document() -> StateDocument:
    return StateDocument(
        poller_name="orders",
        source_fingerprint="sha256:abc",
        checkpoint=Checkpoint(
            position=Position(dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=UTC), {"id": 7}),
            last_successful_batch_id="batch_1",
            updated_at=T0,
            row_count=100,
        ),
        lease=Lease("me", 3, T0, T0, T0 + dt.timedelta(minutes=2)),
        failure=FailureRecord(2, T0, T0, "ValueError: boom", "batch_2"),
        journal=({"type": "commit", "batch_id": "batch_1"},),
    )


def test_reads_the_contract_reference_example() -> None:
    doc = docmod.loads(json.dumps(SEED_EXAMPLE))
    assert doc.poller_name == "orders"
    assert doc.checkpoint is not None
    assert doc.checkpoint.position == Position(
        dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=UTC), {"id": 12093}
    )
    assert doc.checkpoint.row_count == 100
    assert doc.lease is not None
    assert doc.lease.fencing_token == 42
    assert doc.lease.expires_at == dt.datetime(2026, 4, 7, 1, 25, tzinfo=UTC)
    assert doc.lease.released is False


def test_written_document_has_the_contract_fields() -> None:
    raw = json.loads(docmod.dumps(full_document()))
    assert set(raw) >= {"version", "poller_name", "source_fingerprint", "checkpoint", "lease"}
    assert raw["version"] == 1
    assert set(raw["checkpoint"]) >= {
        "cursor",
        "last_successful_batch_id",
        "updated_at",
        "metadata",
    }
    assert set(raw["checkpoint"]["cursor"]) >= {"kind", "value", "tiebreaker"}
    assert raw["checkpoint"]["cursor"]["value"] == "2026-04-07T01:23:45.123456Z"
    assert raw["checkpoint"]["metadata"] == {"row_count": 100}
    assert set(raw["lease"]) >= {
        "owner_id",
        "fencing_token",
        "acquired_at",
        "heartbeat_at",
        "expires_at",
    }
    assert raw["lease"]["expires_at"] == "2026-04-07T01:25:00.000000Z"


def test_round_trip() -> None:
    doc = full_document()
    assert docmod.loads(docmod.dumps(doc)) == doc


def test_fresh_document_round_trip() -> None:
    doc = StateDocument(poller_name="p", source_fingerprint="sha256:x")
    back = docmod.loads(docmod.dumps(doc))
    assert back == doc
    assert back.position.is_beginning


def test_journal_is_bounded() -> None:
    doc = StateDocument(poller_name="p", source_fingerprint="f")
    for i in range(30):
        doc = doc.with_journal_entry({"n": i}, limit=5)
    assert [e["n"] for e in doc.journal] == [25, 26, 27, 28, 29]


def _mutated(path: list[str], value: object) -> bytes:
    raw = json.loads(json.dumps(SEED_EXAMPLE))
    target = raw
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (_mutated(["version"], 2), "version 2 is not supported"),
        (_mutated(["version"], KeyError), "version is missing"),
        (_mutated(["version"], "1"), "version has the wrong type"),
        (_mutated(["poller_name"], 5), "poller_name has the wrong type"),
        (_mutated(["source_fingerprint"], KeyError), "source_fingerprint is missing"),
        (_mutated(["checkpoint"], "x"), "checkpoint must be an object"),
        (_mutated(["checkpoint", "cursor"], KeyError), "checkpoint.cursor is missing"),
        (_mutated(["checkpoint", "cursor", "kind"], ""), "kind must be a non-empty string"),
        (_mutated(["checkpoint", "cursor", "value"], "yesterday"), "not a valid 'timestamp'"),
        (_mutated(["checkpoint", "cursor", "tiebreaker"], [1]), "tiebreaker must be an object"),
        (_mutated(["checkpoint", "cursor", "tiebreaker"], {"id": 1.5}), "has no kind"),
        (_mutated(["checkpoint", "updated_at"], "soon"), "updated_at is not an ISO-8601"),
        (_mutated(["checkpoint", "updated_at"], "2026-01-01T00:00:00"), "has no time zone"),
        (_mutated(["lease", "fencing_token"], "42"), "fencing_token has the wrong type"),
        (_mutated(["lease", "fencing_token"], True), "fencing_token has the wrong type"),
        (_mutated(["lease", "owner_id"], KeyError), "owner_id is missing"),
        (_mutated(["lease", "expires_at"], None), "expires_at must be an ISO-8601"),
        (_mutated(["lease"], 7), "lease must be an object"),
        # A required field set to null (a hand edit) is refused like a missing one: it used
        # to pass as None, so a tick met a bare TypeError (fencing_token), took a lease with
        # no owner (owner_id) and `dbtrigger status POLLER` crashed (source_fingerprint).
        (_mutated(["version"], None), "version is null; it must be an integer"),
        (_mutated(["poller_name"], None), "poller_name is null; it must be a string"),
        (_mutated(["source_fingerprint"], None), "source_fingerprint is null"),
        (_mutated(["checkpoint", "cursor"], None), "checkpoint.cursor is null"),
        (_mutated(["lease", "owner_id"], None), "lease.owner_id is null; it must be a string"),
        (_mutated(["lease", "fencing_token"], None), "lease.fencing_token is null"),
    ],
)
def test_malformed_documents_raise_corrupt_state_naming_the_field(
    data: bytes, message: str
) -> None:
    with pytest.raises(CorruptStateError, match=message):
        docmod.loads(data)


def test_naive_time_cannot_be_written() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        docmod.format_time(dt.datetime(2026, 1, 1))


def test_a_time_written_again_is_the_same_text_whatever_its_zone() -> None:
    # format_time keeps the texts of the last times it wrote (a commit writes the
    # same instant three times): an equal instant in another zone is that text, a
    # naive time equal to nothing stored is still refused.
    at = dt.datetime(2026, 1, 1, 12, 30, 0, 5, tzinfo=dt.timezone.utc)
    plus_two = at.astimezone(dt.timezone(dt.timedelta(hours=2)))
    assert docmod.format_time(at) == "2026-01-01T12:30:00.000005Z"
    assert docmod.format_time(plus_two) == "2026-01-01T12:30:00.000005Z"
    assert docmod.format_time(plus_two + dt.timedelta(microseconds=1)) == (
        "2026-01-01T12:30:00.000006Z"
    )
    with pytest.raises(ValueError, match="timezone-aware"):
        docmod.format_time(at.replace(tzinfo=None))
    for second in range(40):  # more than it keeps: each still its own text
        later = at + dt.timedelta(seconds=second)
        assert docmod.format_time(later) == later.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- the window is a typed field (issue #21 item 5) ------------------------------------


STORED_WINDOW = (
    '{"version":1,"poller_name":"p","source_fingerprint":"f","checkpoint":null,'
    '"lease":null,"failure":null,"journal":[],"window":{"settled":[{"kind":"int+pk",'
    '"value":3,"tiebreaker":{"id":3},"tiebreaker_kinds":{"id":"int"}}],"pending":[{"at":'
    '{"kind":"int+pk","value":2,"tiebreaker":{"id":2},"tiebreaker_kinds":{"id":"int"}},'
    '"attempts":1,"not_before":"2026-01-01T00:00:00.000000Z","reason":"busy"}],'
    '"bound":{"max_events":40,"max_bytes":4096},"later":{"kept":true}}}'
)


def test_a_stored_window_is_read_typed_and_written_back_byte_for_byte() -> None:
    from dbtrigger.state.window import Bound, Window  # noqa: PLC0415

    doc = docmod.loads(STORED_WINDOW)
    assert isinstance(doc.window, Window)
    assert doc.window.settled == (Position(cursor=3, pk={"id": 3}),)
    assert [(p.position.cursor, p.attempts, p.reason) for p in doc.window.pending] == [
        (2, 1, "busy")
    ]
    assert doc.window.bound == Bound(40, 4096)
    assert doc.window.extra == {"later": {"kept": True}}  # a newer writer's field survives
    assert docmod.dumps(doc).decode() == STORED_WINDOW
    # Equal windows are the same entries; the bound is what the writer had.
    assert Window(doc.window.settled, doc.window.pending) == doc.window


@pytest.mark.parametrize(
    ("window", "named"),
    [
        ("[1]", "window must be an object"),
        ('{"pending":[{"attempts":1}]}', "window.pending.at"),
        ('{"settled":"x"}', "window.settled"),
    ],
)
def test_a_malformed_window_is_refused_when_the_document_is_read(window: str, named: str) -> None:
    raw = STORED_WINDOW.split(',"window":', maxsplit=1)[0] + f',"window":{window}}}'
    with pytest.raises(CorruptStateError, match=named):
        docmod.loads(raw)


def test_an_empty_window_is_no_window() -> None:
    head = STORED_WINDOW.split(',"window":', maxsplit=1)[0]
    raw = head + ',"window":{"settled":[],"pending":[]}}'
    assert docmod.loads(raw).window is None
