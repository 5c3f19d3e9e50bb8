"""A driver failure in any of the claim queue's operations leaves as the typed error
that says what failed and what happens next, cause chained, never a raw SQLAlchemy
error (one mapping, ``dbtrigger._driver_errors.failed_as``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger import ClaimSource
from dbtrigger._driver_errors import failed_as
from dbtrigger.errors import CommitError, ConfigurationError, FetchError
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs

TOKEN = "t" * 32


@pytest.fixture
def dropped(sqlite_db: TestDatabase) -> Iterator[ClaimSource]:
    """A source whose table was checked, then dropped under it."""
    make_jobs(sqlite_db, 3)
    src = ClaimSource(url=sqlite_db.url, table="jobs", schema=sqlite_db.schema, pk_columns=["id"])
    assert src.counts().claimable_now == 3  # the table's definition is read and kept
    sqlite_db.execute(f"DROP TABLE {sqlite_db.qualified('jobs')}")
    yield src
    src.close()


OPERATIONS: list[tuple[str, Callable[[ClaimSource], Any], type[Exception], str]] = [
    ("counts", lambda s: s.counts(), FetchError, "status of sqlite:jobs failed: "),
    (
        "extend",
        lambda s: s.extend(token=TOKEN, visibility=5),
        FetchError,
        "claim extension on sqlite:jobs failed: ",
    ),
    (
        "settle",
        lambda s: s.settle(token=TOKEN, done=[(1,)]),
        CommitError,
        "recording outcomes on sqlite:jobs failed: ",
    ),
    ("dead_rows", lambda s: s.dead_rows(), FetchError, "reading dead rows of sqlite:jobs failed: "),
    (
        "discard_dead",
        lambda s: s.discard_dead([(1,)], note="x"),
        CommitError,
        "discarding dead rows of sqlite:jobs failed: ",
    ),
    (
        "redrive_dead",
        lambda s: s.redrive_dead(note="x", dry_run=False),
        CommitError,
        "re-driving dead rows of sqlite:jobs failed: ",
    ),
    (
        "prune",
        lambda s: s.prune(older_than_seconds=0, dry_run=False),
        CommitError,
        "pruning sqlite:jobs failed: ",
    ),
    (
        "enqueue",
        lambda s: s.enqueue([{"id": 9, "payload": "p"}]),
        CommitError,
        "enqueueing 1 row(s) into sqlite:jobs failed: ",
    ),
    (
        "cancel",
        lambda s: s.cancel([1], reason="x"),
        CommitError,
        "canceling rows of sqlite:jobs failed: ",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "prefix"), [o[1:] for o in OPERATIONS], ids=[o[0] for o in OPERATIONS]
)
def test_a_driver_failure_is_the_typed_error_naming_the_operation(
    dropped: ClaimSource, call: Callable[[ClaimSource], Any], error: type[Exception], prefix: str
) -> None:
    with pytest.raises(error) as info:
        call(dropped)
    message = str(info.value)
    assert message.startswith(prefix), message
    assert "no such table" in message  # the driver's first line, shortened
    assert isinstance(info.value.__cause__, SQLAlchemyError)


def test_what_happens_next_follows_the_driver_text(dropped: ClaimSource) -> None:
    with pytest.raises(CommitError, match=r"; the claim expires and the rows are claimed again$"):
        dropped.settle(token=TOKEN, done=[(1,)])
    with pytest.raises(CommitError, match=r"; nothing was inserted$"):
        dropped.enqueue([{"id": 9, "payload": "p"}])
    with pytest.raises(CommitError, match=r"; nothing was changed$"):
        dropped.cancel([1], reason="x")


def test_failed_as_maps_only_driver_errors() -> None:
    mapped = failed_as(FetchError, "reading q failed", "; later")
    with (
        pytest.raises(FetchError, match=r"^reading q failed: SQLAlchemyError: boom; later$"),
        mapped,
    ):
        raise SQLAlchemyError("boom\nSELECT secret FROM t")
    # dbtrigger's own errors and anything outside the driver's tree pass through
    with pytest.raises(ConfigurationError, match="ours"), failed_as(FetchError, "q"):
        raise ConfigurationError("ours")
    with pytest.raises(KeyError), failed_as(FetchError, "q"):
        raise KeyError("k")
