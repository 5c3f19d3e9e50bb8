"""Queue configuration errors and the pure outcome rules (no database for the rules)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dbtrigger import ClaimSource, QueueTrigger
from dbtrigger.errors import ConfigurationError, PartialBatchError
from dbtrigger.queue.cli import parse_duration
from dbtrigger.queue.outcome import Backoff, Mark, decide
from dbtrigger.queue.statements import DeadItem
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs


def plan_for(
    marks: dict[tuple[Any, ...], Mark] | None = None,
    failure: BaseException | None = None,
    attempts: tuple[int, ...] = (1, 1, 1),
    max_attempts: int = 3,
) -> Any:
    keys = [(i,) for i in range(1, len(attempts) + 1)]
    return decide(
        list(zip(keys, attempts, strict=True)),
        pks={k: {"id": k[0]} for k in keys},
        marks=marks or {},
        failure=failure,
        max_attempts=max_attempts,
        backoff=Backoff(1.0, 10.0),
        rng=random.Random(0),
    )


def test_all_accepted() -> None:
    plan = plan_for()
    assert (plan.done, plan.retry, plan.dead) == ([(1,), (2,), (3,)], [], [])


def test_reject_is_dead_at_once_even_on_the_first_attempt() -> None:
    plan = plan_for({(2,): Mark("reject", "no customer")})
    assert plan.dead == [DeadItem((2,), "rejected: no customer")]
    assert plan.done == [(1,), (3,)]


def test_exception_fails_every_unmarked_row_and_reject_still_wins() -> None:
    """The exception falls on rows 2 and 3 together: nobody's failure, so they are
    split (row 3 at max_attempts is not dead for it); on one row it counts."""
    plan = plan_for({(1,): Mark("reject", "bad")}, failure=RuntimeError("boom"), attempts=(1, 1, 3))
    assert [d.key for d in plan.dead] == [(1,)]
    assert [(r.key, r.error) for r in plan.retry] == [
        (key, "failed with 1 other row(s): RuntimeError: boom") for key in [(2,), (3,)]
    ]
    assert len({r.group for r in plan.retry}) == 2
    assert None not in {r.group for r in plan.retry}
    assert plan.done == []
    retry = Mark("retry", "later")
    alone = plan_for({(1,): retry, (2,): retry}, failure=RuntimeError("boom"), attempts=(1, 1, 3))
    assert [(d.key, d.error) for d in alone.dead] == [
        ((3,), "failed 3 times; last: RuntimeError: boom")
    ]
    assert [(r.key, r.group) for r in alone.retry] == [((1,), None), ((2,), None)]


def test_partial_batch_error_names_rows() -> None:
    plan = plan_for(failure=PartialBatchError([{"id": 3}], causes={0: KeyError("sku")}))
    assert plan.done == [(1,), (2,)]
    assert [(r.key, r.error) for r in plan.retry] == [((3,), "KeyError: 'sku'")]


def test_retry_mark_with_explicit_delay() -> None:
    plan = plan_for({(1,): Mark("retry", "429", delay_seconds=42.0)})
    assert plan.retry[0].delay_seconds == 42.0
    assert plan.retry[0].error == "retry requested: 429"


def test_backoff_is_exponential_jittered_and_capped() -> None:
    backoff = Backoff(1.0, 10.0)
    rng = random.Random(3)
    assert [backoff.bound(a) for a in (1, 2, 3, 4, 5, 50)] == [1, 2, 4, 8, 10, 10]
    for attempt in (1, 2, 3, 9):
        for _ in range(50):
            delay = backoff.delay(attempt, rng)
            assert backoff.bound(attempt) / 2 <= delay <= backoff.bound(attempt)
    with pytest.raises(ConfigurationError):
        Backoff(5.0, 1.0)


def test_error_text_is_redacted_and_bounded() -> None:
    plan = plan_for(failure=RuntimeError("Password=s3cr3t " + "x" * 5000), attempts=(1,))
    assert "s3cr3t" not in plan.retry[0].error
    assert len(plan.retry[0].error) == 2000


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "2h", "7d", "1w")] == [
        90,
        90,
        900,
        7200,
        604800,
        604800,
    ]
    with pytest.raises(ConfigurationError):
        parse_duration("soon")


def test_both_prune_commands_read_an_age_the_same_way() -> None:
    """The change log's --older-than used to refuse bare seconds and spaces the queue's took."""
    from dbtrigger.cli.changelog import parse_duration as changelog_age  # noqa: PLC0415

    for text in ("3600", " 90 s", "15m", "2h", "1.5d", "1w"):
        assert changelog_age(text).total_seconds() == parse_duration(text)
    for text in ("soon", "-5m", "5 minutes", ""):
        with pytest.raises(ConfigurationError, match="not a duration"):
            changelog_age(text)
        with pytest.raises(ConfigurationError, match="not a duration"):
            parse_duration(text)


# --- bad configuration ---------------------------------------------------------------


def source(db: TestDatabase, **kw: Any) -> ClaimSource:
    options: dict[str, Any] = {
        "url": db.url,
        "table": "jobs",
        "schema": db.schema,
        "pk_columns": ["id"],
    }
    options.update(kw)
    return ClaimSource(**options)


def test_where_must_not_touch_claim_columns(sqlite_db: TestDatabase) -> None:
    with pytest.raises(ConfigurationError, match="refers to a claim column"):
        source(sqlite_db, where="DBT_STATUS = 'ready' AND kind = 'x'")


def test_visibility_timeout_must_exceed_two_heartbeats(sqlite_db: TestDatabase) -> None:
    with pytest.raises(ConfigurationError, match="more than twice heartbeat_interval_seconds"):
        QueueTrigger(
            name="q",
            source=source(sqlite_db),
            visibility_timeout_seconds=10,
            heartbeat_interval_seconds=20,
        )
    with pytest.raises(ConfigurationError, match="more than twice"):
        QueueTrigger(
            name="q",
            source=source(sqlite_db),
            visibility_timeout_seconds=10,
            heartbeat_interval_seconds=5,
        )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"visibility_timeout_seconds": 0}, "visibility_timeout_seconds"),
    ],
)
def test_trigger_numbers(sqlite_db: TestDatabase, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        QueueTrigger(name="q", source=source(sqlite_db), **kw)


def test_source_options(sqlite_db: TestDatabase) -> None:
    with pytest.raises(ConfigurationError, match="mode"):
        source(sqlite_db, mode="rotating")
    with pytest.raises(ConfigurationError, match="on_done"):
        source(sqlite_db, on_done="archive")
    with pytest.raises(ConfigurationError, match="only used with mode='sidecar'"):
        source(sqlite_db, cursor_column="updated_at")
    with pytest.raises(ConfigurationError, match="list of column names"):
        source(sqlite_db, pk_columns="id")
    with pytest.raises(ConfigurationError, match="safe SQL identifier"):
        source(sqlite_db, table="jobs; drop table x")


def test_missing_claim_columns_print_the_install_command(db: TestDatabase) -> None:
    make_jobs(db, 1, install=False)
    src = source(db)
    try:
        with pytest.raises(ConfigurationError) as info:
            src.claim(limit=1, token="t" * 32, worker="w", visibility=1)
    finally:
        src.close()
    message = str(info.value)
    assert "dbtrigger queue install --url" in message
    assert "--table jobs" in message
    assert "dbt_status" in message


def test_pk_columns_must_be_unique(db: TestDatabase) -> None:
    make_jobs(db, 1)
    src = source(db, pk_columns=["payload"])
    try:
        with pytest.raises(ConfigurationError, match="are not unique"):
            src.claim(limit=1, token="t" * 32, worker="w", visibility=1)
    finally:
        src.close()
    src = source(db, pk_columns=["nope"])
    try:
        with pytest.raises(ConfigurationError, match="has no column"):
            src.claim(limit=1, token="t" * 32, worker="w", visibility=1)
    finally:
        src.close()


def test_old_mariadb_is_refused(mariadb: TestDatabase, monkeypatch: pytest.MonkeyPatch) -> None:
    make_jobs(mariadb, 1)
    src = source(mariadb)
    try:
        dialect = src.engine.dialect
        with src.engine.connect():
            pass
        monkeypatch.setattr(dialect, "server_version_info", (10, 5, 9))
        with pytest.raises(ConfigurationError, match=r"MariaDB 10\.5\.9 has no FOR UPDATE SKIP"):
            src.claim(limit=1, token="t" * 32, worker="w", visibility=1)
    finally:
        src.close()


def test_a_keyset_source_is_not_a_claim_source(sqlite_db: TestDatabase) -> None:
    from dbtrigger import SqlAlchemySource  # noqa: PLC0415

    keyset = SqlAlchemySource(url=sqlite_db.url, table="jobs", cursor_column="v", pk_columns=["id"])
    with pytest.raises(ConfigurationError, match="needs a ClaimSource"):
        QueueTrigger(name="q", source=keyset)  # type: ignore[arg-type]
